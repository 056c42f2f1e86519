"""Score a checkpoint: ``python eval.py ckpt=PATH`` (an HF-format model dir, or a run dir: its latest
checkpoint). Reports sampled pass@1 with a 95% CI and greedy accuracy on the ``eval`` group's split.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from transformers.utils import logging as hf_logging

from bicc.checkpoint import list_checkpoints
from bicc.config import register_configs, validate
from bicc.data import build_task
from bicc.evaluation import evaluate, format_eval
from bicc.models import load_pretrained
from bicc.rollout import build_engine

register_configs()
hf_logging.disable_progress_bar()


def resolve_checkpoint(ckpt: str) -> Path:
    path = Path(ckpt)
    found = list_checkpoints(path / "checkpoints")
    if found:
        return found[-1]
    if (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"ckpt={ckpt}: not an HF model dir (no config.json) nor a run dir with checkpoints/")


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> dict:
    if cfg.ckpt is None:
        raise ValueError("config field 'ckpt': set ckpt=PATH (an HF model dir or a run dir)")
    validate(cfg)
    torch.set_num_threads(cfg.threads or os.cpu_count())
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    path = resolve_checkpoint(cfg.ckpt)
    model, tokenizer = load_pretrained(str(path), cfg.model, device)
    metrics = evaluate(build_engine(cfg.rollout.engine, model, tokenizer, cfg.eval), tokenizer, build_task(cfg.data),
                       cfg.eval, cfg.seed)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    (out_dir / "eval.json").write_text(json.dumps({"ckpt": str(path), **metrics}, indent=1))
    print(f"[eval] {path}: {format_eval(metrics)}")
    print(f"[done] outputs in {out_dir}")
    return metrics


if __name__ == "__main__":
    main()
