"""What a run prints about itself at start: what it trains, by config group, with the forms that are not the paper's
named as such (``describe_choices``), and how its forwards lay out their rows (``forward_layout``)."""

from __future__ import annotations

from bicc.config import StepConfig, corrects, is_level
from bicc.data import TASKS
from bicc.kernels.packing import padding_free
from bicc.method.conditioning import context_budget
from bicc.trainer.state import peak_lr

NAMED_FORMS = {("bicc", "stable"): "stabilised BiCC, not the paper's",
               ("bicc", "released"): "the authors' released code's form, not the paper's; as its code describes it, not "
                                     "as its update runs it (bicc=off: docs/method.md, row 0)",
               ("algo", "released"): "the released code's objective, not a paper variant",
               ("rcc", "mean"): "RCC with per-token mean delta, not the paper's"}


def describe_choices(choices, cfg: StepConfig, model, data, sft) -> str:
    """What this run trains, by config group (the step's groups, the model's, the data's, the warm start's), with the
    forms that are not the paper's named as such."""
    parts = []
    for group in ("algo", "bicc", "rcc", "model", "data", "rollout", "eval", "experiment"):
        choice = choices.get(group)
        if choice is not None:
            note = NAMED_FORMS.get((group, choice))
            parts.append(f"{group}={choice}" + (f" ({note})" if note else ""))
    r = cfg.rollout
    text = (" ".join(parts) + f"; lr {peak_lr(cfg.optim, cfg.bicc):g}, {cfg.train.steps} steps of {r.prompts_per_step} prompts x "
            f"G={r.group_size}, max {r.max_new_tokens} tokens")
    if cfg.algo.kl_coef > 0:
        text += f", KL {cfg.algo.kl_coef:g} ({cfg.algo.kl_estimator})"
    if cfg.bicc.enabled:
        text += ", attempts shown whole" if cfg.bicc.truncate == "none" else f", context budget {context_budget(cfg.bicc)} tokens"
        if cfg.bicc.context_in == "denominator":
            text += ", ratio pi_theta(o | q) / pi_old(o | x^c) (the released code's, the paper's reversed)"
    if r.async_steps:
        text += f", rollout workers {r.async_steps} step(s) ahead with {correction_words(r)}"
    elif corrects(r):
        text += f", sampler correction: {correction_words(r)}"
    task = TASKS.get(data.task)
    if model.tiny is not None and hasattr(task, "describe"):
        text += f", {task.describe(data)}"
    if model.tiny is not None and sft.context_share > 0:
        text += f", warm start shows {sft.context_attempts} attempts on {sft.context_share:g} of its prompts"
    return text


def forward_layout(model, bicc, train) -> str:
    """How the trainer's forwards lay out their rows (``bicc.kernels.packing.padding_free``), for the start-up line."""
    impl = model.config._attn_implementation
    if not padding_free(model):
        return (f"each micro-batch padded to its longest row (attn_implementation={impl}; padding-free needs "
                "flash_attention_2 and model.padding_free)")
    bicc_kv = not bicc.enabled or (train.context_packing and train.context_packing_impl == "kv")
    padded = [name for name, kv in (("the rows on q", train.share_prompts), ("BiCC's rows", bicc_kv)) if not kv]
    if not padded:
        return f"padding-free ({impl})"
    return (f"padding-free ({impl}) but {' and '.join(padded)}, padded to each micro-batch's longest row "
            "(padding-free needs KV reuse: train.share_prompts, train.context_packing_impl=kv)")


def correction_words(r) -> str:
    """``rollout.correction`` in words: TIS (cap C) / IcePop [lo, hi] at the token or sequence level, the rejection's
    criteria, or no importance weights."""
    from bicc.method.correction import is_bounds

    c, level = r.correction, is_level(r)
    parts = []
    if level != "none":
        b = is_bounds(c.rollout_is_threshold)
        kind = f"TIS (cap {b.upper:g})" if b.lower is None else f"IcePop [{b.lower:g}, {b.upper:g}]"
        parts.append(f"{level}-level {kind}" + (", normalised over the step" if c.rollout_is_batch_normalize else ""))
    if c.rollout_rs:
        parts.append(f"rejection {c.rollout_rs} at {c.rollout_rs_threshold}")
    return "; ".join(parts) if parts else "no importance weights"

