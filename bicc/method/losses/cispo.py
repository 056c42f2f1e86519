"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585).

PPO's clip drops the gradient of a token whose ratio left the band; CISPO keeps every token's gradient and clips
its importance weight instead, detached, on a REINFORCE term:

    L = -agg_t sg(clip(rho_it, 1 - eps_low, 1 + eps_high)) * A_i * log pi_theta(o_it)

so the gradient is -w_it A_i grad log pi per token, w_it the clipped weight (never zero). rho_it = pi_theta/pi_old
(its log clamped to [-20, 20] before the exp, as verl does); the logged loss is this term's value, as verl's.
The paper sets no lower bound (conf/algo/cispo.yaml: eps_low = 10, eps_high = 0.2, token-mean: verl's example).
How we differ: optional KL and TIS weight as every loss; ``ratio_denominator=ref`` available; ``dual_clip_c`` is not
used (the weight is already capped).
"""

from __future__ import annotations

import torch

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import importance_weighted, kl_term, log_ratio, ratio_metrics


@LOSSES.register("cispo")
def cispo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg).clamp(-20.0, 20.0)  # [B, L]
    ratio = torch.exp(log_rho)
    weight = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high).detach()  # [B, L]
    pg = -weight * adv.unsqueeze(-1) * logp  # [B, L]
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    return pg_loss + kl_loss, {**metrics, **kl_metrics}


cispo_loss.stop_gradient = True  # the weight is detached: the gradient is not the value's derivative
