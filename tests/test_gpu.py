"""CUDA-only checks (``-m gpu``); skipped without a GPU. They cover what the CPU suite cannot: a
training run on CUDA in bf16, and flash-attn 2 giving the same log-probs as SDPA."""

import os
import subprocess
import sys

import pytest
import torch

from bicc.config import ModelConfig, TinyArchConfig
from bicc.model.load import build_tiny, load_pretrained, resolve_attn_implementation
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.trainer.checkpoint import save_hf
from tests.helpers import ROOT, SMALL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_two_step_run_on_cuda_in_bf16(tmp_path):
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "train.py", *SMALL, "device=cuda", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "results.json").exists()


def test_flash_attention_matches_sdpa(tmp_path):
    pytest.importorskip("flash_attn")
    from omegaconf import OmegaConf

    assert resolve_attn_implementation("flash_attention_2") == "flash_attention_2"
    model, tokenizer = build_tiny(TinyArchConfig(), seed=0)
    save_hf(model, tokenizer, tmp_path)
    prompts = [[5, 6, 7, 8, 9][: 3 + i % 3] for i in range(6)]
    completions = [[10 + j for j in range(4 + i)] for i in range(6)]
    batch = make_token_batch(prompts, completions, tokenizer.pad_token_id).to("cuda")
    out = {}
    for impl in ("sdpa", "flash_attention_2"):
        cfg = OmegaConf.structured(ModelConfig(name="t", path=str(tmp_path), dtype="bfloat16", attn_implementation=impl))
        m, _ = load_pretrained(str(tmp_path), cfg, torch.device("cuda"))
        with torch.no_grad():
            out[impl] = batch_logprobs(m.eval(), batch)[0].float()
    mask = batch.completion_mask.bool()
    assert torch.allclose(out["sdpa"][mask], out["flash_attention_2"][mask], atol=5e-2)



@pytest.mark.parametrize("padding_free", [True, False])
def test_flash_attention_prefix_cache_packing_matches_sdpa_rows(padding_free):
    """BiCC's packing under the real flash-attn kernel, padded and padding-free (``tests/test_flash_path.py``
    checks the same with a reference kernel on CPU)."""
    pytest.importorskip("flash_attn")
    from tests.helpers import prefix_cache_case, prefix_cache_logprobs

    model, tokenizer = build_tiny(TinyArchConfig(), seed=0)
    model = model.to("cuda", torch.bfloat16).eval()
    model.bicc_padding_free = padding_free
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    batch = make_token_batch(prefixes, completions, tokenizer.pad_token_id).to("cuda")
    with torch.no_grad():
        model.config._attn_implementation = "flash_attention_2"
        packed, _ = prefix_cache_logprobs(model, distinct, prefix_of, completions, batch.completion_len,
                                          tokenizer.pad_token_id)
        model.config._attn_implementation = "sdpa"
        rows, _ = batch_logprobs(model, batch)
    mask = batch.completion_mask.bool()
    assert torch.allclose(packed[mask].float(), rows[mask].float(), atol=5e-2)
