"""Typed config schemas (Hydra ConfigStore) and validation that runs before any model is loaded.

Every YAML file under ``conf/`` is checked against these dataclasses when Hydra composes it, so a
misspelt key fails at start-up. Fields without a sensible default are ``MISSING``: a config group
must set them. ``validate`` then checks names against the registries and values against their
ranges, naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

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


STAGES = ("all", "sft")
WANDB_MODES = ("online", "offline", "disabled")
DTYPES = ("float32", "bfloat16", "float16")


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"config field '{field_name}': {message}")


def validate(cfg: Any) -> None:
    """Fail fast, before any model is loaded, with the field's name and what is allowed."""
    # Imported here so the registries are filled by their modules' decorators.
    from bicc.advantages import ADVANTAGES
    from bicc.data import TASKS
    from bicc.losses import AGGREGATIONS, KL_ESTIMATORS, LOSSES
    from bicc.rollout import ENGINES

    for field_name, registry, value in (
        ("algo.loss", LOSSES, cfg.algo.loss),
        ("algo.advantage", ADVANTAGES, cfg.algo.advantage),
        ("algo.loss_agg", AGGREGATIONS, cfg.algo.loss_agg),
        ("algo.kl_estimator", KL_ESTIMATORS, cfg.algo.kl_estimator),
        ("data.task", TASKS, cfg.data.task),
        ("rollout.engine", ENGINES, cfg.rollout.engine),
    ):
        _check(value in registry, field_name, f"'{value}' unknown; choose from: {', '.join(registry.names())}")

    a = cfg.algo
    _check(a.clip_eps_low > 0, "algo.clip_eps_low", f"must be > 0, got {a.clip_eps_low}")
    _check(a.clip_eps_high > 0, "algo.clip_eps_high", f"must be > 0, got {a.clip_eps_high}")
    _check(a.clip_eps_low < 1, "algo.clip_eps_low", f"must be < 1 (ratio floor 1-eps), got {a.clip_eps_low}")
    _check(a.dual_clip_c == 0 or a.dual_clip_c > 1, "algo.dual_clip_c", f"must be 0 (off) or > 1, got {a.dual_clip_c}")
    _check(a.ratio_denominator in ("old", "ref"), "algo.ratio_denominator",
           f"'{a.ratio_denominator}' unknown; choose from: old, ref")
    _check(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
    _check(a.max_sampling_rounds >= 1, "algo.max_sampling_rounds", f"must be >= 1, got {a.max_sampling_rounds}")
    _check(0 <= a.overlong_buffer_share < 1, "algo.overlong_buffer_share",
           f"must be in [0, 1) (a share of rollout.max_new_tokens), got {a.overlong_buffer_share}")
    _check(a.overlong_penalty >= 0, "algo.overlong_penalty", f"must be >= 0, got {a.overlong_penalty}")
    _check(a.adv_eps >= 0, "algo.adv_eps", f"must be >= 0, got {a.adv_eps}")

    r = cfg.rollout
    _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2 (a group-relative advantage needs 2+ samples), got {r.group_size}")
    _check(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
    _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _check(r.tis_cap >= 0, "rollout.tis_cap", f"must be >= 0 (0 = no correction), got {r.tis_cap}")
    _check(r.shards is None or (r.shards >= 1 and r.prompts_per_step % r.shards == 0), "rollout.shards",
           f"must be null (one per process) or a divisor of rollout.prompts_per_step={r.prompts_per_step}, got {r.shards}")

    t = cfg.train
    _check(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
    _check(t.epochs_per_rollout >= 1, "train.epochs_per_rollout", f"must be >= 1, got {t.epochs_per_rollout}")
    _check(t.minibatches_per_rollout >= 1, "train.minibatches_per_rollout", f"must be >= 1, got {t.minibatches_per_rollout}")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    _check(t.micro_batch_tokens >= 0, "train.micro_batch_tokens", f"must be >= 0 (0 = fixed micro-batches), got {t.micro_batch_tokens}")
    _check(t.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", f"must be >= 1, got {t.logprob_chunk_tokens}")
    _check(t.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", f"must be >= 1, got {t.max_nonfinite_steps}")
    rollout_size = r.prompts_per_step * r.group_size
    _check(rollout_size % t.minibatches_per_rollout == 0, "train.minibatches_per_rollout",
           f"must divide prompts_per_step * group_size = {rollout_size}, got {t.minibatches_per_rollout}")

    o = cfg.optim
    _check(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _check(o.clip_grad > 0, "optim.clip_grad", f"must be > 0, got {o.clip_grad}")

    _check(cfg.stage in STAGES, "stage", f"'{cfg.stage}' unknown; choose from: {', '.join(STAGES)}")
    _check(cfg.logger.wandb_mode in WANDB_MODES, "logger.wandb_mode",
           f"'{cfg.logger.wandb_mode}' unknown; choose from: {', '.join(WANDB_MODES)}")
    _check(cfg.model.dtype in DTYPES, "model.dtype", f"'{cfg.model.dtype}' unknown; choose from: {', '.join(DTYPES)}")
    _check(cfg.model.master_dtype in DTYPES, "model.master_dtype",
           f"'{cfg.model.master_dtype}' unknown; choose from: {', '.join(DTYPES)}")
    _check((cfg.model.path is None) != (cfg.model.tiny is None), "model.path",
           "set exactly one of model.path (HF id or local dir) and model.tiny (build from a config)")

    d = cfg.dist
    _check(d.strategy in ("fsdp2", "ddp"), "dist.strategy", f"'{d.strategy}' unknown; choose from: fsdp2, ddp")
    _check(d.backend in ("auto", "nccl", "gloo"), "dist.backend", f"'{d.backend}' unknown; choose from: auto, nccl, gloo")
    _check(d.param_dtype is None or d.param_dtype in DTYPES, "dist.param_dtype",
           f"'{d.param_dtype}' unknown; choose from: null, {', '.join(DTYPES)}")
    _check(d.reduce_dtype in DTYPES, "dist.reduce_dtype", f"'{d.reduce_dtype}' unknown; choose from: {', '.join(DTYPES)}")

    _check(0 <= cfg.sft.context_share <= 1, "sft.context_share", f"must be in [0, 1], got {cfg.sft.context_share}")
    _check(cfg.sft.context_attempts in ("independent", "informative"), "sft.context_attempts",
           f"must be independent | informative, got {cfg.sft.context_attempts!r}")
    b = cfg.bicc
    _check(b.mode in ("partition", "paired"), "bicc.mode", f"'{b.mode}' unknown; choose from: partition, paired")
    _check(b.packing_impl in ("kv", "mask"), "bicc.packing_impl", f"'{b.packing_impl}' unknown; choose from: kv, mask")
    if b.enabled and b.packing and b.packing_impl == "mask":
        from bicc.models import resolve_attn_implementation
        from bicc.packing import MASK_ATTENTION

        impl = resolve_attn_implementation(cfg.model.attn_implementation)
        _check(impl in MASK_ATTENTION, "bicc.packing_impl",
               f"'mask' needs a 4-D attention mask, which model.attn_implementation={impl} ignores; use kv")
    _check(b.truncate in ("middle", "head", "tail"), "bicc.truncate", f"'{b.truncate}' unknown; choose from: middle, head, tail")
    _check(0 < b.context_ratio < 1, "bicc.context_ratio", f"must be in (0, 1), got {b.context_ratio}")
    _check(b.paired_k >= 1, "bicc.paired_k", f"must be >= 1, got {b.paired_k}")
    _check(b.min_attempt_tokens >= 1, "bicc.min_attempt_tokens", f"must be >= 1, got {b.min_attempt_tokens}")
    _check(b.max_tokens >= 1, "bicc.max_tokens", f"must be >= 1, got {b.max_tokens}")
    _check(b.log_ratio_clip >= 0, "bicc.log_ratio_clip", f"must be >= 0 (0 = off), got {b.log_ratio_clip}")
    _check(b.warmup_steps >= 0, "bicc.warmup_steps", f"must be >= 0, got {b.warmup_steps}")
    _check(0 < b.lr_scale <= 10, "bicc.lr_scale", f"must be in (0, 10], got {b.lr_scale}")
    _check("{i}" in b.attempt_header, "bicc.attempt_header", f"must contain '{{i}}' (the attempt number), got {b.attempt_header!r}")

    e = cfg.eval
    _check(len(e.benchmarks) >= 1, "eval.benchmarks", "needs at least one benchmark")
    _check(e.samples_per_problem >= 1, "eval.samples_per_problem", f"must be >= 1, got {e.samples_per_problem}")
    _check(e.limit is None or e.limit >= 1, "eval.limit", f"must be null or >= 1, got {e.limit}")
    _check(e.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {e.temperature}")
    _check(0 < e.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {e.top_p}")
    for i, t in enumerate(e.also_temperatures):
        _check(t > 0, f"eval.also_temperatures[{i}]", f"must be > 0 (greedy is eval.greedy), got {t}")
    _check(e.on_bad_row in ("error", "skip"), "eval.on_bad_row", f"'{e.on_bad_row}' unknown; choose from: error, skip")
    _check(all(k >= 1 for k in e.ks), "eval.ks", f"every k must be >= 1, got {list(e.ks)}")
    _check(e.checker_deadline_s > 0, "eval.checker_deadline_s", f"must be > 0, got {e.checker_deadline_s}")
    from bicc.answers import EXTRACTORS

    names = [b.name for b in e.benchmarks]
    _check(len(set(names)) == len(names), "eval.benchmarks", f"benchmark names must be unique, got {names}")
    for i, b in enumerate(e.benchmarks):
        for name in b.extractors:
            _check(name in EXTRACTORS, f"eval.benchmarks[{i}].extractors",
                   f"'{name}' unknown; choose from: {', '.join(EXTRACTORS.names())}")

    rc = cfg.rcc
    _check(rc.delta in ("sum", "mean"), "rcc.delta", f"'{rc.delta}' unknown; choose from: sum, mean")
    _check(rc.delta_context in ("xc", "q"), "rcc.delta_context", f"'{rc.delta_context}' unknown; choose from: xc, q")
    _check(rc.diag_every >= 0, "rcc.diag_every", f"must be >= 0 (0 = off), got {rc.diag_every}")
    _check(rc.diag_splits >= 2, "rcc.diag_splits", f"must be >= 2 (a variance needs 2+ estimates), got {rc.diag_splits}")
    _check(rc.diag_splits <= cfg.rollout.prompts_per_step, "rcc.diag_splits",
           f"must be <= rollout.prompts_per_step={cfg.rollout.prompts_per_step} (splits are disjoint sets of groups), "
           f"got {rc.diag_splits}")
    _check(rc.stage_steps >= 1, "rcc.stage_steps", f"must be >= 1, got {rc.stage_steps}")

    ar = cfg.data.arith
    _check(2 <= ar.min_operands <= ar.max_operands, "data.arith.min_operands",
           f"need 2 <= min_operands <= max_operands, got {ar.min_operands}..{ar.max_operands}")
    _check(0 <= ar.slip_rate <= 1, "data.arith.slip_rate", f"must be in [0, 1], got {ar.slip_rate}")
    _check(ar.slip_step in ("any", "last"), "data.arith.slip_step", f"must be any | last, got {ar.slip_step!r}")
    _check(set(ar.ops) <= set("+-") and ar.ops != "", "data.arith.ops", f"use a non-empty subset of '+-', got '{ar.ops}'")
    _check(0 < ar.test_share < 1, "data.arith.test_share", f"must be in (0, 1), got {ar.test_share}")


def validate_lengths(cfg: Any, task, tokenizer, max_positions: int, limit_field: str, sample: int = 256) -> int:
    """Before any weights load: the longest prompt (of the first ``sample`` training problems) plus the BiCC
    context budget plus the output budget must fit the model's positions, and so must the longest
    evaluation prompt plus ``eval.max_new_tokens``. Returns the longer of the two: the longest sequence
    the run needs (vLLM's ``max_model_len``)."""
    from bicc.data import encode_prompt
    from bicc.evaluation import benchmark_source

    def longest(problems, encode):
        lengths = [(len(encode(p)), p.id) for p in problems]
        return max(lengths) if lengths else (0, None)

    train_len, train_id = longest([task.train_problem(i) for i in range(sample)],
                                  lambda p: encode_prompt(tokenizer, p.prompt))
    budget = int(cfg.bicc.context_ratio * cfg.bicc.max_tokens) if cfg.bicc.enabled else 0
    template, shown = 0, cfg.rollout.group_size - 1  # a context shows at most G - 1 attempts
    if cfg.bicc.enabled:
        enc = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        template = enc(cfg.bicc.preamble) + sum(enc(cfg.bicc.attempt_header.format(i=i + 1)) for i in range(shown))
    need = train_len + budget + template + cfg.rollout.max_new_tokens
    _check(need <= max_positions, "rollout.max_new_tokens",
           f"longest training prompt ({train_len} tokens, problem {train_id}) + BiCC context budget ({budget} = "
           f"bicc.context_ratio x bicc.max_tokens) + BiCC template ({template} = preamble + {shown} attempt headers) + "
           f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) = {need} exceeds the model's {max_positions} "
           f"positions ({limit_field}); lower the budgets or use a longer model")
    need_eval = 0
    for bench in cfg.eval.benchmarks:
        source = benchmark_source(bench, task, cfg.eval)
        test_len, test_id = longest(source.problems(), lambda p: source.prompt(tokenizer, p))
        need_bench = test_len + cfg.eval.max_new_tokens
        _check(need_bench <= max_positions, "eval.max_new_tokens",
               f"longest evaluation prompt of {bench.name} ({test_len} tokens, problem {test_id}) + eval.max_new_tokens "
               f"({cfg.eval.max_new_tokens}) = {need_bench} exceeds the model's {max_positions} positions ({limit_field})")
        need_eval = max(need_eval, need_bench)
    return max(need, need_eval)
