"""CPU reproduction of the paper's main comparison on the embedded task (``make results``).

From one SFT warm start (``sft.seed=0``) and several RL seeds, trains GRPO, BiCC-GRPO, BiCC-GRPO+RCC,
DAPO and BiCC-DAPO with the default settings of each, evaluates every run (pass@1 with its 95% CI) and
writes:

- ``outputs/results/steps<N>/<config>/s<seed>/``: the run dirs (metrics, diagnostics, results.json);
- ``docs/results/results.md``: the table in the paper's format (mean over seeds, spread, delta against
  the matching baseline) and the gradient-variance ratio measured during training;
- ``docs/results/*.png``: ``bicc.plots`` figures of all runs;
- README's results section, between ``<!-- results:start -->`` and ``<!-- results:end -->``.

Runs whose ``results.json`` exists are reused, so an interrupted ``make results`` continues where it
stopped. Jobs run two at a time with one CPU thread each (faster than one at a time with two threads
for this model size). ``--steps`` shrinks every run if the time limit requires it; the table says how
many steps were used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {  # name -> (overrides, baseline name or None)
    "GRPO": (["algo=grpo", "bicc=off", "rcc=off"], None),
    "BiCC-GRPO": (["algo=grpo", "bicc=stable", "rcc=off"], "GRPO"),
    "BiCC-GRPO+RCC": (["algo=grpo", "bicc=stable", "rcc=mean"], "GRPO"),
    "DAPO": (["algo=dapo", "bicc=off", "rcc=off"], None),
    "BiCC-DAPO": (["algo=dapo", "bicc=stable", "rcc=off"], "DAPO"),
}


def run_one(name: str, seed: int, steps: int, threads: int, out_root: Path, extra: list[str]) -> Path:
    run_dir = out_root / name / f"s{seed}"
    if (run_dir / "results.json").exists():
        return run_dir
    cmd = [sys.executable, str(ROOT / "train.py"), *CONFIGS[name][0], f"seed={seed}", "sft.seed=0",
           f"train.steps={steps}", f"threads={threads}", "logger.wandb_mode=disabled", "logger.progress=false",
           f"hydra.run.dir={run_dir}", *extra]
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}); see {run_dir / 'stdout.log'}")
    print(f"[results] {name} s{seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    return run_dir


def mean_metric(run_dir: Path, name: str) -> float | None:
    values = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if name in row:
            values.append(row[name])
    return statistics.fmean(values) if values else None


def summarize(runs: dict[str, list[Path]], steps: int, seeds: int, wall: str) -> str:
    res = {}
    for name, dirs in runs.items():
        finals = [json.loads((d / "results.json").read_text()) for d in dirs]
        p1 = [100 * f["final"]["eval/pass@1"] for f in finals]
        ci = [100 * f["final"]["eval/pass@1_ci95"] for f in finals]
        greedy = [100 * f["final"]["eval/greedy_acc"] for f in finals]
        gv = [v for v in (mean_metric(d, "rcc/grad_var") for d in dirs) if v is not None]
        res[name] = dict(p1=p1, ci=ci, greedy=greedy, gv=statistics.fmean(gv) if gv else None,
                         init=100 * finals[0]["initial"]["eval/pass@1"])
    init = next(iter(res.values()))["init"]
    lines = [f"Embedded task, one SFT warm start (pass@1 {init:.1f}%), {seeds} RL seeds per row, {steps} RL steps "
             f"each; pass@1 on 200 held-out problems x 4 samples (T = 1). Mean over seeds ± their standard "
             f"deviation; CI = mean of the per-run 95% CIs over problems. Δ against the matching baseline. "
             f"BiCC rows use the embedded task's named forms, not the paper's: bicc=stable (pi_old on x^c, lr / 3) and "
             f"rcc=mean (delta averaged per token).",
             "", "| Method | pass@1 | seeds | CI95 | Δ | greedy | grad. variance |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        base = CONFIGS[name][1]
        m = statistics.fmean(r["p1"])
        sd = statistics.stdev(r["p1"]) if len(r["p1"]) > 1 else 0.0
        if base and base in res:
            d = m - statistics.fmean(res[base]["p1"])
            delta = f"{'↑' if d >= 0 else '↓'}{abs(d):.1f}"
        else:
            delta = "—"
        gv = f"{r['gv']:.2f}" if r["gv"] is not None else "—"
        lines.append(f"| {name} | {m:.1f} ± {sd:.1f} | {', '.join(f'{x:.1f}' for x in r['p1'])} | "
                     f"±{statistics.fmean(r['ci']):.1f} | {delta} | {statistics.fmean(r['greedy']):.1f} | {gv} |")
    if res.get("BiCC-GRPO+RCC", {}).get("gv") and res.get("BiCC-GRPO", {}).get("gv"):
        ratio = res["BiCC-GRPO+RCC"]["gv"] / res["BiCC-GRPO"]["gv"]
        lines += ["", f"Gradient variance (relative, measured every `rcc.diag_every` steps during training, mean over "
                      f"steps and seeds): BiCC-GRPO+RCC / BiCC-GRPO = **{ratio:.2f}**. Runs follow different "
                      f"trajectories; `bench/rcc_variance.py` compares the two advantages on identical batches."]
    lines += ["", f"Wall time of this table: {wall}"]
    return "\n".join(lines)


def update_readme(table: str) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    if start not in text or end not in text:
        raise ValueError(f"{readme}: markers {start} / {end} not found")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/results/steps<steps>")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("extra", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args()
    names = args.configs.split(",")
    args.out = args.out or ROOT / "outputs" / "results" / f"steps{args.steps}"
    start = time.perf_counter()
    # the shared warm start first, so parallel jobs do not race to build it
    subprocess.run([sys.executable, str(ROOT / "train.py"), "stage=sft", "sft.seed=0", "logger.progress=false",
                    f"hydra.run.dir={args.out / '_sft'}", *args.extra], cwd=ROOT, check=True)
    jobs = [(n, s) for s in range(args.seeds) for n in names]
    reused = sum((args.out / n / f"s{s}" / "results.json").exists() for n, s in jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run_one(job[0], job[1], args.steps, args.threads, args.out, args.extra), jobs))
    runs: dict[str, list[Path]] = {n: [] for n in names}
    for (n, _), d in zip(jobs, dirs):
        runs[n].append(d)
    # the wall time of a call that made every run; a call that reuses runs quotes the one that made them
    wall_file = args.out / "wall_min.txt"
    minutes = (time.perf_counter() - start) / 60
    if reused == 0:
        wall_file.write_text(f"{minutes:.1f}\n")
        wall = f"{minutes:.0f} min on this machine (`make results`)."
    elif reused == len(jobs) and wall_file.exists():
        wall = f"{float(wall_file.read_text()):.0f} min on this machine (`make results`, when its runs were made)."
    else:
        wall = f"{minutes:.0f} min for this call, which reused {reused} of {len(jobs)} runs made earlier."
    table = summarize(runs, args.steps, args.seeds, wall)
    out_docs = ROOT / "docs" / "results"
    out_docs.mkdir(parents=True, exist_ok=True)
    (out_docs / "results.md").write_text(table + "\n")
    from bicc.plots import make_plots

    for path in make_plots([d for ds in runs.values() for d in ds], out_docs):
        print(path)
    if not args.no_readme:
        update_readme(table)
    print(table)


if __name__ == "__main__":
    main()
