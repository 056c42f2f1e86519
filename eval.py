"""Score a checkpoint, or compare two scored runs.

    python eval.py ckpt=PATH [eval=arith|math500|amc23|aime24|aime25|gsm8k|paper] [eval.limit=20]
    python eval.py compare RESULT_DIR_A RESULT_DIR_B [--out DIR]

``ckpt`` is an HF-format model dir or a run dir (its latest complete checkpoint). Scoring writes, into
the Hydra output dir: ``<benchmark>/per_problem.jsonl``, ``summary.json`` and ``results.md``.
``compare`` reads two such dirs and reports, per benchmark, the paired Wilcoxon signed-rank test on
per-problem accuracy, the difference B - A with a paired bootstrap CI, a Markdown table with ↑/↓
deltas, and a pass@k plot with error bars (``passk.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

COMPARE = "compare"


def resolve_checkpoint(ckpt: str) -> Path:
    from bicc.checkpoint import list_checkpoints

    path = Path(ckpt)
    found = list_checkpoints(path / "checkpoints")
    if found:
        return found[-1]
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"ckpt={ckpt}: not an HF model dir (no config.json) nor a run dir with checkpoints/")


def score_main() -> None:
    import hydra
    import torch
    from hydra.core.hydra_config import HydraConfig
    from transformers.utils import logging as hf_logging

    from bicc.config import register_configs, validate
    from bicc.data import build_task
    from bicc.evaluation import evaluate, format_eval, markdown_table
    from bicc.models import end_token_ids, load_pretrained
    from bicc.rollout import EngineOptions, build_engine, eval_engine_config

    register_configs()
    hf_logging.disable_progress_bar()

    @hydra.main(config_path="conf", config_name="train", version_base=None)
    def main(cfg) -> dict:
        if cfg.ckpt is None:
            raise ValueError("config field 'ckpt': set ckpt=PATH (an HF model dir or a run dir)")
        validate(cfg)
        torch.set_num_threads(cfg.threads or os.cpu_count())
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
        path = resolve_checkpoint(cfg.ckpt)
        model, tokenizer = load_pretrained(str(path), cfg.model, device)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        options = EngineOptions(end_ids=tuple(end_token_ids(tokenizer, model)), dtype=cfg.model.dtype)
        engine = build_engine(cfg.rollout.engine, model, tokenizer, eval_engine_config(cfg.rollout, cfg.eval), options)
        metrics = evaluate(engine, tokenizer,
                           build_task(cfg.data),
                           cfg.eval, cfg.seed, out_dir=out_dir, progress=cfg.logger.progress)
        table = markdown_table(metrics, cfg.eval.ks)
        (out_dir / "summary.json").write_text(json.dumps({"ckpt": str(path), "eval": cfg.eval.name, **metrics}, indent=1))
        (out_dir / "eval.json").write_text(json.dumps({"ckpt": str(path), **metrics}, indent=1))  # older name
        (out_dir / "results.md").write_text(table + "\n")
        print(f"[eval] {path}: {format_eval(metrics)}")
        print(table)
        print(f"[done] outputs in {out_dir}")
        return metrics

    main()


def _load_result(path: Path) -> tuple[dict, dict[str, dict[str, dict]]]:
    summary_file = path / "summary.json"
    if not summary_file.exists():
        raise FileNotFoundError(f"{path}: no summary.json (run `python eval.py ckpt=...` first)")
    summary = json.loads(summary_file.read_text())
    per = {}
    for sub in sorted(p for p in path.iterdir() if (p / "per_problem.jsonl").exists()):
        rows = [json.loads(line) for line in (sub / "per_problem.jsonl").read_text().splitlines() if line.strip()]
        per[sub.name] = {r["id"]: r for r in rows}
    return summary, per


def compare_main(argv: list[str]) -> None:
    from bicc.plots import passk_plot
    from bicc.stats import paired_bootstrap_diff, wilcoxon_paired

    parser = argparse.ArgumentParser(prog="eval.py compare", description="paired comparison of two eval dirs")
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where compare.md / passk.png go (default: B)")
    args = parser.parse_args(argv)
    (sa, pa), (sb, pb) = _load_result(args.a), _load_result(args.b)
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
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    plot = passk_plot({str(args.a): sa, str(args.b): sb}, out / "passk.png")
    print(table)
    print(f"[compare] wrote {out / 'compare.md'}" + (f" and {plot}" if plot else ""))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == COMPARE:
        compare_main(sys.argv[2:])
    else:
        score_main()
