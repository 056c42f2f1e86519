"""GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673).

The sequence objective is the geometric mean of the clipped token objectives:

    J = mean_i sgn(A_i) |A_i| * prod_t min(rho_it, clip(rho_it, e^-eps_low, e^eps_high) ; sgn A_i)^(1/|o_i|)

computed, as the GMPO paper's code does, in log space: per-token log-ratios are clipped sign-aware
(for A > 0 only from above at +eps_high, for A < 0 only from below at -eps_low, i.e. the min/max of
PPO taken in log space), averaged over the sequence's tokens (exponent 1/|o_i|), exponentiated, and
multiplied by -A_i. Here ``clip_eps_low``/``clip_eps_high`` are LOG-ratio bounds (0.4 = the paper's
(e^-0.4, e^0.4)). How we differ: (1) optional KL and dual clip; (2) ``ratio_denominator=ref`` available.
"""

from __future__ import annotations

import math

import torch

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics, seq_mean


@LOSSES.register("gmpo")
def gmpo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    sign = torch.sign(adv).unsqueeze(-1)  # [B, 1]
    # A > 0: min(log_rho, eps_high); A < 0: max(log_rho, -eps_low) = -min(-log_rho, eps_low)
    # made on the device from the floats (a tensor of each sent from the host would sync once per micro-batch)
    bound = log_rho.new_full(sign.shape, cfg.clip_eps_low).masked_fill_(sign > 0, cfg.clip_eps_high)  # [B, 1]
    log_rho_clipped = sign * torch.minimum(sign * log_rho, bound)  # [B, L]
    seq_ratio = torch.exp(seq_mean(log_rho_clipped, mask))  # [B]: geometric mean of the clipped token ratios
    pg_seq = dual_clip((-adv * seq_ratio).unsqueeze(-1), adv, cfg)  # [B, 1]
    pg = pg_seq.expand_as(log_rho)  # [B, L]: one value per sequence, so seq-mean-token-mean = mean over sequences
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    with torch.no_grad():
        metrics = ratio_metrics(log_rho, log_rho.exp(), adv, mask, math.exp(-cfg.clip_eps_low), math.exp(cfg.clip_eps_high))
        metrics["train/seq_ratio_mean"] = seq_ratio.mean()
    return pg_loss + kl_loss, {**metrics, **kl_metrics}
