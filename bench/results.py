"""CPU reproduction of the paper's main comparison on the embedded task (``make results``).

From one SFT warm start (``sft.seed=0``) and several RL seeds, trains the paper's forms (``bicc=on``, ``rcc=on``):
GRPO, BiCC-GRPO, BiCC-GRPO+RCC, DAPO, BiCC-DAPO and BiCC-DAPO+RCC (the headline command's form) with the default
settings of each; GRPO and BiCC-GRPO again from the warm start that has learnt to read attempts (``READING``);
the named stabilised form (``bicc=stable``, not the paper's) beside them; and BiCC-GRPO at several context ratios
(one seed each, with what the contexts held). It evaluates every run (pass@1 at T 0.6 / top-p 0.95 with its 95% CI, pass@1 at
T 1, greedy accuracy) and writes:

- ``outputs/results/steps<N>/<config>/s<seed>/``: the run dirs (metrics, diagnostics, results.json);
- ``docs/results/results.md``: the table in the paper's format (mean over seeds, spread, delta against
  the matching baseline) and the gradient-variance ratio measured during training;
- ``docs/results/*.png``: ``bicc.evaluation.plots`` figures of all runs;
- ``docs/results.md``'s table, between ``<!-- results:start -->`` and ``<!-- results:end -->``.

With ``--no-readme`` docs/ is left alone: the table and figures go under ``--out``.

Runs whose ``results.json`` exists are reused, so an interrupted ``make results`` continues where it
stopped. Jobs run two at a time with one CPU thread each (faster than one at a time with two threads
for this model size). ``--steps`` shrinks every run if the time limit requires it; the table says how
many steps were used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from bench.common import ROOT, run_dir_of, run_one

# The warm start that has learnt to read attempts: a quarter of its SFT prompts show informative attempts (right
# or slipped, under a correct target) in the BiCC template, with 1,200 SFT steps instead of 900 so that its plain
# accuracy matches the plain warm start's (docs/method.md: the gradient-alignment probe).
# Both warm starts pinned to the SFT settings these results were measured with, whatever the defaults become.
PLAIN = ["sft.steps=900", "sft.batch_size=64", "sft.warmup_steps=50"]
READING = ["sft.context_share=0.25", "sft.context_attempts=informative", "sft.steps=1800", "sft.batch_size=64",
           "sft.warmup_steps=50"]
CONFIGS = {  # name -> (overrides, baseline name or None): the paper's forms, and one named form beside them
    "GRPO": (["algo=grpo", "bicc=off", "rcc=off"], None),
    "BiCC-GRPO": (["algo=grpo", "bicc=on", "rcc=off"], "GRPO"),
    "BiCC-GRPO+RCC": (["algo=grpo", "bicc=on", "rcc=on"], "GRPO"),
    "DAPO": (["algo=dapo", "bicc=off", "rcc=off"], None),
    "BiCC-DAPO": (["algo=dapo", "bicc=on", "rcc=off"], "DAPO"),
    "BiCC-DAPO+RCC": (["algo=dapo", "bicc=on", "rcc=on"], "DAPO"),
    "GRPO (reading warm start)": (["algo=grpo", "bicc=off", "rcc=off", *READING], None),
    "BiCC-GRPO (reading warm start)": (["algo=grpo", "bicc=on", "rcc=off", *READING], "GRPO (reading warm start)"),
    "BiCC-GRPO stable (named form)": (["algo=grpo", "bicc=stable", "rcc=off"], "GRPO"),
}
for _overrides, _ in CONFIGS.values():
    if not any(o.startswith("sft.") for o in _overrides):
        _overrides += PLAIN
# The context-ratio ablation (one seed each): BiCC-GRPO with the share of max tokens the attempts may fill.
RATIOS = (0.2, 0.4, 0.6)


DEFAULT_RATIO = 0.4  # the BiCC-GRPO row's own ratio: its seed-0 run is that ablation row


def ablation_configs(ratios) -> dict:
    return {f"BiCC-GRPO ratio={r}": (["algo=grpo", "bicc=on", "rcc=off", f"bicc.context_ratio={r}", *PLAIN], None)
            for r in ratios if r != DEFAULT_RATIO}


def mean_metric(run_dir: Path, name: str) -> float | None:
    values = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if name in row:
            values.append(row[name])
    return statistics.fmean(values) if values else None


def final_metrics(dirs: list[Path]) -> dict:
    finals = [json.loads((d / "results.json").read_text(encoding="utf-8")) for d in dirs]
    pct = lambda key: [100 * f["final"].get(key, float("nan")) for f in finals]  # noqa: E731 (T=1 absent: nan)
    return dict(p1=pct("eval/pass@1"), ci=pct("eval/pass@1_ci95"), t1=pct("eval/pass@1_T1"), greedy=pct("eval/greedy_acc"),
                init=finals[0]["initial"])


def spread(values: list[float]) -> str:
    """Mean ± standard deviation over seeds; the value alone for one seed."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def summarize(runs: dict[str, list[Path]], ablation: dict[str, list[Path]], steps: int, seeds: int, wall: str) -> str:
    res = {}
    for name, dirs in runs.items():
        res[name] = final_metrics(dirs)
        gv = [v for v in (mean_metric(d, "rcc/grad_var") for d in dirs) if v is not None]
        res[name]["gv"] = statistics.fmean(gv) if gv else None
    starts = {}  # warm start -> its initial metrics (runs sharing sft overrides share it)
    for name, r in res.items():
        starts.setdefault("reading" if "reading" in name else "plain", r["init"])
    lines = [f"Embedded task, {seeds} RL seed(s) per row, {steps} RL steps each, one SFT warm start per kind (sft.seed=0). "
             f"pass@1 on 200 held-out problems x 4 samples at the paper's evaluation sampling (T = 0.6, top-p 0.95), "
             f"T = 1 (the training temperature) and greedy beside it. Mean over seeds ± their standard deviation (with "
             f"several seeds); "
             f"CI = mean of the per-run 95% CIs over problems. Δ against the matching baseline. BiCC and RCC rows are "
             f"the paper's forms (bicc=on, rcc=on: delta summed, on q); the row marked named form is bicc=stable "
             f"(pi_old on x^c, lr / 3), not the paper's (docs/method.md).", ""]
    for kind, init in starts.items():
        lines.append(f"- {kind} warm start: pass@1 {100 * init['eval/pass@1']:.1f}, T = 1 "
                     f"{100 * init.get('eval/pass@1_T1', float('nan')):.1f}, greedy {100 * init['eval/greedy_acc']:.1f}")
    lines += ["", "| Method | pass@1 | seeds | CI95 | Δ | pass@1 T=1 | greedy | grad. variance |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        base = CONFIGS[name][1]
        if base and base in res:
            d = statistics.fmean(r["p1"]) - statistics.fmean(res[base]["p1"])
            delta = f"{'↑' if d >= 0 else '↓'}{abs(d):.1f}"
        else:
            delta = "—"
        gv = f"{r['gv']:.2f}" if r["gv"] is not None else "—"
        lines.append(f"| {name} | {spread(r['p1'])} | {', '.join(f'{x:.1f}' for x in r['p1'])} | "
                     f"±{statistics.fmean(r['ci']):.1f} | {delta} | {spread(r['t1'])} | {spread(r['greedy'])} | {gv} |")
    if res.get("BiCC-GRPO+RCC", {}).get("gv") and res.get("BiCC-GRPO", {}).get("gv"):
        ratio = res["BiCC-GRPO+RCC"]["gv"] / res["BiCC-GRPO"]["gv"]
        lines += ["", f"Gradient variance (relative, measured every `diag.every` steps during training, mean over "
                      f"steps and seeds): BiCC-GRPO+RCC / BiCC-GRPO = **{ratio:.2f}**. Runs follow different "
                      f"trajectories (a comparison on identical batches: docs/history/pretrained-2026-11.md)."]
    if ablation:
        lines += ["", "Context-ratio ablation (BiCC-GRPO, plain warm start, seed 0, same steps), with what the contexts held "
                      "(training means): the share of samples conditioned, attempts shown per context, of them whole "
                      "(not cut), and attempts dropped.", "",
                  "| context ratio | budget (tokens) | pass@1 | pass@1 T=1 | greedy | conditioned | attempts shown | whole "
                  "| dropped |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, dirs in ablation.items():
            r, d = final_metrics(dirs), dirs[0]
            ratio = float(name.split("=")[1])
            budget = int(ratio * OmegaConf.load(d / ".hydra" / "config.yaml").rollout.max_new_tokens)
            cells = [f"{mean_metric(d, k):.2f}" for k in ("bicc/samples_conditioned_share", "bicc/attempts_shown",
                                                          "bicc/whole_attempts_shown", "bicc/dropped_share")]
            lines.append(f"| {ratio} | {budget} | {r['p1'][0]:.1f} | {r['t1'][0]:.1f} | {r['greedy'][0]:.1f} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Wall time of these tables: {wall}"]
    return "\n".join(lines)


def update_page(table: str) -> None:
    readme = ROOT / "docs" / "results.md"
    text = readme.read_text(encoding="utf-8")
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    if start not in text or end not in text:
        raise ValueError(f"{readme}: markers {start} / {end} not found")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/results/steps<steps>")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="context-ratio ablation rows ('' = none)")
    parser.add_argument("--no-readme", action="store_true",
                        help="leave docs/ alone: the table and figures go under --out")
    parser.add_argument("extra", nargs="*", help="Hydra overrides added to every run")
    args = parser.parse_args()
    names = args.configs.split(",")
    configs = {n: CONFIGS[n][0] for n in names}
    ratios = [float(r) for r in args.ratios.split(",") if r]
    configs.update({n: o for n, (o, _) in ablation_configs(ratios).items()})
    args.out = args.out or ROOT / "outputs" / "results" / f"steps{args.steps}"
    start = time.perf_counter()
    # each warm start first (one per set of sft overrides), so parallel jobs do not race to build it
    for sft in sorted({tuple(o for o in overrides if o.startswith("sft.")) for overrides in configs.values()}):
        subprocess.run([sys.executable, str(ROOT / "train.py"), "stage=sft", "sft.seed=0", "logger.progress=false",
                        f"hydra.run.dir={args.out / '_sft'}", *sft, *args.extra], cwd=ROOT, check=True)
    jobs = [(n, s) for s in range(args.seeds) for n in names] + [(n, 0) for n in configs if n not in names]
    reused = sum((run_dir_of(args.out, n, s) / "results.json").exists() for n, s in jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run_one(job[0], configs[job[0]], job[1], args.steps, args.threads, args.out,
                                                 args.extra), jobs))
    runs: dict[str, list[Path]] = {n: [] for n in configs}
    for (n, _), d in zip(jobs, dirs):
        runs[n].append(d)
    # the wall time of a call that made every run; a call that reuses runs quotes the one that made them
    wall_file = args.out / "wall_min.txt"
    minutes = (time.perf_counter() - start) / 60
    if reused == 0:
        wall_file.write_text(f"{minutes:.1f}\n", encoding="utf-8")
        wall = f"{minutes:.0f} min on this machine (`make results`)."
    elif reused == len(jobs) and wall_file.exists():
        minutes = float(wall_file.read_text(encoding="utf-8"))
        wall = f"{minutes:.0f} min on this machine (`make results`, when its runs were made)."
    else:
        wall = f"{minutes:.0f} min for this call, which reused {reused} of {len(jobs)} runs made earlier."
    ablation = {n: runs[n] for n in configs if n not in names}
    if DEFAULT_RATIO in ratios and "BiCC-GRPO" in runs:
        ablation[f"BiCC-GRPO ratio={DEFAULT_RATIO}"] = runs["BiCC-GRPO"][:1]
    ablation = dict(sorted(ablation.items(), key=lambda item: float(item[0].split("=")[1])))
    table = summarize({n: runs[n] for n in names}, ablation, args.steps, args.seeds, wall)
    out_docs = args.out if args.no_readme else ROOT / "docs" / "results"
    out_docs.mkdir(parents=True, exist_ok=True)
    (out_docs / "results.md").write_text(table + "\n", encoding="utf-8")
    from bicc.evaluation.plots import make_plots

    for path in make_plots([d for ds in runs.values() for d in ds], out_docs):
        print(path)
    if not args.no_readme:
        update_page(table)
    print(table)


if __name__ == "__main__":
    main()
