"""Where an RL step's time goes, on the embedded default.

Run: ``.venv/bin/python -m bench.step_profile [hydra overrides...]`` (``make bench``).

The tiny model, its cached warm start, real rollouts: times ``--steps`` calls of ``bicc.trainer.step.rl_step``
after ``--warmup`` and splits them with the step's own timers (``perf/``): generate, the plan's no-grad passes,
the update's forward, backward and optimizer step, the diagnostics (``diag.every``: their own forwards and
backwards); the rest is loop overhead (tokenising, rewards, batching, contexts, advantages, metrics). Ends with
``RESULT loop_overhead_share=<share> target<=0.05`` and ``RESULT passes_per_step=<no-grad passes + 1 update>``.
Timings are only meaningful on a quiet machine (nothing else running on its cores). The realistic-lengths study
(``--lengths realistic``, docs/history/performance-2026-11.md) is ``git show 33c7de3:bench/step_profile.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import compose_cfg
from bicc.config import StepConfig
from bicc.data import build_task
from bicc.machine.host import torch_threads
from bicc.trainer.sft import warm_start
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step


def phase_split(records: list[dict]) -> dict[str, float]:
    """Seconds per phase summed over steps, from the step's ``perf/`` metrics."""
    keys = {"generate": "perf/generate_s", "no-grad passes": "perf/logprob_s", "update forward": "perf/update_forward_s",
            "update backward": "perf/update_backward_s", "optimizer": "perf/update_optimizer_s",
            "diagnostics": "perf/diagnostics_s"}
    out = {name: sum(r.get(key, 0.0) for r in records) for name, key in keys.items()}
    out["step"] = sum(r["perf/step_s"] for r in records)
    out["overhead"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def report(split: dict[str, float], steps: int) -> None:
    total = split["step"]
    print(f"{steps} steps, {total:.1f}s (median-free sum); " + ", ".join(
        f"{name} {value:.2f}s ({value / total:.0%})" for name, value in split.items() if name != "step"))


def task_profile(overrides: list[str], warmup: int, steps: int) -> None:
    cfg = compose_cfg(overrides)
    torch.set_num_threads(torch_threads(cfg.threads))
    device = torch.device("cpu")
    init_path = str(warm_start(cfg, build_task(cfg.data), device, progress=False))
    state = build_rl_state(cfg, init_path, init_path, device)
    print(f"passes per step: {' -> '.join(state.plan.describe())}")
    for _ in range(warmup):
        rl_step(state, StepConfig.of(cfg))
    records = [rl_step(state, StepConfig.of(cfg))[0] for _ in range(steps)]
    split = phase_split(records)
    report(split, steps)
    print(f"median step {statistics.median(r['perf/step_s'] for r in records):.3f}s")
    print(f"RESULT loop_overhead_share={split['overhead'] / split['step']:.3f} target<=0.05")
    print(f"RESULT passes_per_step={len(state.plan.describe())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    task_profile(args.overrides, args.warmup, args.steps)


if __name__ == "__main__":
    main()
