"""Schemas of the run's other groups: model, rollout, optimizer, RL and SFT stages, distribution, each with the
range checks of its own fields (the data group's: ``bicc.config.data``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import MISSING

from bicc.config.correction import CorrectionConfig
from bicc.config.fields import Dtype, at_least, choice, need


@dataclass
class TinyArchConfig:
    """Architecture of a model built from a config (random init), used by ``model=tiny``."""

    hidden_size: int = 128
    num_hidden_layers: int = 3
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    attention_dropout: float = 0.0

    # a model built from a config is for tests and the embedded task on a CPU; a real one is model.path
    MAX_PARAMETERS = 10**9

    @staticmethod
    def check(t) -> None:
        sizes = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings")
        at_least(t, "model.tiny", sizes, 1)
        need(t.num_attention_heads % t.num_key_value_heads == 0, "model.tiny.num_key_value_heads",
             f"must divide model.tiny.num_attention_heads={t.num_attention_heads}, got {t.num_key_value_heads}")
        need(0 <= t.attention_dropout < 1, "model.tiny.attention_dropout", f"must be in [0, 1), got {t.attention_dropout}")
        attention = t.hidden_size * t.head_dim * 2 * (t.num_attention_heads + t.num_key_value_heads)
        per_layer = attention + 3 * t.hidden_size * t.intermediate_size
        n = t.num_hidden_layers * per_layer
        need(n <= TinyArchConfig.MAX_PARAMETERS, "model.tiny",
             f"builds {n:.3g} parameters in its layers, over {TinyArchConfig.MAX_PARAMETERS:.0e} (a model built from a "
             f"config is for a CPU; a real one is model.path): " + ", ".join(f"model.tiny.{k}={t[k]}" for k in sizes[:-1]))


@dataclass
class ModelConfig:
    """Policy model (conf/model). ``path`` is an HF id or a local dir; ``tiny`` builds one instead."""

    name: str = MISSING
    path: Optional[str] = None
    tiny: Optional[TinyArchConfig] = None
    attn_implementation: str = "sdpa"
    padding_free: bool = True
    dtype: str = choice(Dtype, "float32")
    master_dtype: str = choice(Dtype, "float32")
    gradient_checkpointing: bool = False
    checkpoint_policy: str = choice(Literal["full", "save_attention", "recompute_mlp"], "full")
    compile: str = choice(Literal["off", "on", "auto"], "off")
    checkpoint_in_graph: bool = True
    checkpoint_layers: str = "all"  # all | auto | N: the first N decoder layers checkpointed (bicc.model.load, bicc.trainer.fit)

    @staticmethod
    def check(m) -> None:
        need((m.path is None) != (m.tiny is None), "model.path",
             "set exactly one of model.path (HF id or local dir) and model.tiny (build from a config)")
        need(m.checkpoint_layers in ("all", "auto") or str(m.checkpoint_layers).isdigit(), "model.checkpoint_layers",
             f"must be all, auto or a number of layers (0 or more), got {m.checkpoint_layers!r}")


@dataclass
class VllmConfig:
    """vLLM's own settings (``rollout.vllm``; read by ``rollout=vllm`` alone)."""

    gpu_memory_utilization: float = 0.5
    sleep: bool = False
    enforce_eager: bool = False
    max_model_len: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    worker_gpu_memory_utilization: float = 0.9

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

    static_cache: bool = False


@dataclass
class RolloutConfig:
    """Rollout engine and sampling at training time (conf/rollout)."""

    engine: str = MISSING
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 320
    batch_size: int = 256
    shards: Optional[int] = None
    vllm: VllmConfig = field(default_factory=VllmConfig)
    hf: HfConfig = field(default_factory=HfConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    old_from_sampler: bool = False
    async_steps: int = 0
    devices: Optional[list[int]] = None
    cpu_workers: int = 1
    remote_workers: int = 0
    worker_port: Optional[int] = None
    share_gpus: bool = False
    push_bucket_mib: float = 32.0
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


@dataclass
class OptimConfig:
    lr: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0

    @staticmethod
    def check(o) -> None:
        need(o.lr >= 0, "optim.lr", f"must be >= 0 (0: the weights stay where they are), got {o.lr}")
        at_least(o, "optim", ("weight_decay", "warmup_steps"), 0)
        need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
             f"must be two values in [0, 1), got {list(o.betas)}")
        need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
        need(o.clip_grad > 0, "optim.clip_grad", f"must be > 0, got {o.clip_grad}")


@dataclass
class TrainConfig:
    """The RL stage."""

    steps: int = 250
    time_budget_s: float = 0.0
    epochs_per_rollout: int = 1
    minibatches_per_rollout: int = 1
    micro_batch_size: int = 128
    micro_batch_tokens: int = 0
    share_prompts: bool = True
    logprob_chunk_tokens: int = 1024
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 100
    keep_last: int = 2
    max_nonfinite_steps: int = 5
    max_sampler_mismatch: Optional[float] = None
    sampler_mismatch_steps: int = 3
    sampler_check_every: Optional[int] = None
    preemption_lead_s: Optional[float] = None
    checkpoint_write_gib_s: float = 1.0
    memory_check: bool = True
    memory_gib: Optional[float] = None
    context_packing: bool = True
    context_packing_impl: str = choice(Literal["kv", "mask"], "kv")
    max_packed_len: int = 4096

    @staticmethod
    def check(t) -> None:
        for name in ("epochs_per_rollout", "minibatches_per_rollout", "micro_batch_size", "logprob_chunk_tokens",
                     "max_nonfinite_steps", "sampler_mismatch_steps"):
            need(t[name] >= 1, f"train.{name}", f"must be >= 1, got {t[name]}")
        need(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
        at_least(t, "train", ("time_budget_s", "save_every", "keep_last"), 0, " (0 = none)")
        need(t.log_every >= 1, "train.log_every", f"must be >= 1, got {t.log_every}")
        need(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 = before and after RL only), got {t.eval_every}")
        need(t.micro_batch_tokens >= 0, "train.micro_batch_tokens",
             f"must be >= 0 (0 = fixed micro-batches), got {t.micro_batch_tokens}")
        need(t.memory_gib is None or t.memory_gib > 0, "train.memory_gib", f"must be > 0 or null, got {t.memory_gib}")
        need(t.max_sampler_mismatch in (None, 0) or t.max_sampler_mismatch > 1, "train.max_sampler_mismatch",
             f"must be > 1 (the ratio is 1 at agreement), 0 (off) or null (by model.dtype), got {t.max_sampler_mismatch}")
        need(t.sampler_check_every is None or t.sampler_check_every >= 0, "train.sampler_check_every",
             f"must be >= 0 (0 = never) or null (1; under rollout workers rollout.async_steps + 1), "
             f"got {t.sampler_check_every}")
        need(t.max_packed_len >= 1, "train.max_packed_len", f"must be >= 1, got {t.max_packed_len}")
        need(t.preemption_lead_s is None or t.preemption_lead_s > 0, "train.preemption_lead_s",
             f"must be > 0 or null (not known), got {t.preemption_lead_s}")
        need(t.checkpoint_write_gib_s > 0, "train.checkpoint_write_gib_s", f"must be > 0, got {t.checkpoint_write_gib_s}")


@dataclass
class DiagConfig:
    """The paper's diagnostics (delta by reward, Cov(R, delta), gradient variance); they never change the update."""

    every: Optional[int] = None
    splits: int = 4
    stage_steps: int = 100

    @staticmethod
    def check(d) -> None:
        need(d.every is None or d.every >= 0, "diag.every", f"must be >= 0 (0 = off) or null (auto), got {d.every}")
        need(d.splits >= 2, "diag.splits", f"must be >= 2 (a variance needs 2+ estimates), got {d.splits}")
        need(d.stage_steps >= 1, "diag.stage_steps", f"must be >= 1, got {d.stage_steps}")


# diag.every=null: the diagnostics run this often while RCC is on, never while it is off.
DIAG_EVERY_UNDER_RCC = 10


def diag_every(diag, rcc) -> int:
    """Steps between the diagnostics' runs, 0 = never: ``diag.every``, or when it is null, every
    ``DIAG_EVERY_UNDER_RCC`` steps under RCC (``rcc.enabled``) and never without it."""
    if diag.every is not None:
        return int(diag.every)
    return DIAG_EVERY_UNDER_RCC if rcc.enabled else 0


@dataclass
class DistConfig:
    """Multi-process training under torchrun (bicc/machine/distributed.py); one process ignores it."""

    strategy: str = choice(Literal["fsdp2", "ddp"], "fsdp2")
    backend: str = choice(Literal["auto", "nccl", "gloo"], "auto")
    param_dtype: Optional[str] = choice(Optional[Dtype], None)
    reduce_dtype: str = choice(Dtype, "float32")
    reshard_after_forward: bool = True
    reshard_after_backward: bool = True
    reduce_grads: str = choice(Literal["micro_batch", "step"], "micro_batch")
    timeout_minutes: float = 60.0

    @staticmethod
    def check(d) -> None:
        need(d.timeout_minutes > 0, "dist.timeout_minutes", f"must be > 0, got {d.timeout_minutes}")


@dataclass
class SFTConfig:
    """Supervised warm start on demonstrations (some with deliberate slips); it runs whenever the model is a
    tiny one built from ``model.tiny`` (a pretrained model needs none)."""

    steps: int = 1500
    time_budget_s: float = 0.0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    context_share: float = 0.0
    context_attempts: str = choice(Literal["independent", "informative"], "independent")
    seed: Optional[int] = None
    cache_dir: str = MISSING

    @staticmethod
    def check(s) -> None:
        need(0 <= s.context_share <= 1, "sft.context_share", f"must be in [0, 1], got {s.context_share}")
        need(s.steps >= 0, "sft.steps", f"must be >= 0 (0: the tiny model as built), got {s.steps}")
        at_least(s, "sft", ("time_budget_s", "lr", "warmup_steps", "weight_decay", "seed"), 0)
        need(1 <= s.batch_size <= 10**5, "sft.batch_size", f"must be in [1, 10^5], got {s.batch_size}")
        need(0 <= s.min_lr_ratio <= 1, "sft.min_lr_ratio", f"must be in [0, 1], got {s.min_lr_ratio}")
