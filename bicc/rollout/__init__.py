"""Rollout engines: generate G samples per prompt and accept new weights. Nothing else.

An engine is built by name (``ENGINES.get(cfg.rollout.engine)(model, tokenizer, cfg)``) and offers

- ``generate(prompts, sampling) -> RolloutOutput``: ``prompts`` are token-id lists; each is sampled
  ``sampling.n`` times; output rows are grouped by prompt (rows ``i*n .. i*n+n-1`` belong to prompt ``i``).
- ``update_weights(model)``: make the engine sample from ``model``'s current parameters;
- optionally ``sleep()``: free what it holds on the GPU while the trainer updates (vLLM), and ``close()``: shut
  it down while the process group still exists (vLLM);
- ``model`` (HF engine): its sampling model, which the evaluation's HF engine reuses.

The trainer never reaches into an engine beyond these five, so HF ``generate`` (``hf.py``) and vLLM
(``vllm.py``) are interchangeable. ``EngineOptions`` carries what an engine needs beyond its config: the
tokens that end an output, the process layout, the longest sequence it must hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bicc.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy decoding."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


@dataclass
class RolloutOutput:
    """Sampled completions, ``N = num_prompts * n`` rows grouped by prompt.

    prompt_ids:      N lists of prompt token ids (repeated for each sample of a prompt)
    completion_ids:  N lists of sampled ids, cut after EOS (EOS included when it was sampled)
    texts:           N decoded completions without special tokens
    finished:        N flags, True when the completion ended with EOS (False = hit max_new_tokens)
    logprobs:        N lists of sampling log-probs, or None when the engine does not return them
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finished: list[bool]
    logprobs: Optional[list[list[float]]] = None


@dataclass(frozen=True)
class EngineOptions:
    """end_ids: every token id that ends an output (EOS and the generation config's end tokens); empty =
    the tokenizer's EOS. dist: this process's place under torchrun (``bicc.machine.distributed.Dist``), or None.
    max_model_len: the longest prompt + context + output the run needs (vLLM sizes its KV cache by it);
    None = the engine's default. dtype: the engine's compute dtype name, None = the model's. rows: the most output
    rows one generate call holds (vLLM on CPU sizes its KV space by it); None = as many as vLLM runs at once."""

    end_ids: tuple[int, ...] = ()
    dist: Optional[object] = None
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None
    rows: Optional[int] = None


def build_engine(name: str, model, tokenizer, rollout_cfg, options: EngineOptions = EngineOptions()):
    return ENGINES.get(name)(model, tokenizer, rollout_cfg, options)


def eval_engine_config(rollout_cfg, eval_cfg):
    """The engine settings evaluation runs with: the run's rollout engine settings (vLLM's memory share,
    longest sequence, eager mode), evaluation's batch size, and neither sleep mode nor sampling log-probs
    (``cfg.eval`` alone is not an engine config: a vLLM engine built from it had no ``sleep``)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(rollout_cfg, {"batch_size": eval_cfg.batch_size, "sleep": False, "old_from_sampler": False})


def engine_rows(rollout_cfg, eval_cfg, shards: int = 1) -> int:
    """The most output rows one generate call of a run holds: a prompt shard's G samples each
    (``rollout.prompts_per_step / shards x rollout.group_size``), or an evaluation call (``eval.batch_size``)."""
    return max(rollout_cfg.prompts_per_step // shards * rollout_cfg.group_size, eval_cfg.batch_size)


def end_ids_of(tokenizer, options: EngineOptions) -> list[int]:
    return list(options.end_ids) or [tokenizer.eos_token_id]


from bicc.rollout import hf, vllm  # noqa: E402,F401  (registers "hf", "vllm"; vllm imports lazily)
