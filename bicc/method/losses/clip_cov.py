"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv 2505.22617): the clipped surrogate, with the gradient of a few high-covariance tokens cut.

Per token, over the tokens of the batch the loss is given, the covariance of advantage and log-probability is

    cov_it = (A_i - mean_tokens A) * (log pi_theta(o_it) - mean_tokens log pi_theta)      (detached)

Of the tokens the clip did not already touch with lb < cov_it < ub, n = max(floor(clip_cov_ratio * tokens), 1)
are drawn at random (torch's generator, saved with every checkpoint) and their term is multiplied by 0:

    L = -agg_t keep_it * min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)

As verl computes it, the statistics are those of the micro-batch the loss sees, so the step depends on how it is
split (``micro_batch_statistics``). conf/algo/clip_cov.yaml holds the authors' recipe: ratio 2e-4, bounds (1, 5),
token-mean. The released BiCC code's documentation names this (and KL-Cov) as its RCC; it is not the paper's
r - R̄ - 2·Cov(r, δ) (``rcc=on``). How we differ: optional KL, TIS weight and dual clip; ``ratio_denominator=ref``.

Logs `train/cov_cut_frac`: the share of the micro-batch's output tokens whose gradient was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bicc.config.fields import need
from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate, masked_mean
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics, variant_params


@dataclass(frozen=True)
class ClipCovParams:
    """verl's names: the share of tokens cut, and the covariance window they are drawn from."""

    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def check(self) -> None:
        need(0 < self.clip_cov_ratio <= 1, "algo.params.clip_cov_ratio", f"must be in (0, 1], got {self.clip_cov_ratio}")
        need(self.clip_cov_lb < self.clip_cov_ub, "algo.params.clip_cov_lb",
             f"must be < algo.params.clip_cov_ub={self.clip_cov_ub}, got {self.clip_cov_lb}")


def token_covariance(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L] per-token (A - token mean of A) * (log pi - token mean of log pi) over the masked tokens, detached."""
    a = adv.unsqueeze(-1).expand_as(logp).detach()
    logp = logp.detach()
    return (a - masked_mean(a, mask)) * (logp - masked_mean(logp, mask))


@LOSSES.register("clip_cov", params=ClipCovParams)
def clip_cov_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    p = variant_params(cfg, ClipCovParams)
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    ratio = torch.exp(log_rho)
    a = adv.unsqueeze(-1)
    pg_unclipped = -a * ratio
    pg_clipped = -a * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    real = mask > 0
    cov = token_covariance(adv, logp, mask)
    candidates = torch.nonzero((cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & real & ~(pg_clipped > pg_unclipped))
    keep = torch.ones_like(ratio)
    if len(candidates):
        n = max(int(p.clip_cov_ratio * float(real.sum())), 1)
        cut = candidates[torch.randperm(len(candidates)).to(candidates.device)[:n]]
        keep[cut[:, 0], cut[:, 1]] = 0
    pg = dual_clip(torch.maximum(pg_unclipped, pg_clipped), adv, cfg) * keep
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    metrics["train/cov_cut_frac"] = masked_mean((keep == 0).to(ratio.dtype), mask)
    return pg_loss + kl_loss, {**metrics, **kl_metrics}


clip_cov_loss.micro_batch_statistics = True
