"""ASPO: Asymmetric Importance Sampling Policy Optimization (Wang et al. 2025, arXiv 2510.06062).

The formula, per token, as the paper states it:

- A > 0: the importance weight is flipped. With r_p = min(rho, 1 + eps_high) the term is
  -A * (r_p / sg(r_p)) / sg(r_p): its value is -A / r_p and its gradient -A * (1/r_p) * grad log pi
  (zero once rho > 1 + eps_high, where r_p is constant). Tokens the old policy under-weighted thus get
  smaller, not larger, positive updates.
- A < 0: the usual clipped term -A * max(rho, 1 - eps_low).
- Soft dual clip with constant c = ``dual_clip_c``: where the active gradient weight (1/r_p for A > 0,
  rho for A < 0) exceeds c, the term becomes -A * sg(c) * log pi, i.e. the gradient weight is capped at c.

Aggregation as DAPO (token-mean). How we differ: optional KL; ``ratio_denominator=ref`` available.
"""

from __future__ import annotations

import torch

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import importance_weighted, kl_term, log_ratio, ratio_metrics


@LOSSES.register("aspo")
def aspo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    ratio = torch.exp(log_rho)  # [B, L]
    a = adv.unsqueeze(-1).expand_as(ratio)  # [B, L]
    positive = a > 0
    r_pos = ratio.clamp(max=1 + cfg.clip_eps_high)
    pg_pos = -a * (r_pos / r_pos.detach()) / r_pos.detach()  # value -A/r_p, grad -A (1/r_p) grad log pi
    pg_neg = -a * torch.maximum(ratio, torch.full_like(ratio, 1 - cfg.clip_eps_low))
    pg = torch.where(positive, pg_pos, pg_neg)  # [B, L]
    if cfg.dual_clip_c > 0:
        weight = torch.where(positive, 1 / r_pos, ratio).detach()  # active gradient weight on grad log pi
        over = weight > cfg.dual_clip_c
        pg = torch.where(over & (a != 0), -a * cfg.dual_clip_c * logp, pg)
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = {**ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high),
               **kl_metrics}
    if cfg.dual_clip_c > 0:
        metrics["train/dual_clip_frac"] = (over & mask.bool()).float().sum() / mask.sum().clamp(min=1)
    return pg_loss + kl_loss, metrics


aspo_loss.stop_gradient = True  # sg() factors: the gradient is not the value's derivative
