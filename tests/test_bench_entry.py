"""The step benches start as their docstrings say (``python -m bench.X --help``): a broken import or
argument parser shows here, not at the first timing run."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["bench.step_profile", "bench.peer_trl"])
def test_bench_help(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_step_model_phases_follow_the_plan():
    from bench.step_model import step_phases
    from bench.step_profile import compose_cfg
    from bicc.plan import StepPlan

    cost = {"forward": 1.0, "forward_backward": 3.0, "decode": 10.0}
    grpo = step_phases(StepPlan.from_config(compose_cfg(["bicc=off", "rcc=off"]), False), cost, 100.0, 2048)
    paper = step_phases(StepPlan.from_config(compose_cfg(["bicc=on", "rcc=on"]), False), cost, 100.0, 2048)
    assert list(grpo) == ["rollout", "update"]
    assert len(paper) == 5  # rollout, three no-grad passes, update
    # 64 rows of 300 + 100 tokens on q; update = (3 + 1) per token (checkpointing replays the forward)
    assert grpo["update"] == 64 * 400 * 4.0
    assert paper["pi_ref on q"] == 64 * 400 * 1.0
