"""Config validation that runs before any model is loaded: names against the registries, values against
their ranges, lengths against the model's positions. Every error names the field and what is allowed."""

from __future__ import annotations

from typing import Any

from bicc.config import RunConfig, diag_every
from bicc.config.fields import check_schema, need


def validate(cfg: Any) -> None:
    """Fail fast, before any model is loaded, with the field's name and what is allowed: names against the
    registries, every schema's closed choices and ranges (``RunConfig`` and the schemas inside it), then the
    checks that read more than one group."""
    # Imported here so the registries are filled by their modules' decorators.
    from bicc.data import TASKS
    from bicc.data.answers import EXTRACTORS
    from bicc.method.advantages import ADVANTAGES
    from bicc.method.losses import AGGREGATIONS, KL_ESTIMATORS, LOSSES
    from bicc.rollout import ENGINES

    named = [("algo.loss", LOSSES, cfg.algo.loss), ("algo.advantage", ADVANTAGES, cfg.algo.advantage),
             ("algo.loss_agg", AGGREGATIONS, cfg.algo.loss_agg), ("algo.kl_estimator", KL_ESTIMATORS, cfg.algo.kl_estimator),
             ("data.task", TASKS, cfg.data.task), ("rollout.engine", ENGINES, cfg.rollout.engine)]
    named += [(f"eval.benchmarks[{i}].extractors", EXTRACTORS, name)
              for i, b in enumerate(cfg.eval.benchmarks) for name in b.extractors]
    for field_name, registry, value in named:
        try:
            registry.get(value)
        except KeyError as err:  # the registry's message: the choices, or why an imported name failed
            need(False, field_name, err.args[0])

    # bicc.max_tokens follows rollout.max_new_tokens (conf/bicc): named where it is set, before BiCC's own check
    need(cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {cfg.rollout.max_new_tokens}")
    check_schema(cfg, RunConfig)
    check_params("algo.params", f"the loss '{cfg.algo.loss}'", cfg.algo.params, LOSSES.get(cfg.algo.loss))
    task = TASKS.get(cfg.data.task)
    check_params("data.params", f"the task '{cfg.data.task}'", cfg.data.params, task)
    if hasattr(task, "check"):  # the task's own checks across groups
        task.check(cfg.data, cfg.eval)

    need(cfg.algo.partition == "correct" or cfg.bicc.reward_threshold is None, "bicc.reward_threshold",
         f"splits the task's verdicts (algo.partition=correct); under algo.partition={cfg.algo.partition} O+ is the "
         f"shaped reward above 0.5: unset one of them (got {cfg.bicc.reward_threshold})")

    rollout_size = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    need(rollout_size % cfg.train.minibatches_per_rollout == 0, "train.minibatches_per_rollout",
         f"must divide prompts_per_step * group_size = {rollout_size}, got {cfg.train.minibatches_per_rollout}")
    need(not diag_every(cfg.diag, cfg.rcc) or cfg.diag.splits <= cfg.rollout.prompts_per_step, "diag.splits",
         f"must be <= rollout.prompts_per_step={cfg.rollout.prompts_per_step} (splits are disjoint sets of groups), "
         f"got {cfg.diag.splits}")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    need(rows <= MAX_ROWS_PER_STEP, "rollout.prompts_per_step",
         f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} x rollout.group_size={cfg.rollout.group_size} = "
         f"{rows:.3g} rows a step, over {MAX_ROWS_PER_STEP:.0e} (the paper's: 128; DAPO's: 8192)")
    if cfg.bicc.enabled and cfg.train.context_packing and cfg.train.context_packing_impl == "mask":
        from bicc.kernels.packing import MASK_ATTENTION
        from bicc.model.load import resolve_attn_implementation

        impl = resolve_attn_implementation(cfg.model.attn_implementation)
        need(impl in MASK_ATTENTION, "train.context_packing_impl",
             f"'mask' needs a 4-D attention mask, which model.attn_implementation={impl} ignores; use kv")


# A step's rows (prompts x samples) beyond any RL recipe: refused before anything is drawn or allocated.
MAX_ROWS_PER_STEP = 10**6


def check_params(field_name: str, owner: str, values: Any, entry) -> None:
    """``values`` (``algo.params``, ``data.params``) against the dataclass ``entry`` declares (``entry.params``: a
    loss's, ``LOSSES.register(name, params=...)``, or a task class's): every key one of its fields, then its own
    ``check()``."""
    import dataclasses

    spec = getattr(entry, "params", None)
    known = [f.name for f in dataclasses.fields(spec)] if spec else []
    for key in values or {}:
        need(key in known, f"{field_name}.{key}", f"is not a parameter of {owner} "
             f"({'its parameters: ' + ', '.join(known) if known else 'it takes none'})")
    if spec is not None and hasattr(spec, "check"):
        spec(**(values or {})).check()


def longest(problems, encode) -> tuple[int, object]:
    """(the most tokens ``encode`` gives one of ``problems``, that problem's id); (0, None) for none."""
    lengths = [(len(encode(p)), p.id) for p in problems]
    return max(lengths) if lengths else (0, None)


def longest_training_prompt(task, tokenizer, sample: int = 256, max_len: int | None = None) -> tuple[int, object]:
    """The longest templated prompt of the first ``sample`` training problems, at most ``max_len`` tokens
    (``data.max_prompt_length``: longer ones are dropped or cut): (tokens, problem id)."""
    from bicc.data import encode_prompt

    tokens, problem = longest([task.train_problem(i) for i in range(sample)], lambda p: encode_prompt(tokenizer, p.prompt))
    return (min(tokens, max_len), problem) if max_len else (tokens, problem)


def context_template_tokens(bicc, group_size: int, tokenizer) -> int:
    """BiCC's template around the attempts a context shows (at most G - 1): preamble and attempt headers."""
    if not bicc.enabled:
        return 0
    enc = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return enc(bicc.preamble) + sum(enc(bicc.attempt_header.format(i=i + 1)) for i in range(group_size - 1))


def validate_lengths(rollout, bicc, data, eval_cfg, task, tokenizer, max_positions: int, limit_field: str,
                     longrope: int | None = None,
                     sample: int = 256, train: bool = True) -> int:
    """Before any weights load: the longest prompt (of the first ``sample`` training problems) plus the BiCC
    context budget plus the output budget must fit the model's positions, and so must the longest
    evaluation prompt plus ``eval.max_new_tokens``. Returns the longer of the two: the longest sequence
    the run needs (vLLM's ``max_model_len``). ``train`` False: evaluation only (eval.py).

    Under vLLM a LongRoPE model (``longrope``: its original_max_position_embeddings) must fit that range: past it
    vLLM rotates every position with the long factors, transformers only positions beyond it, so the engine
    would sample from another policy than the trainer scores."""
    from bicc.rollout import ENGINES

    if ENGINES.get(rollout.engine).longrope_long_everywhere and longrope:
        max_positions, limit_field = min(max_positions, longrope), (
            f"LongRoPE: vLLM uses the long RoPE factors for every position once max_model_len exceeds "
            f"original_max_position_embeddings={longrope}, transformers only past it; evaluate longer outputs "
            f"with rollout=hf")
    from bicc.evaluation.evaluate import benchmark_source
    from bicc.method.conditioning import context_budget

    train_len, train_id = (longest_training_prompt(task, tokenizer, sample, data.max_prompt_length) if train
                           else (0, None))
    budget = context_budget(bicc) if bicc.enabled else 0
    template, shown = context_template_tokens(bicc, rollout.group_size, tokenizer), rollout.group_size - 1
    need_train = train_len + budget + template + rollout.max_new_tokens if train else 0
    need(need_train <= max_positions, "rollout.max_new_tokens",
         f"longest training prompt ({train_len} tokens, problem {train_id}) + BiCC context budget ({budget} = "
         f"bicc.context_ratio x bicc.max_tokens) + BiCC template ({template} = preamble + {shown} attempt headers) + "
         f"rollout.max_new_tokens ({rollout.max_new_tokens}) = {need_train} exceeds the model's {max_positions} "
         f"positions ({limit_field}); lower the budgets or use a longer model")
    need_eval = 0
    for bench in eval_cfg.benchmarks:
        source = benchmark_source(bench, task, eval_cfg)
        test_len, test_id = longest(source.problems(), lambda p: source.prompt(tokenizer, p))
        need_bench = test_len + eval_cfg.max_new_tokens
        need(need_bench <= max_positions, "eval.max_new_tokens",
             f"longest evaluation prompt of {bench.name} ({test_len} tokens, problem {test_id}) + eval.max_new_tokens "
             f"({eval_cfg.max_new_tokens}) = {need_bench} exceeds the model's {max_positions} positions ({limit_field})")
        need_eval = max(need_eval, need_bench)
    return max(need_train, need_eval)
