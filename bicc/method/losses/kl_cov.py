"""KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate, with a KL penalty on the tokens of highest
covariance between advantage and log-probability.

With cov_it as in Clip-Cov (``token_covariance``, over the tokens of the batch the loss is given), the
k = max(floor(kl_cov_ratio * tokens), 1) tokens of largest cov_it take a penalty, and no token is clipped:

    L = -agg_t [rho_it A_i - ppo_kl_coef * 1[it in top-k] * |log rho_it|]

As verl computes it, the statistics are those of the micro-batch the loss sees (``micro_batch_statistics``).
conf/algo/kl_cov.yaml holds the authors' recipe: ratio 2e-3, coefficient 1, token-mean. Not the paper's RCC
(``rcc=on``), though the released BiCC code's documentation names the two so. How we differ: optional KL and TIS
weight and dual clip; ``ratio_denominator=ref``; the clip range is not used.

Logs `train/cov_penalised_frac`: the share of the micro-batch's output tokens that took the penalty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bicc.config.fields import need
from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate, masked_mean
from bicc.method.losses.clip_cov import token_covariance
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics, variant_params


@dataclass(frozen=True)
class KlCovParams:
    """verl's names: the share of tokens penalised, and the penalty's coefficient."""

    kl_cov_ratio: float = 2e-3
    ppo_kl_coef: float = 1.0

    def check(self) -> None:
        need(0 < self.kl_cov_ratio <= 1, "algo.params.kl_cov_ratio", f"must be in (0, 1], got {self.kl_cov_ratio}")
        need(self.ppo_kl_coef >= 0, "algo.params.ppo_kl_coef", f"must be >= 0, got {self.ppo_kl_coef}")


@LOSSES.register("kl_cov", params=KlCovParams)
def kl_cov_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    p = variant_params(cfg, KlCovParams)
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    ratio = torch.exp(log_rho)
    pg = -adv.unsqueeze(-1) * ratio
    real = (mask > 0).flatten()
    chosen = torch.zeros_like(real)
    if real.any():
        cov = token_covariance(adv, logp, mask).flatten()[real]
        index = torch.nonzero(real).squeeze(-1)
        k = max(int(len(cov) * p.kl_cov_ratio), 1)
        chosen[index[torch.topk(cov, k).indices]] = True
    chosen = chosen.view_as(pg)
    pg = dual_clip(torch.where(chosen, pg + p.ppo_kl_coef * log_rho.abs(), pg), adv, cfg)
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 0.0, math.inf)  # no clip: fractions 0
    metrics["train/cov_penalised_frac"] = masked_mean(chosen.to(ratio.dtype), mask)
    return pg_loss + kl_loss, {**metrics, **kl_metrics}


kl_cov_loss.micro_batch_statistics = True
kl_cov_loss.penalty_off = {"ppo_kl_coef": 0.0}  # its penalty on the top tokens is no policy-gradient term
