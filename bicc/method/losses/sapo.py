"""SAPO: Soft Adaptive Policy Optimization (arXiv 2511.20347).

A soft gate in place of the hard clip: per token,

    f(rho; tau) = (4 / tau) * sigmoid(tau * (rho - 1)),   L = -agg_t f(rho_it; tau_i) * A_i

with tau_i = ``algo.params.tau_pos`` where A_i > 0 and ``tau_neg`` otherwise (A = 0 takes tau_neg). At rho = 1 the
gate's slope is 1 (the plain policy gradient); away from 1 it fades smoothly instead of stopping. The log-ratio is
clamped to [-20, 20] before the exp, as verl does. conf/algo/sapo.yaml: tau 1.0 / 1.05 (the paper's), and
seq-mean-token-mean, the aggregation verl's SAPO always uses (here ``algo.loss_agg`` still chooses).
How we differ: optional KL, TIS weight and dual clip as every loss; ``ratio_denominator=ref`` available.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bicc.config.fields import need
from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics, variant_params


@dataclass(frozen=True)
class SapoParams:
    """The gate's temperatures on positive and negative advantages (a higher one fades faster)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def check(self) -> None:
        need(self.tau_pos > 0, "algo.params.tau_pos", f"must be > 0, got {self.tau_pos}")
        need(self.tau_neg > 0, "algo.params.tau_neg", f"must be > 0, got {self.tau_neg}")


@LOSSES.register("sapo", params=SapoParams)
def sapo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    p = variant_params(cfg, SapoParams)
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg).clamp(-20.0, 20.0)  # [B, L]
    ratio = torch.exp(log_rho)
    a = adv.unsqueeze(-1)  # [B, 1]
    tau = ratio.new_full(a.shape, p.tau_neg).masked_fill_(a > 0, p.tau_pos)  # [B, 1], in the ratio's dtype
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)  # [B, L]
    pg = dual_clip(-gate * a, adv, cfg)
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 0.0, math.inf)  # no clip: fractions 0
    return pg_loss + kl_loss, {**metrics, **kl_metrics}
