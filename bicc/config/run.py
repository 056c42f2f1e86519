"""Schemas of the run's other groups: model, optimizer, RL and SFT stages, diagnostics, distribution, each with the
range checks of its own fields (the data group's: ``bicc.config.data``; the rollout's: ``bicc.config.rollout``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from omegaconf import MISSING

from bicc.config.fields import Dtype, at_least, choice, need


@dataclass
class TinyArchConfig:
    """Architecture of a model built from a config (random init), used by ``model=tiny``."""

    # Width of the residual stream.
    hidden_size: int = 128
    # Decoder layers.
    num_hidden_layers: int = 3
    # MLP width.
    intermediate_size: int = 256
    # Query heads.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention).
    num_key_value_heads: int = 2
    # Per-head width.
    head_dim: int = 32
    # Longest sequence the rotary embedding is configured for.
    max_position_embeddings: int = 1024
    # Share the input embedding and the output projection.
    tie_word_embeddings: bool = True
    # Dropout on attention weights in train mode (0 = none; > 0 makes training consume the global RNG).
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
class LoraConfig:
    """LoRA adapters (``model.lora``; peft, through transformers' ``add_adapter``): what trains is the adapters, and
    pi_ref is the same module with them off."""

    # Adapter rank r (peft's and TRL's r, verl's lora_rank); 0 = no adapters (full fine-tuning).
    r: int = 0
    # Scale alpha: an adapter adds (alpha / r) B A x to its layer's output.
    alpha: float = 16.0
    # Dropout on an adapter's input in train mode.
    dropout: float = 0.0
    # The linear layers that get adapters, by module name ("all-linear": every linear layer but the output head).
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])

    @staticmethod
    def check(lo) -> None:
        at_least(lo, "model.lora", ("r",), 0)
        need(lo.alpha > 0, "model.lora.alpha", f"must be > 0, got {lo.alpha}")
        need(0 <= lo.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lo.dropout}")
        need(len(lo.target_modules) > 0, "model.lora.target_modules", "names no layer")


@dataclass
class ModelConfig:
    """Policy model (conf/model). ``path`` is an HF id or a local dir; ``tiny`` builds one instead."""

    name: str = MISSING
    # HF id or local dir to load; null = build from `tiny` below (then warm-started by SFT).
    path: Optional[str] = None
    tiny: Optional[TinyArchConfig] = None
    # Attention kernel (SDPA on CPU).
    attn_implementation: str = "sdpa"
    # Under a kernel that takes ragged sequences (flash_attention_2), the prefix-cache forwards (shared prompts, BiCC's
    # contexts) compute no padding: each micro-batch's rows laid end to end. false: padded rows.
    padding_free: bool = True
    # Compute dtype: fp32 on CPU.
    dtype: str = choice(Dtype, "float32")
    # Dtype of the trainable policy's master weights, gradients and optimizer state (fp32: at lr 1e-6 bf16 weights round
    # most updates away).
    master_dtype: str = choice(Dtype, "float32")
    # Recompute activations in backward.
    gradient_checkpointing: bool = False
    # Under gradient_checkpointing, what a layer's backward recomputes: full (its whole forward) | save_attention (every
    # op but attention: the attention kernel's output and log-sum-exp kept from the forward, about 8 KiB per token and
    # layer at Qwen3-4B's width in bf16) | recompute_mlp (the MLP only: the q/k/v and output projections' outputs kept
    # too, about 25 KiB per token and layer there; bicc.model.load.checkpoint_kwargs).
    checkpoint_policy: str = choice(Literal["full", "save_attention", "recompute_mlp"], "full")
    # torch.compile each decoder layer's forward for the log-prob forwards and the update, the log-prob head and the
    # loss (bicc/kernels/compile.py): on | off | auto (CUDA only). Off by default: on a GPU the compiled update ran
    # 1.3-1.6x the eager one, for about two minutes of compiling per process (docs/performance.md). On an H100 the
    # compiled run trained, saved and evaluated; its resume from a checkpoint has yet to run on a GPU.
    compile: str = choice(Literal["off", "on", "auto"], "off")
    # Under compile and gradient_checkpointing: a layer's recompute traced into its compiled backward (true: the
    # partitioner recomputes only what the backward reads, without the MLP's down projection) or the eager checkpoint
    # replaying the compiled forward (false). The same update either way (bicc.kernels.compile._recomputed).
    checkpoint_in_graph: bool = True
    checkpoint_layers: str = "all"  # all | auto | N: the first N decoder layers checkpointed (bicc.model.load, bicc.trainer.fit)
    # LoRA adapters on the policy (bicc/model/lora.py): r 0 = none, the whole model trains.
    lora: LoraConfig = field(default_factory=LoraConfig)

    @staticmethod
    def check(m) -> None:
        need((m.path is None) != (m.tiny is None), "model.path",
             "set exactly one of model.path (HF id or local dir) and model.tiny (build from a config)")
        need(m.checkpoint_layers in ("all", "auto") or str(m.checkpoint_layers).isdigit(), "model.checkpoint_layers",
             f"must be all, auto or a number of layers (0 or more), got {m.checkpoint_layers!r}")
        LoraConfig.check(m.lora)


@dataclass
class OptimConfig:
    # Peak learning rate (the paper uses 1e-6 for 4B models; the tiny model needs a larger one). On the embedded task
    # higher rates sharpen sampling faster but cost more greedy accuracy (docs/history/results-2026-11.md: "Why RL costs
    # greedy accuracy here"); bicc=stable runs at a third of it.
    lr: float = 5e-5
    # AdamW betas.
    betas: tuple[float, float] = (0.9, 0.999)
    # AdamW weight decay.
    weight_decay: float = 0.01
    # Linear warmup steps before the cosine decay.
    warmup_steps: int = 10
    # Final LR as a fraction of the peak.
    min_lr_ratio: float = 0.1
    # Max global gradient norm.
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

    # Optimizer steps of RL (each consumes one rollout batch per epoch/minibatch split).
    steps: int = 250
    # Stop RL early after this many seconds; 0 = no limit (steps decide).
    time_budget_s: float = 0.0
    # Passes over each rollout batch (PPO epochs).
    epochs_per_rollout: int = 1
    # Optimizer steps per epoch over a rollout batch.
    minibatches_per_rollout: int = 1
    # Sequences per forward/backward; gradients accumulate up to a minibatch.
    micro_batch_size: int = 128
    # Length-aware micro-batches: rows sorted by length and cut so that rows x longest row <= this many tokens (and at
    # most micro_batch_size rows); each micro-batch is padded to its own longest row only. 0 = fixed slices of
    # micro_batch_size rows. The gradient is the same either way (step-wide normalisers).
    micro_batch_tokens: int = 0
    # Compute each prompt q once per step for all of its G outputs, whose tokens attend to its cached keys/values (the
    # KV reuse BiCC's contexts use), in the update and the passes on q; false = one padded row per output. Same
    # log-probs and gradient either way (to float rounding).
    share_prompts: bool = True
    # Tokens per chunk of the output projection when computing log-probs (peak memory ~ chunk x vocab x 4 bytes). A
    # forward of several chunks recomputes each in its backward; one of a single chunk keeps its logits.
    logprob_chunk_tokens: int = 1024
    # Log every N steps.
    log_every: int = 1
    # Evaluate (the eval group's set, sharded over the processes as the final evaluation is) every N steps, logged under
    # eval/ at that step; 0 = only before and after RL.
    eval_every: int = 0
    # Checkpoint every N steps (0 = only at the end).
    save_every: int = 100
    # Keep the newest K checkpoints (0 = keep all).
    keep_last: int = 2
    # Stop (with a checkpoint) after this many optimizer steps in a row skipped for a non-finite loss/grad.
    max_nonfinite_steps: int = 5
    # The sampler against the trainer at the weights that sampled (bicc/rollout/agreement.py): rollout/token_prob_ratio,
    # the mean over sampled tokens of exp|log pi_sampler - log pi_trainer|, 1 at agreement. Above max_sampler_mismatch a
    # step warns once; sampler_mismatch_steps such steps in a row stop the run with a checkpoint, naming the likely
    # causes (0 = off). null = by model.dtype: 1.01 in float32 (healthy runs measure 1.0000001 on CPU, HF workers and
    # vLLM alike), 1.1 in 16-bit (1.001 measured on CPU in bfloat16; NeMo-RL gates its GPU runs at 1.1).
    # docs/reliability.md has the measurements.
    max_sampler_mismatch: Optional[float] = None
    # Measured steps in a row above it that stop the run.
    sampler_mismatch_steps: int = 3
    # Measure every N steps (0 = never). Under rollout workers each costs one no-grad pass on q at the batch's weight
    # version and, on each rank, a host copy of its shard of the parameters of each version such a step reads, held from
    # the push until that step (ceil((async_steps + 1) / N) copies at once). null = 1 without workers (free), and
    # async_steps + 1 under workers: one host copy at most.
    sampler_check_every: Optional[int] = None
    # Seconds between the scheduler's first signal and its kill (Slurm's --signal=B:USR1@600: 600), checked at launch
    # with torchrun's --shutdown-timeout against the predicted save of a preempted step (docs/reliability.md); null =
    # not known, not checked.
    preemption_lead_s: Optional[float] = None
    # The rate a node writes a checkpoint at, in GiB/s, for that prediction (a parallel file system's share per node;
    # local NVMe writes several times faster).
    checkpoint_write_gib_s: float = 1.0
    # Before the first step, bicc.machine.memory predicts the run's peak per GPU (every output at
    # rollout.max_new_tokens) and refuses a run that would not fit train.memory_gib, naming the setting to lower; false
    # = start anyway.
    memory_check: bool = True
    # The memory one GPU may use, in GiB; null = the CUDA device's total (on CPU: no check).
    memory_gib: Optional[float] = None
    # BiCC: compute each shared context once for all the outputs behind it (context_packing_impl); false = one row per
    # output. The same log-probs and gradient either way (to float rounding).
    context_packing: bool = True
    # kv: the contexts computed once per step and their keys/values reused by every output behind them (cost linear in
    # outputs) | mask: one packed row [prefix; o_1; ...; o_k] with a 4-D mask (outputs share attention cost).
    context_packing_impl: str = choice(Literal["kv", "mask"], "kv")
    # Longest packed row in tokens (context_packing_impl=mask); longer packs are split.
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

    # Run them every N steps; 0 = never; null = every 10 steps while RCC is on, never while it is off (they need the
    # frozen reference model for delta and passes of their own).
    every: Optional[int] = None
    # Disjoint sets of groups whose gradients are compared for the gradient-variance diagnostic.
    splits: int = 4
    # Steps per training stage when diagnostics are averaged and plotted by stage (the paper uses 500).
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

    # Under torchrun with more than one process: fsdp2 (fully_shard per decoder layer and at the root) | ddp. One
    # process ignores this section.
    strategy: str = choice(Literal["fsdp2", "ddp"], "fsdp2")
    # Process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo.
    backend: str = choice(Literal["auto", "nccl", "gloo"], "auto")
    # FSDP2 parameter dtype for compute; null = model.dtype.
    param_dtype: Optional[str] = choice(Optional[Dtype], None)
    # FSDP2 gradient reduce-scatter dtype.
    reduce_dtype: str = choice(Dtype, "float32")
    # FSDP2: free the gathered parameters after each layer's forward (less memory, one more all-gather).
    reshard_after_forward: bool = True
    # FSDP2: free the gathered parameters after every micro-batch's backward (true) or keep them through a minibatch's
    # micro-batches, freed after its last backward (false: with reshard_after_forward false, each layer is gathered once
    # per optimizer step instead of twice per micro-batch; one copy of the model per GPU).
    reshard_after_backward: bool = True
    # FSDP2: reduce-scatter the gradients after every micro-batch's backward (micro_batch: the least memory) or once per
    # optimizer step (step: the backwards before the last accumulate unreduced fp32 gradients, the whole model's per
    # GPU; far fewer ops per step, see docs/performance.md).
    reduce_grads: str = choice(Literal["micro_batch", "step"], "micro_batch")
    # How long a collective may wait for the other ranks (torch's default is 10 minutes; one evaluation call of
    # 4,096-token outputs, or a checkpoint written to a slow file system, can take longer).
    timeout_minutes: float = 60.0

    @staticmethod
    def check(d) -> None:
        need(d.timeout_minutes > 0, "dist.timeout_minutes", f"must be > 0, got {d.timeout_minutes}")


@dataclass
class SFTConfig:
    """Supervised warm start on demonstrations (some with deliberate slips); it runs whenever the model is a
    tiny one built from ``model.tiny`` (a pretrained model needs none)."""

    # SFT optimizer steps (1,500 x 64 narrows the spread over seeds of 900 x 64: docs/history/log.md, 2026-11-24).
    steps: int = 1500
    # Stop SFT early after this many seconds; 0 = no limit.
    time_budget_s: float = 0.0
    # Demonstrations per SFT step.
    batch_size: int = 64
    # SFT peak learning rate.
    lr: float = 3e-3
    # SFT warmup steps.
    warmup_steps: int = 50
    # SFT final LR as a fraction of the peak.
    min_lr_ratio: float = 0.05
    # SFT weight decay.
    weight_decay: float = 0.0
    # Share of SFT prompts that also show other attempts under the BiCC template (0 = plain prompts only).
    context_share: float = 0.0
    # What those attempts are: independent (further demonstrations, slips at the task's rate; the target as for a plain
    # prompt) | informative (each correct or slipped with probability 1/2, the target correct: reading the attempts
    # pays, as BiCC's contexts assume).
    context_attempts: str = choice(Literal["independent", "informative"], "independent")
    # Seed of the warm start (model init and demonstrations); null = the global seed. Fix it to compare RL seeds from
    # one SFT checkpoint.
    seed: Optional[int] = None
    cache_dir: str = MISSING

    @staticmethod
    def check(s) -> None:
        need(0 <= s.context_share <= 1, "sft.context_share", f"must be in [0, 1], got {s.context_share}")
        need(s.steps >= 0, "sft.steps", f"must be >= 0 (0: the tiny model as built), got {s.steps}")
        at_least(s, "sft", ("time_budget_s", "lr", "warmup_steps", "weight_decay", "seed"), 0)
        need(1 <= s.batch_size <= 10**5, "sft.batch_size", f"must be in [1, 10^5], got {s.batch_size}")
        need(0 <= s.min_lr_ratio <= 1, "sft.min_lr_ratio", f"must be in [0, 1], got {s.min_lr_ratio}")
