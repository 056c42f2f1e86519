"""Figures from run dirs: ``python -m bicc.evaluation.plots RUN_DIR [RUN_DIR ...] [--out DIR]``.

Writes PNGs (matplotlib, Agg backend) into ``--out`` (default: the first run dir):

- ``dynamics.png``: reward and loss per step, smoothed; solid for BiCC runs, dashed for their baselines.
- ``cov_by_stage.png``: Cov(R, delta) averaged per training stage (``diag.stage_steps``).
- ``delta_hist.png``: delta histograms split by reward, one panel per run label and stage.
- ``grad_var.png``: the relative gradient variance per stage (see ``bicc.method.diagnostics.gradient_variance``).

Runs with the same label (algorithm + BiCC + RCC) are seeds of one configuration: curves show their mean.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]


class Run:
    def __init__(self, path: Path):
        self.path = path
        cfg_file = path / ".hydra" / "config.yaml"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path}: not a run dir (no .hydra/config.yaml)")
        cfg = OmegaConf.load(cfg_file)
        for group in ("algo", "bicc", "rcc"):
            if group not in cfg:
                raise ValueError(f"{cfg_file}: no '{group}' config; the run predates BiCC/RCC and cannot be plotted")
        self.algo = str(cfg.algo.name)
        self.bicc = bool(cfg.bicc.enabled)
        self.rcc = bool(cfg.rcc.enabled)
        self.stage_steps = int(cfg.diag.stage_steps)
        self.metrics = _read_jsonl(path / "metrics.jsonl", key="step")
        self.diag = _read_jsonl(path / "diagnostics.jsonl", key="step")

    @property
    def base(self) -> str:
        """The baseline this run is compared with (same algorithm and RCC setting, no BiCC)."""
        return self.algo.upper().replace("_", ".") + ("+RCC" if self.rcc else "")

    @property
    def label(self) -> str:
        return ("BiCC-" if self.bicc else "") + self.base

    @property
    def last_step(self) -> int:
        return max((int(r["step"]) for r in self.metrics), default=0)

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        rows = [r for r in self.metrics if name in r]
        return np.array([r["step"] for r in rows]), np.array([r[name] for r in rows], dtype=float)


def _read_jsonl(path: Path, key: str) -> list[dict]:
    """Rows of a JSONL file; a step written twice (a run resumed after a kill) keeps its last row."""
    if not path.exists():
        return []
    rows = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err})") from None
        if key in row:
            rows[row[key]] = row
    return [rows[k] for k in sorted(rows)]


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    if len(y) == 0:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _mean_curve(runs: list[Run], name: str) -> tuple[np.ndarray, np.ndarray]:
    curves = [r.series(name) for r in runs]
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return np.array([]), np.array([])
    n = min(len(c[0]) for c in curves)
    return curves[0][0][:n], np.mean([c[1][:n] for c in curves], axis=0)


def _groups(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        out[r.label].append(r)
    return dict(sorted(out.items(), key=lambda kv: (kv[1][0].base, kv[1][0].bicc)))


def _colors(groups: dict[str, list[Run]]) -> dict[str, str]:
    bases = sorted({rs[0].base for rs in groups.values()})
    return {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(bases)}


def _stage_means(run: Run, name: str) -> dict[int, float]:
    steps, values = run.series(name)
    out: dict[int, list[float]] = defaultdict(list)
    for s, v in zip(steps, values):
        if np.isfinite(v):
            out[(int(s) - 1) // run.stage_steps].append(v)
    return {k: float(np.mean(v)) for k, v in sorted(out.items())}


def plot_dynamics(groups, colors, out: Path, window: int = 20) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, runs in groups.items():
        style = dict(color=colors[runs[0].base], linestyle="-" if runs[0].bicc else "--", linewidth=1.6,
                     label=f"{label} (n={len(runs)})")
        for ax, name in zip(axes, ("reward/accuracy", "train/loss")):
            x, y = _mean_curve(runs, name)
            if len(x):
                ax.plot(x, smooth(y, window), **style)
    axes[0].set(title=f"Training reward (accuracy, {window}-step mean)", xlabel="step", ylabel="reward")
    axes[1].set(title=f"Training loss ({window}-step mean)", xlabel="step", ylabel="loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle("Solid: BiCC; dashed: its baseline")
    return _save(fig, out / "dynamics.png")


def stage_label(k: int, stage_steps: int, last_step: int) -> str:
    """Steps of stage k as run: the last stage of a run that stops inside it ends at its last step."""
    end = (k + 1) * stage_steps
    return f"{k * stage_steps + 1}-{min(end, last_step) if last_step > k * stage_steps else end}"


def _stage_bars(groups, colors, name: str, title: str, ylabel: str, path: Path) -> Path | None:
    per_label = {}
    for label, runs in groups.items():
        stages: dict[int, list[float]] = defaultdict(list)
        for r in runs:
            for k, v in _stage_means(r, name).items():
                stages[k].append(v)
        if stages:
            per_label[label] = (runs, stages)
    if not per_label:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(per_label) + 4), 4))
    num_stages = max(max(st) for _, st in per_label.values()) + 1
    width = 0.8 / len(per_label)
    for i, (label, (runs, stages)) in enumerate(per_label.items()):
        xs = np.array(sorted(stages)) + (i - (len(per_label) - 1) / 2) * width
        means = [np.mean(stages[k]) for k in sorted(stages)]
        errs = [np.std(stages[k]) / np.sqrt(len(stages[k])) if len(stages[k]) > 1 else 0 for k in sorted(stages)]
        ax.bar(xs, means, width, yerr=errs, capsize=2, color=colors[runs[0].base],
               hatch=None if runs[0].bicc else "//", edgecolor="black", linewidth=0.5, label=label)
    runs = [r for rs, _ in per_label.values() for r in rs]
    steps, last = runs[0].stage_steps, max(r.last_step for r in runs)
    ax.set_xticks(range(num_stages), [stage_label(k, steps, last) for k in range(num_stages)])
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(title=title, xlabel="training stage (steps)", ylabel=ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_delta_hist(groups, out: Path) -> Path | None:
    labels = [lab for lab, runs in groups.items() if any(r.diag for r in runs)]
    if not labels:
        return None
    stages_of = {}
    for lab in labels:
        st: dict[int, dict[str, list[float]]] = defaultdict(lambda: {"pos": [], "neg": []})
        for r in groups[lab]:
            for row in r.diag:
                k = (int(row["step"]) - 1) // r.stage_steps
                for d, c in zip(row["delta"], row["correct"]):
                    st[k]["pos" if c == 1 else "neg"].append(d)
        stages_of[lab] = st
    num_stages = max(max(st) for st in stages_of.values()) + 1
    fig, axes = plt.subplots(len(labels), num_stages, figsize=(3.2 * num_stages, 2.6 * len(labels)), squeeze=False)
    for i, lab in enumerate(labels):
        for k in range(num_stages):
            ax = axes[i][k]
            data = stages_of[lab].get(k, {"pos": [], "neg": []})
            both = data["pos"] + data["neg"]
            if both:
                bins = np.linspace(min(both), max(both) + 1e-9, 30)
                for side, color, name in (("pos", "#2ca02c", "r=1"), ("neg", "#d62728", "r=0")):
                    if data[side]:
                        ax.hist(data[side], bins=bins, alpha=0.55, color=color, density=True, label=name)
                if data["pos"] and data["neg"]:
                    sep = np.mean(data["pos"]) - np.mean(data["neg"])
                    ax.text(0.02, 0.95, f"Δμ={sep:.2f}", transform=ax.transAxes, va="top", fontsize=8)
            steps, last = groups[lab][0].stage_steps, max(r.last_step for r in groups[lab])
            ax.set_title(f"{lab}\nsteps {stage_label(k, steps, last)}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(labels) - 1:
                ax.set_xlabel("δ = log π_θ(o|x^c) − log π_ref(o|q)", fontsize=7)
        axes[i][0].legend(fontsize=7)
    return _save(fig, out / "delta_hist.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def passk_plot(summaries: dict[str, dict], path: Path) -> Path | None:
    """pass@k against k (log2 axis), one panel per benchmark, one line per run, with the bootstrap 95%
    CI as error bars (the paper's Fig. 3b). ``summaries``: run label -> eval.py's summary.json."""
    benches = []
    for summary in summaries.values():
        for key in summary:
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "pass@1" and parts[1] not in benches:
                benches.append(parts[1])
    if not benches:
        return None
    fig, axes = plt.subplots(1, len(benches), figsize=(4.2 * len(benches), 3.6), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for i, (label, summary) in enumerate(summaries.items()):
            ks, ys, lo, hi = [], [], [], []
            for k in (1, 2, 4, 8, 16, 32, 64):
                key = f"eval/{bench}/pass@{k}"
                if key in summary:
                    ks.append(k)
                    ys.append(100 * summary[key])
                    lo.append(100 * (summary[key] - summary.get(key + "_ci_low", summary[key])))
                    hi.append(100 * (summary.get(key + "_ci_high", summary[key]) - summary[key]))
            if ks:
                ax.errorbar(ks, ys, yerr=[lo, hi], marker="o", capsize=3, color=PALETTE[i % len(PALETTE)],
                            label=Path(label).name or label)
        ax.set_xscale("log", base=2)
        ax.set(title=bench, xlabel="k", ylabel="pass@k (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def make_plots(run_dirs: list[Path], out: Path) -> list[Path]:
    runs = [Run(Path(d)) for d in run_dirs]
    groups = _groups(runs)
    colors = _colors(groups)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_dynamics(groups, colors, out),
               _stage_bars(groups, colors, "rcc/cov", "Cov(R, δ) per training stage (mean ± s.e. over seeds)",
                           "Cov(R, δ)", out / "cov_by_stage.png"),
               plot_delta_hist(groups, out),
               _stage_bars(groups, colors, "rcc/grad_var", "Relative gradient variance per stage (lower is better)",
                           "mean_k |g_k − ḡ|² / |ḡ|²", out / "grad_var.png")]
    return [p for p in written if p is not None]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where PNGs go (default: the first run dir)")
    args = parser.parse_args(argv)
    for path in make_plots(args.run_dirs, args.out or args.run_dirs[0]):
        print(path)


if __name__ == "__main__":
    main()
