"""Config validation that runs before any model is loaded: names against the registries, values against
their ranges, lengths against the model's positions. Every error names the field and what is allowed."""

from __future__ import annotations

from typing import Any


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
