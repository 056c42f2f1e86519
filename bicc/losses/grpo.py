"""GRPO's clipped surrogate (Shao et al. 2024; the BiCC paper's eq. 4).

    L = -agg_t min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta * agg_t KL_it

with rho_it = pi_theta / pi_old per token and agg = ``cfg.loss_agg`` (seq-mean-token-mean for GRPO).
Differences from the paper: (1) eps_low and eps_high are separate knobs (equal by default);
(2) the KL term is optional (beta = 0 by default, as in the paper's GRPO runs).
"""

from __future__ import annotations

import torch

from bicc.losses import LOSSES
from bicc.losses.agg import StepTotals, aggregate, masked_mean
from bicc.losses.kl import KL_ESTIMATORS


def kl_term(logp, ref_logp, mask, cfg, totals: StepTotals):
    """beta * aggregated KL to the reference, and its logged value; zero when beta = 0."""
    if cfg.kl_coef == 0:
        return logp.new_zeros(()), {}
    if ref_logp is None:
        raise ValueError("algo.kl_coef > 0 needs reference log-probs, but none were computed")
    kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logp, ref_logp)  # [B, L]
    kl_loss = aggregate(kl, mask, cfg.loss_agg, totals)
    return cfg.kl_coef * kl_loss, {"train/kl_ref": masked_mean(kl.detach(), mask).item()}


@torch.no_grad()
def ratio_metrics(log_ratio, ratio, adv, mask, cfg) -> dict[str, float]:
    """Clip fractions (low: rho < 1-eps on A<0; high: rho > 1+eps on A>0), approx KL, ratio stats."""
    a = adv.unsqueeze(-1).expand_as(ratio)
    clipped_low = (ratio < 1 - cfg.clip_eps_low) & (a < 0)
    clipped_high = (ratio > 1 + cfg.clip_eps_high) & (a > 0)
    m = mask.bool()
    return {
        "train/clip_frac_low": masked_mean(clipped_low.float(), mask).item(),
        "train/clip_frac_high": masked_mean(clipped_high.float(), mask).item(),
        "train/approx_kl_old": masked_mean(0.5 * log_ratio**2, mask).item(),
        "train/ratio_mean": masked_mean(ratio, mask).item(),
        "train/ratio_max": ratio[m].max().item() if m.any() else 1.0,
    }


@LOSSES.register("grpo")
def grpo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals):
    log_ratio = logp - old_logp  # [B, L]
    ratio = torch.exp(log_ratio)  # [B, L]
    a = adv.unsqueeze(-1)  # [B, 1]
    pg_unclipped = -a * ratio
    pg_clipped = -a * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # [B, L]: max of negatives = min of objectives
    pg_loss = aggregate(pg, mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = {**ratio_metrics(log_ratio.detach(), ratio.detach(), adv, mask, cfg), **kl_metrics}
    return pg_loss + kl_loss, metrics
