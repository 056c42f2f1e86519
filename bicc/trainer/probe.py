"""Why does conditioning help or hurt? A gradient-alignment probe, no training.

    .venv/bin/python -m bicc.trainer.probe [--batches 4] [--ckpt DIR] [hydra overrides ...]

On a checkpoint (default: the embedded warm start; an HF id or dir on a GPU) and the configured task, for a
few rollout batches it computes the flattened policy gradient of the configured loss (one update per batch,
the variant's advantage) with the numerator evaluated on:

- ``g_q``    the plain prompt q (the base variant);
- ``g_0``    the conditioned code path with x^c = q (must equal g_q: an implementation check,
              ``RESULT probe_identity_gap`` = |g_0 - g_q| / |g_q|);
- ``g_1``    the real contexts with pi_old on x^c (ratio 1: the stabilised form's gradient);
- ``g_P``    the real contexts with pi_old on q (the paper's ratio, clipped by the loss);
- ``g_perm`` each group shown another query's attempts (same template, same sides, same budget), ratio 1;
- ``g_tmpl`` the template with no attempts, ratio 1.

It reports, over the batches, cos(g, g_q) and the first-order gain <g_q, g> / |g_q| (how much a step along g
improves the objective on q), the share of tokens whose gradient the paper form's clipping gates off (split
by the sign of A), and the conditioning weight log w = log pi(o | x^c) - log pi(o | q) summed over an
output's tokens, on correct and incorrect outputs (the paper's case study expects w > 1 on O+, w < 1 on O-).

Readings: g_1 ~ g_perm ~ g_tmpl means the model does not use the attempts' content (the template alone moves
it); g_1 aligned with g_q but g_P not means the paper's ratio (and its clipping) is what hurts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bicc.config import StepConfig
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import ContextRows, QueryRows
from bicc.machine.host import console_never_fails
from bicc.method.conditioning import (
    ConditionedPrompts,
    build_contexts,
    context_budget,
    positives,
    render_context,
    template_prompt,
)
from bicc.method.losses import LOSSES, StepTotals
from bicc.model.logprobs import make_token_batch

FORMS = ("g_q", "g_0", "g_1", "g_P", "g_perm", "g_tmpl")


def identity_contexts(plain_prompt_ids: list[list[int]], group_ids: torch.Tensor) -> ConditionedPrompts:
    """x^c = q for every sample, through the conditioned code path (a group's samples share one prefix)."""
    everyone = torch.ones(len(plain_prompt_ids), dtype=torch.bool)
    return ConditionedPrompts([list(p) for p in plain_prompt_ids], group_ids.tolist(), everyone)


def template_contexts(prompts: list[str], group_ids: torch.Tensor, tokenizer, bicc_cfg) -> ConditionedPrompts:
    """The BiCC template (preamble, no attempts) around each sample's own query."""
    ids = {g: template_prompt(tokenizer, prompts[i], bicc_cfg) for i, g in enumerate(group_ids.tolist())}
    everyone = torch.ones(len(prompts), dtype=torch.bool)
    return ConditionedPrompts([ids[g] for g in group_ids.tolist()], group_ids.tolist(), everyone)


def placebo_contexts(prompts: list[str], completion_ids: list[list[int]], correct: torch.Tensor, group_ids: torch.Tensor,
                     tokenizer, bicc_cfg, budget: int, end_ids, anchors, plain_prompt_ids) -> ConditionedPrompts:
    """Each group with both sides is shown the next such group's attempts (the side opposite to each sample's
    own), under its own query and the same template and budget; other samples keep q."""
    end = set(end_ids)
    attempts = [ids[:-1] if ids and ids[-1] in end else list(ids) for ids in completion_ids]
    groups = torch.unique(group_ids).tolist()
    sides = {g: ([i for i in range(len(correct)) if group_ids[i] == g and correct[i] == 1],
                 [i for i in range(len(correct)) if group_ids[i] == g and correct[i] != 1]) for g in groups}
    mixed = [g for g in groups if sides[g][0] and sides[g][1]]
    prompt_ids = [list(p) for p in plain_prompt_ids]
    keys, conditioned = list(range(len(correct))), torch.zeros(len(correct), dtype=torch.bool)
    for k, g in enumerate(mixed):
        other = mixed[(k + 1) % len(mixed)]
        if other == g:
            continue
        for side, shown in ((0, 1), (1, 0)):  # correct samples see the other group's incorrect attempts, and back
            rows = sides[g][side]
            ids = render_context(tokenizer, prompts[rows[0]], [attempts[o] for o in sides[other][shown]], bicc_cfg, budget,
                                 anchors)
            if ids is None:
                continue
            for r in rows:
                prompt_ids[r], keys[r], conditioned[r] = ids, len(correct) + 2 * k + side, True
    return ConditionedPrompts(prompt_ids, keys, conditioned)


def policy_gradient(model, numerator, old_logp, adv, mask, cfg: StepConfig) -> torch.Tensor:
    """The flattened gradient of the configured loss over all rows (normalised over all of them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    model.train()
    totals = StepTotals.of(mask, cfg.rollout.max_new_tokens)
    n, mb = mask.shape[0], cfg.train.micro_batch_size
    for start in range(0, n, mb):
        rows = torch.arange(start, min(start + mb, n))
        logp, _ = numerator.logprobs(model, rows, cfg.rollout.temperature)
        loss, _ = LOSSES.get(cfg.algo.loss)(logp, old_logp[rows], None, adv[rows], mask[rows], cfg.algo, totals)
        loss.backward()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params])
    model.zero_grad(set_to_none=True)
    return flat


def clip_gating(on_context, old_on_q, adv, mask, algo_cfg) -> dict[str, float]:
    """Share of tokens whose gradient the clipped surrogate gates off under the paper's ratio
    pi(o | x^c) / pi_old(o | q): ratio above 1 + eps_high with A > 0, below 1 - eps_low with A < 0."""
    ratio = torch.exp(on_context - old_on_q)  # [N, L]
    a = adv.unsqueeze(-1).expand_as(ratio)
    m = mask.bool()
    out = {}
    for name, side, gated in (("pos", a > 0, ratio > 1 + algo_cfg.clip_eps_high),
                              ("neg", a < 0, ratio < 1 - algo_cfg.clip_eps_low)):
        sel = m & side
        out[f"gated_share_A_{name}"] = (gated & sel).sum().item() / max(1, int(sel.sum()))
    return out


def probe_batch(model, tokenizer, ro, cfg: StepConfig, task_anchors, end_ids, device, advantages) -> dict:
    """Gradients of every form and the diagnostics for one rollout batch ``ro`` (``bicc.rollout.collect.Rollout``)."""
    T, mb = cfg.rollout.temperature, cfg.train.micro_batch_size
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id).to(device)
    mask, N, L = batch.completion_mask, batch.input_ids.shape[0], batch.completion_len
    adv, _ = advantages(ro.rewards, ro.group_ids, None, cfg.algo)
    adv = adv.to(device)
    budget = context_budget(cfg.bicc)
    positive = positives(ro, cfg.algo.partition, cfg.bicc.reward_threshold)  # the step's partition (algo.partition)
    real = build_contexts(ro.prompts, ro.out.completion_ids, positive, ro.group_ids, tokenizer, cfg.bicc,
                          cfg.bicc.max_tokens, ro.out.prompt_ids, end_ids, task_anchors)
    contexts = {
        "identity": identity_contexts(ro.out.prompt_ids, ro.group_ids),
        "real": real,
        "perm": placebo_contexts(ro.prompts, ro.out.completion_ids, positive.float(), ro.group_ids, tokenizer, cfg.bicc, budget,
                                 end_ids, task_anchors, ro.out.prompt_ids),
        "tmpl": template_contexts(ro.prompts, ro.group_ids, tokenizer, cfg.bicc),
    }
    numerators = {name: ContextRows(c, ro.out.completion_ids, L, cfg.train, tokenizer.pad_token_id, device)
                  for name, c in contexts.items()}
    plain = QueryRows(batch)
    on_q = logprobs_no_grad(model, plain, N, mb, T)
    on = {name: logprobs_no_grad(model, numerators[name], N, mb, T) for name in ("real", "perm", "tmpl")}
    grads = {
        "g_q": policy_gradient(model, plain, on_q, adv, mask, cfg),
        "g_0": policy_gradient(model, numerators["identity"], on_q, adv, mask, cfg),
        "g_1": policy_gradient(model, numerators["real"], on["real"], adv, mask, cfg),
        "g_P": policy_gradient(model, numerators["real"], on_q, adv, mask, cfg),
        "g_perm": policy_gradient(model, numerators["perm"], on["perm"], adv, mask, cfg),
        "g_tmpl": policy_gradient(model, numerators["tmpl"], on["tmpl"], adv, mask, cfg),
    }
    log_w = ((on["real"] - on_q) * mask).sum(-1).cpu()  # [N]
    cond = real.conditioned
    out = {"grads": grads, **clip_gating(on["real"], on_q, adv, mask, cfg.algo),
           "conditioned_share": cond.float().mean().item(), "attempts_shown": real.metrics["bicc/attempts_shown"],
           "whole_attempts_shown": real.metrics["bicc/whole_attempts_shown"]}
    for name, side in (("pos", ro.correct == 1), ("neg", ro.correct != 1)):
        sel = cond & side
        out[f"log_w_{name}"] = log_w[sel].tolist()
    for name in ("perm", "tmpl"):
        out[f"log_w_{name}"] = ((on[name] - on_q) * mask).sum(-1).cpu()[contexts[name].conditioned].tolist()
    return out


def identity_gap(g_0: torch.Tensor, g_q: torch.Tensor) -> float:
    """|g_0 - g_q| / |g_q|: how far the conditioned path with x^c = q is from the plain one, relative to the
    gradient's size, so that one target holds for a 0.46M and a 135M model alike (two float32 sums over
    differently padded rows differ by rounding that grows with the model). 0 when both are zero."""
    scale = g_q.norm().item() or g_0.norm().item() or 1.0
    return (g_0 - g_q).norm().item() / scale


def alignment(grads: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """cos(g, g_q) and <g_q, g> / |g_q| for every form."""
    gq = grads["g_q"]
    norm = gq.norm().item()
    return {name: {"cos": (torch.dot(g, gq) / (g.norm() * gq.norm()).clamp(min=1e-30)).item(),
                   "gain": torch.dot(g, gq).item() / max(norm, 1e-30), "norm": g.norm().item()}
            for name, g in grads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--ckpt", default=None, help="HF-format checkpoint dir or id (default: the warm start)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml (bicc must be on)")
    args = parser.parse_args()
    console_never_fails()

    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from bicc.config import register_configs
    from bicc.data import build_task
    from bicc.method.advantages import ADVANTAGES
    from bicc.model.gguf import resolve_model_path
    from bicc.model.load import end_token_ids, load_policy
    from bicc.rollout import EngineOptions, build_engine
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout
    from bicc.trainer.sft import warm_start
    from bicc.trainer.validation import validate

    root = Path(__file__).resolve().parents[2]  # the checkout: conf/ and .cache/ beside bicc/
    register_configs()
    with initialize_config_dir(config_dir=str(root / "conf"), version_base=None):
        cache = os.environ.get("BICC_CACHE", root / ".cache" / "bicc")  # as train.py's: BICC_CACHE, else the checkout's
        cfg = compose(config_name="train", overrides=[f"sft.cache_dir={cache}", "rcc=off", *args.overrides])
    validate(cfg)
    if not cfg.bicc.enabled:
        raise ValueError("config field 'bicc.enabled': the probe compares conditioned gradients; use bicc=on or stable")
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = build_task(cfg.data)
    cfg.model.path = resolve_model_path(cfg.model.path, cfg.sft.cache_dir)
    path = args.ckpt or (str(warm_start(cfg, task, device, progress=True)) if cfg.model.tiny is not None else cfg.model.path)
    model, tokenizer = load_policy(path, cfg.model, device)
    end_ids = end_token_ids(tokenizer, model)
    engine = build_engine("hf", model, tokenizer, cfg.rollout, EngineOptions(end_ids=tuple(end_ids)))
    print(f"probe: {path}; algo={cfg.algo.name} loss={cfg.algo.loss}, {args.batches} batches of "
          f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size}, context budget "
          f"{context_budget(cfg.bicc)} tokens")
    start, collection, step_cfg = time.perf_counter(), Collection.of(cfg.algo, cfg.rollout, cfg.data), StepConfig.of(cfg)
    per_batch, pooled, identity = [], {}, 0.0
    for b in range(args.batches):
        ro = collect_rollout(engine, tokenizer, task, collection, DataCursor(b * cfg.rollout.prompts_per_step),
                             seed=cfg.seed * 1_000_003 + b)
        result = probe_batch(model, tokenizer, ro, step_cfg, task.answer_anchors, end_ids, device,
                             ADVANTAGES.get(cfg.algo.advantage))
        identity = max(identity, identity_gap(result["grads"]["g_0"], result["grads"]["g_q"]))
        per_batch.append(alignment(result["grads"]))
        for key, value in result.items():
            if key != "grads":
                pooled.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    print(f"{time.perf_counter() - start:.0f}s\n")
    print("| gradient | cos(g, g_q) | gain <g_q, g>/|g_q| | |g| |")
    print("| --- | --- | --- | --- |")
    for form in FORMS:
        cos = statistics.fmean(r[form]["cos"] for r in per_batch)
        gain = statistics.fmean(r[form]["gain"] for r in per_batch)
        norm = statistics.fmean(r[form]["norm"] for r in per_batch)
        print(f"| {form} | {cos:.3f} | {gain:.4g} | {norm:.4g} |")
    print()
    for name in ("log_w_pos", "log_w_neg", "log_w_perm", "log_w_tmpl"):
        v = pooled.get(name, [])
        if v:
            print(f"{name}: mean {statistics.fmean(v):.2f}, median {statistics.median(v):.2f}, "
                  f"share > 0 {sum(x > 0 for x in v) / len(v):.2f} ({len(v)} outputs)")
    for name in ("gated_share_A_pos", "gated_share_A_neg", "conditioned_share", "attempts_shown", "whole_attempts_shown"):
        print(f"{name}: {statistics.fmean(pooled[name]):.3f}")
    print(f"RESULT probe_identity_gap={identity:.3g} target<=1e-4")


if __name__ == "__main__":
    main()
