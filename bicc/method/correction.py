"""The rollout correction: the sampler's tokens against the trainer's pi_old, verl's ``rollout_corr_helper`` in its
vocabulary (``rollout.correction``). The tokens were drawn by pi_sampler (another engine's numerics, or under
rollout workers older weights), so with log r = log pi_old - log pi_sampler per token:

- **importance weights** (``rollout_is``): per token w = r, or per sequence w = exp(sum_t log r) on each of its
  tokens (log r clamped to [-20, 20] before the exp); a single threshold C truncates them at C (TIS), a band
  ``lo_hi`` zeroes those outside [lo, hi] (IcePop); ``rollout_is_batch_normalize`` divides them by their mean over
  the step (over its tokens, or its sequences), every rank's. Detached, they weight each token's policy-gradient
  term (every loss's ``is_weight``).
- **rejection** (``rollout_rs``, comma-separated criteria, all of which must pass): a token (``token_*``) or a whole
  sequence (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``, over its tokens) leaves the loss and every normaliser, as a
  masked token does, where its divergence passes the threshold: k1 = -log r kept within [log lo, log hi] (the ratio
  pi_sampler / pi_old within [lo, hi]; one value u means [1/u, u]), k2 = (log r)^2 / 2 and k3 = r - 1 - log r kept
  at most their threshold.

A token for which the sampler gave no log-prob gets weight 1 and is never rejected. Each criterion's masked share is
logged under ``rollout_corr/``. verl's names: ``rollout_is``, ``rollout_is_threshold``,
``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``; its metrics keep their names behind the
prefix.
"""

from __future__ import annotations

import math

import torch

from bicc.config.correction import CRITERIA, LEVELS, Bounds, Correction, criteria_of, is_bounds, rs_bounds  # noqa: F401

SAFETY_BOUND = 20.0  # exp(+-20): the log-ratio's clamp before any exp, as verl's


def importance_weights(log_ratio, mask, level: str, bounds: Bounds, batch_normalize: bool, step_sum=None):
    """w [N, L] (0 on padding; detached) and ``rollout_corr/`` metrics: see the module's docstring. ``step_sum`` sums a
    tensor over every rank's outputs (None: this process's) for the batch normalisation."""
    mask = mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq = (log_ratio * mask).sum(-1, keepdim=True)  # [N, 1]
        raw = torch.exp(seq.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if bounds.lower is None:
        weight = raw.clamp(max=bounds.upper)
    else:
        weight = torch.where((raw >= bounds.lower) & (raw <= bounds.upper), raw, torch.zeros_like(raw))
    weight = weight.detach()
    n = mask.sum().clamp(min=1)
    metrics = {"rollout_corr/rollout_is_mean": ((weight * mask).sum() / n).item(),
               "rollout_corr/rollout_is_max": weight[mask.bool()].max().item() if mask.any() else 0.0,
               "rollout_corr/rollout_is_min": weight[mask.bool()].min().item() if mask.any() else 0.0}
    out_of_bounds = (raw > bounds.upper) | ((raw < bounds.lower) if bounds.lower is not None else torch.zeros_like(raw).bool())
    metrics["rollout_corr/rollout_is_oob_ratio"] = ((out_of_bounds.to(mask.dtype) * mask).sum() / n).item()
    if batch_normalize:
        step_sum = step_sum or (lambda t: t)
        if level == "token":
            total, count = step_sum(torch.stack([(weight * mask).sum(), mask.sum()]).double().cpu()).tolist()
        else:
            has = (mask.sum(-1) > 0).to(mask.dtype)
            per_seq = (weight * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            total, count = step_sum(torch.stack([(per_seq * has).sum(), has.sum()]).double().cpu()).tolist()
        mean = total / max(count, 1e-8)
        if mean > 1e-8:
            weight = weight / mean
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return weight, metrics


def rejection_mask(log_ratio, mask, criteria: list[str], bounds: dict[str, Bounds]):
    """The mask [N, L] with the tokens every criterion rejects removed, and each criterion's masked share of the
    tokens (and of the sequences) under ``rollout_corr/``."""
    mask = mask.to(log_ratio.dtype)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1 - safe}
    n, rows = mask.sum().clamp(min=1), (mask.sum(-1) > 0).to(mask.dtype)
    keep_all, metrics = torch.ones_like(mask), {}
    for c in criteria:
        b, stat = bounds[c], divergence[c[-2:]]
        if not c.startswith("token"):
            if c.startswith("seq_sum"):
                stat = (stat * mask).sum(-1)
            elif c.startswith("seq_mean"):
                stat = (stat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            else:
                top = stat.masked_fill(~mask.bool(), -math.inf).amax(-1)
                stat = torch.where(torch.isinf(top), torch.zeros_like(top), top)
            stat = stat.unsqueeze(-1).expand_as(mask)
        keep = (stat >= math.log(b.lower)) & (stat <= math.log(b.upper)) if c.endswith("k1") else stat <= b.upper
        keep = keep.to(mask.dtype)
        keep_all = keep_all * keep
        dropped_rows = (((1 - keep) * mask).sum(-1) > 0).to(mask.dtype)
        metrics[f"rollout_corr/rollout_rs_{c}_masked_fraction"] = (((1 - keep) * mask).sum() / n).item()
        metrics[f"rollout_corr/rollout_rs_{c}_seq_masked_fraction"] = ((dropped_rows * rows).sum()
                                                                        / rows.sum().clamp(min=1)).item()
    metrics["rollout_corr/rollout_rs_masked_fraction"] = (((1 - keep_all) * mask).sum() / n).item()
    return mask * keep_all, metrics


def correct(log_ratio, mask, level: str, is_threshold, batch_normalize: bool, rollout_rs: str | None, rs_threshold,
            step_sum=None):
    """``apply`` with the settings as ``rollout.correction`` writes them."""
    return apply(log_ratio, mask, Correction.parse(level, is_threshold, batch_normalize, rollout_rs, rs_threshold), step_sum)


def apply(log_ratio, mask, spec: Correction, step_sum=None):
    """The whole correction of a step: (importance weights [N, L] or None at level ``none``, the mask the update
    trains [N, L], ``rollout_corr/`` metrics). ``log_ratio`` = log pi_old - log pi_sampler (0 where the sampler gave
    none); ``spec``: the parsed settings."""
    weight, metrics = None, {}
    if spec.level != "none":
        weight, metrics = importance_weights(log_ratio, mask, spec.level, spec.bounds, spec.batch_normalize, step_sum)
    kept = mask.to(log_ratio.dtype)
    if spec.criteria:
        kept, rs_metrics = rejection_mask(log_ratio, mask, list(spec.criteria), spec.criteria_bounds)
        metrics.update(rs_metrics)
    return weight, kept, metrics
