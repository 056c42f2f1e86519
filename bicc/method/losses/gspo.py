"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

Sequence-level ratio s_i = exp((1/|o_i|) sum_t log(pi_theta/pi_old)) clipped to (1 - 3e-4, 1 + 4e-4):

    J = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

We implement the paper's token form (its eq. for GSPO-token) with every token's advantage equal to A_i:
s_it = exp(sg[log s_i] + log pi_it - sg[log pi_it]), whose value is s_i and whose gradient is
s_i * grad log pi_it, so the (seq-mean-token-mean) aggregate has exactly the sequence form's gradient
while gradients flow per token. How we differ: (1) optional KL and dual clip, as for every loss;
(2) ``ratio_denominator=ref`` is available.
"""

from __future__ import annotations

import torch

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics, seq_mean


@LOSSES.register("gspo")
def gspo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    log_seq_ratio = seq_mean(log_rho, mask)  # [B]
    seq_ratio_token = torch.exp(log_seq_ratio.detach().unsqueeze(-1) + logp - logp.detach())  # [B, L], value s_i
    a = adv.unsqueeze(-1)  # [B, 1]
    pg_unclipped = -a * seq_ratio_token
    pg_clipped = -a * seq_ratio_token.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = dual_clip(torch.maximum(pg_unclipped, pg_clipped), adv, cfg)  # [B, L]
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = {**ratio_metrics(log_rho.detach(), seq_ratio_token.detach(), adv, mask, 1 - cfg.clip_eps_low,
                               1 + cfg.clip_eps_high), **kl_metrics}
    return pg_loss + kl_loss, metrics
