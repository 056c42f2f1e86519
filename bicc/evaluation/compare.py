"""Compare two scored runs: ``python -m bicc.evaluation.compare RESULT_DIR_A RESULT_DIR_B [--out DIR]`` (also
``python eval.py compare ...``).

Reads two ``eval.py`` output dirs (``summary.json`` and ``<benchmark>/per_problem.jsonl``) and reports, per
benchmark present in both, on the problems present in both: the paired Wilcoxon signed-rank test on
per-problem accuracy, the difference B - A with a paired bootstrap CI, a Markdown table with ↑/↓ deltas
(``compare.md``, ``compare.json``) and a pass@k plot with error bars (``passk.png``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bicc.evaluation.plots import passk_plot
from bicc.evaluation.stats import paired_bootstrap_diff, wilcoxon_paired


def load_result(path: Path) -> tuple[dict, dict[str, dict[str, dict]]]:
    summary_file = path / "summary.json"
    if not summary_file.exists():
        raise FileNotFoundError(f"{path}: no summary.json (run `python eval.py ckpt=...` first)")
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    per = {}
    for sub in sorted(p for p in path.iterdir() if (p / "per_problem.jsonl").exists()):
        rows = [json.loads(line) for line in (sub / "per_problem.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
        per[sub.name] = {r["id"]: r for r in rows}
    return summary, per


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bicc.evaluation.compare", description="paired comparison of two eval dirs")
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where compare.md / passk.png go (default: B)")
    args = parser.parse_args(argv)
    (sa, pa), (sb, pb) = load_result(args.a), load_result(args.b)
    out = args.out or args.b
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"A = {args.a}", f"B = {args.b}", "",
             "| benchmark | problems | A pass@1 | B pass@1 | Δ (B − A) [95% CI] | Wilcoxon W | p |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    report = {}
    for bench in [b for b in pa if b in pb]:
        ids = [i for i in pa[bench] if i in pb[bench]]
        if len(ids) != len(pa[bench]) or len(ids) != len(pb[bench]):
            print(f"[compare] {bench}: only {len(ids)} problems are in both runs; comparing those")
        a = np.array([pa[bench][i]["accuracy"] for i in ids])
        b = np.array([pb[bench][i]["accuracy"] for i in ids])
        diff, lo, hi = paired_bootstrap_diff(a, b)
        stat, p = wilcoxon_paired(a, b)
        arrow = "↑" if diff > 0 else ("↓" if diff < 0 else "=")
        lines.append(f"| {bench} | {len(ids)} | {100 * a.mean():.1f} | {100 * b.mean():.1f} | "
                     f"{arrow}{100 * abs(diff):.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {stat:.1f} | {p:.3g} |")
        report[bench] = {"problems": len(ids), "a": a.mean(), "b": b.mean(), "diff": diff, "ci": [lo, hi],
                         "wilcoxon_w": stat, "p": p}
    table = "\n".join(lines)
    (out / "compare.md").write_text(table + "\n", encoding="utf-8")
    (out / "compare.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    plot = passk_plot({str(args.a): sa, str(args.b): sb}, out / "passk.png")
    print(table)
    print(f"[compare] wrote {out / 'compare.md'}" + (f" and {plot}" if plot else ""))


if __name__ == "__main__":
    main()
