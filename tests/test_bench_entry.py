"""The benches start as their docstrings say (``python -m bench.X --help``): a broken import or argument parser
shows here, not at the first timing run."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


BENCHES = ["bench.step_profile", "bench.peer_trl", "bench.bicc_overhead", "bench.checker_agreement", "bench.memory_model",
           "bench.rcc_variance", "bench.results", "bench.rollout_throughput", "bench.soak", "bench.step_model"]
HELP = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (module, e.code)
    print("ok", module, flush=True)
"""


def test_every_bench_starts_as_a_module():
    """``python -m bench.X --help`` for every bench, in one interpreter: a broken import (a bench that only ran
    with its own directory on sys.path) or argument parser shows here."""
    proc = subprocess.run([sys.executable, "-c", HELP, *BENCHES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")] == BENCHES
    assert proc.stdout.count("usage:") == len(BENCHES)


def test_step_model_phases_follow_the_plan():
    from bench.step_model import step_phases
    from bench.step_profile import compose_cfg
    from bicc.plan import StepPlan

    cost = {"forward": 1.0, "forward_backward": 3.0, "decode": 10.0}
    grpo = step_phases(StepPlan.from_config(compose_cfg(["bicc=off", "rcc=off"]), False), cost, 100.0, 2048)
    paper = step_phases(StepPlan.from_config(compose_cfg(["bicc=on", "rcc=on", "rcc.delta_from_update=false"]), False),
                        cost, 100.0, 2048)
    read = step_phases(StepPlan.from_config(compose_cfg(["bicc=on", "rcc=on"]), False), cost, 100.0, 2048)
    assert list(grpo) == ["rollout", "update"]
    assert len(paper) == 5  # rollout, three no-grad passes, update
    assert list(read) == [k for k in paper if "delta" not in k]  # delta read from the update's forward
    # 8 prompts of 300 tokens, each computed once for its 64 / 8 outputs of 100 tokens (train.share_prompts), or
    # once per output; update = (3 + 1) per token (checkpointing replays the forward)
    assert grpo["update"] == (8 * 300 + 64 * 100) * 4.0
    assert paper["pi_ref on q"] == (8 * 300 + 64 * 100) * 1.0
    plan = StepPlan.from_config(compose_cfg(["bicc=off", "rcc=off"]), False)
    assert step_phases(plan, cost, 100.0, 2048, share_prompts=False)["update"] == 64 * 400 * 4.0
