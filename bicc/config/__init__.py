"""Typed config schemas (Hydra ConfigStore).

Every YAML file under ``conf/`` is checked against these dataclasses when Hydra composes it, so a
misspelt key fails at start-up. Fields without a sensible default are ``MISSING``: a config group
must set them. Each schema default is the one the YAML composes (tests/test_config.py holds them
together). ``bicc.validation.validate`` then checks names against the registries and values against
their ranges before any model is loaded, naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class AlgoConfig:
    """Policy loss and advantage estimator (conf/algo)."""

    name: str = MISSING
    loss: str = MISSING
    advantage: str = MISSING
    loss_agg: str = MISSING
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 0.0
    ratio_denominator: str = "old"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    adv_eps: float = 1e-6
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    overlong_buffer_share: float = 0.0
    overlong_penalty: float = 1.0


def overlong_buffer_tokens(algo_cfg, max_new_tokens: int) -> int:
    """DAPO's L_cache in tokens: ``algo.overlong_buffer_share`` of the response length limit."""
    return round(algo_cfg.overlong_buffer_share * max_new_tokens)


@dataclass
class BiccConfig:
    """Bilateral Context Conditioning (conf/bicc): what the trainable numerator is conditioned on."""

    enabled: bool = MISSING
    mode: str = "partition"
    paired_k: int = 1
    context_ratio: float = 0.4
    max_tokens: int = MISSING
    truncate: str = "middle"
    min_attempt_tokens: int = 12
    reward_threshold: Optional[float] = None
    preamble: str = "\n\nOther attempts at this problem:"
    attempt_header: str = "\nAttempt {i}:\n"
    elision: str = " ... "
    packing: bool = True
    packing_impl: str = "kv"
    max_packed_len: int = 4096
    old_on_context: bool = False
    log_ratio_clip: float = 0.0
    warmup_steps: int = 0
    lr_scale: float = 1.0


@dataclass
class RccConfig:
    """Reward-confidence correction (conf/rcc) and the paper's diagnostics (conf/rcc: diag_*)."""

    enabled: bool = MISSING
    delta: str = "mean"
    delta_context: str = "xc"
    diag_every: int = 0
    diag_splits: int = 4
    stage_steps: int = 100


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


@dataclass
class ModelConfig:
    """Policy model (conf/model). ``path`` is an HF id or a local dir; ``tiny`` builds one instead."""

    name: str = MISSING
    path: Optional[str] = None
    tiny: Optional[TinyArchConfig] = None
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    master_dtype: str = "float32"
    gradient_checkpointing: bool = False


@dataclass
class ArithConfig:
    """The embedded arithmetic task: integer expressions with worked steps."""

    min_operands: int = 2
    max_operands: int = 3
    max_operand: int = 49
    ops: str = "+-"
    slip_rate: float = 0.3
    slip_max: int = 2
    slip_step: str = "any"
    test_size: int = 500
    test_share: float = 0.1


@dataclass
class MathDataConfig:
    """Math problems from files or HF datasets (``data.task=math``)."""

    train_source: str = ""
    test_source: str = ""
    dedupe: bool = False
    shuffle: bool = False
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str = "id"
    extractors: List[str] = field(default_factory=lambda: ["boxed", "answer_is"])
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    on_bad_row: str = "error"
    test_problem_field: Optional[str] = None
    test_answer_field: Optional[str] = None
    test_id_field: Optional[str] = None


@dataclass
class DataConfig:
    """Training/eval task (conf/data)."""

    task: str = MISSING
    seed: int = 0
    arith: ArithConfig = field(default_factory=ArithConfig)
    math: MathDataConfig = field(default_factory=MathDataConfig)


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
    gpu_memory_utilization: float = 0.5
    sleep: bool = False
    enforce_eager: bool = False
    max_model_len: Optional[int] = None
    tis_cap: float = 0.0
    old_from_sampler: bool = False


@dataclass
class OptimConfig:
    lr: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    """The RL stage."""

    steps: int = 250
    time_budget_s: float = 0.0
    epochs_per_rollout: int = 1
    minibatches_per_rollout: int = 1
    micro_batch_size: int = 128
    micro_batch_tokens: int = 0
    logprob_chunk_tokens: int = 1024
    log_every: int = 1
    save_every: int = 100
    keep_last: int = 2
    max_nonfinite_steps: int = 5


@dataclass
class DistConfig:
    """Multi-process training under torchrun (bicc/distributed.py); one process ignores it."""

    strategy: str = "fsdp2"
    backend: str = "auto"
    param_dtype: Optional[str] = None
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True


@dataclass
class SFTConfig:
    """Supervised warm start on demonstrations (some with deliberate slips); it runs whenever the model is a
    tiny one built from ``model.tiny`` (a pretrained model needs none)."""

    steps: int = 900
    time_budget_s: float = 0.0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    context_share: float = 0.0
    context_attempts: str = "independent"
    seed: Optional[int] = None
    cache_dir: str = MISSING


@dataclass
class BenchmarkConfig:
    """One evaluation set: the training task's test split, or a file / HF dataset of math problems."""

    name: str = MISSING
    source: str = "task"
    split: str = "test"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str = "id"
    extractors: List[str] = field(default_factory=lambda: ["boxed", "answer_is"])


@dataclass
class EvalConfig:
    """Held-out evaluation (conf/eval)."""

    name: str = MISSING
    benchmarks: List[BenchmarkConfig] = field(default_factory=list)
    num_problems: int = 200
    limit: Optional[int] = None
    samples_per_problem: int = 4
    temperature: float = 0.6
    top_p: float = 0.95
    also_temperatures: List[float] = field(default_factory=list)
    max_new_tokens: int = 64
    greedy: bool = True
    batch_size: int = 512
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    ks: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    bootstrap_samples: int = 2000
    on_bad_row: str = "error"
    data_dir: str = MISSING
    checker_workers: int = 2
    checker_deadline_s: float = 1.5


@dataclass
class LoggerConfig:
    """Where metrics go (conf/logger)."""

    wandb_mode: str = "offline"
    wandb_project: str = "bicc"
    progress: bool = True


@dataclass
class RunConfig:
    """Top-level config composed by train.py and eval.py."""

    algo: AlgoConfig = MISSING
    bicc: BiccConfig = MISSING
    rcc: RccConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    rollout: RolloutConfig = MISSING
    eval: EvalConfig = MISSING
    logger: LoggerConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = 0
    stage: str = "all"
    device: str = "auto"
    threads: int = 0
    run_name: str = MISSING
    resume: Optional[str] = None
    ckpt: Optional[str] = None


def register_configs() -> None:
    """Register the schemas with Hydra; YAML files pick them up through their defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="algo", name="algo_schema", node=AlgoConfig)
    cs.store(group="bicc", name="bicc_schema", node=BiccConfig)
    cs.store(group="rcc", name="rcc_schema", node=RccConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="rollout", name="rollout_schema", node=RolloutConfig)
    cs.store(group="eval", name="eval_schema", node=EvalConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
