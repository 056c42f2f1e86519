"""Rollout: engines that generate G samples per prompt and accept new weights (this module, and ``engines/``: ``hf``
and ``vllm``, each found on disk), the step's collection of a rollout (``collect``: prompts, dynamic sampling's
refill, rewards), and rollout workers (``workers``: the trainer's side; ``worker``: a worker process; ``line`` and
``channel``: their messages over a TCPStore; ``weight_sync``: weights over a process group; ``vllm_transfer``: vLLM's
own NCCL weight transfer), and whether a sampler draws from the weights it was given (``agreement``:
``rollout/token_prob_ratio`` and its gate).

An engine is built by name (``build_engine(cfg.rollout.engine, model, tokenizer, cfg.rollout, options)``) and
implements the whole of ``Engine`` below: generating, taking new weights, freeing its memory while the trainer
updates, shutting down, and saying whether it returns sampling log-probs, which HF module it samples with and how
much KV space it holds. A member that means nothing for an engine is a no-op (the defaults ``Engine`` gives its
subclasses), so the trainer never asks an engine what it has, and HF ``generate`` (``engines/hf.py``) and vLLM
(``engines/vllm.py``) are interchangeable. ``EngineOptions`` carries what an engine needs beyond its config: the
tokens that end an output, the process layout, the longest sequence it must hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from bicc.registry import ENGINES


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
    rows one generate call holds (vLLM on CPU sizes its KV space by it); None = as many as vLLM runs at once.
    logprobs: return the sampling log-probs whatever the config says (a rollout worker's are the behaviour policy).
    weight_transfer: the vLLM weight-transfer backend the engine is built with (a rollout worker on CUDA: "nccl"),
    None = none."""

    end_ids: tuple[int, ...] = ()
    dist: Optional[object] = None
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None
    rows: Optional[int] = None
    logprobs: bool = False
    weight_transfer: Optional[str] = None


@runtime_checkable
class Engine(Protocol):
    """What the trainer and evaluation use of a rollout engine. Engines subclass it and so inherit the no-op
    members below where those mean nothing for them."""

    # What the trainer reads of an engine by its class, before one is built (``ENGINES.get(name).<ability>``), so no
    # engine's name is tested outside its own module:
    # - it samples from an HF module it is handed: a full copy beside a sharded policy, and in a rollout worker a
    #   loaded module that pushes land in (else it holds weights of its own, loaded from the model's files);
    samples_from_module: bool = True
    # - it holds a share of its GPU's memory for its weights and KV cache (``rollout.vllm.gpu_memory_utilization``, a
    #   worker's ``rollout.vllm.worker_gpu_memory_utilization``) rather than growing with ``rollout.batch_size``;
    reserves_memory_share: bool = False
    # - how a rollout worker's push reaches it between GPUs: "nccl" (a broadcast into its module's tensors) or
    #   "vllm" (vLLM's own weight transfer, ``vllm_transfer``);
    weight_route: str = "nccl"
    # - it returns its sampling log-probs with every rollout, whatever the config asks;
    always_returns_logprobs: bool = False
    # - past a LongRoPE model's original range it rotates every position with the long factors (transformers: only
    #   the positions past it), so its runs must stay within that range.
    longrope_long_everywhere: bool = False

    # Its HF sampling module, which the evaluation's HF engine reuses; None: it samples without one (vLLM).
    model: Optional[object] = None
    # Whether ``generate`` fills ``RolloutOutput.logprobs`` (the sampler's own log-probs of its tokens).
    returns_logprobs: bool = False
    # The KV space it reserved, in bytes; None: no fixed pool.
    kv_bytes: Optional[int] = None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        """Sample ``sampling.n`` outputs for each token-id prompt; rows ``i*n .. i*n+n-1`` belong to prompt ``i``."""
        ...

    # The weight version it samples with: the number of optimizer steps behind the weights it was last given
    # (``update_weights``). Every rollout carries it, so a weight push that did not happen is seen.
    version: int = 0

    def update_weights(self, model, version: int) -> None:
        """Sample from ``model``'s current parameters, weight version ``version``, from now on; nothing cached
        under older ones serves again."""
        ...

    def load_weights(self, weights, version: int) -> None:
        """The same from a stream of (HF name, tensor) pairs in the engine's dtype, each parameter once (a rollout
        worker's push, ``bicc.rollout.weight_sync``): consumed whole before it returns. An engine without it cannot
        serve a rollout worker."""
        raise NotImplementedError(f"rollout engine {type(self).__name__} takes no pushed weights (load_weights): it "
                                  "cannot run in a rollout worker (rollout.async_steps)")

    def sleep(self) -> None:
        """Free what it holds on the GPU until the next ``update_weights`` (vLLM's sleep mode); else nothing."""

    def close(self) -> None:
        """Shut down while the process group still exists; else nothing."""


def build_engine(name: str, model, tokenizer, rollout_cfg, options: EngineOptions = EngineOptions()) -> Engine:
    engine = ENGINES.get(name)(model, tokenizer, rollout_cfg, options)
    if not isinstance(engine, Engine):
        raise TypeError(f"rollout engine '{name}' ({type(engine).__name__}) does not implement bicc.rollout.Engine")
    return engine


def eval_engine_config(rollout_cfg, eval_cfg):
    """The engine settings evaluation runs with: the run's rollout engine settings (vLLM's memory share,
    longest sequence, eager mode), evaluation's batch size, and neither sleep mode nor sampling log-probs
    (``cfg.eval`` alone is not an engine config: a vLLM engine built from it had no ``sleep`` setting)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(rollout_cfg, {"batch_size": eval_cfg.batch_size, "vllm": {"sleep": False}, "old_from_sampler": False})


def engine_rows(rollout_cfg, eval_cfg, shards: int = 1) -> int:
    """The most output rows one generate call of a run holds: a prompt shard's G samples each
    (``rollout.prompts_per_step / shards x rollout.group_size``), or an evaluation call (``eval.batch_size``)."""
    return max(rollout_cfg.prompts_per_step // shards * rollout_cfg.group_size, eval_cfg.batch_size)


def end_ids_of(tokenizer, options: EngineOptions) -> list[int]:
    return list(options.end_ids) or [tokenizer.eos_token_id]


import bicc.rollout.engines  # noqa: E402,F401  (each module of engines/ registers its engine)
