"""Pieces every policy loss shares: the ratio's denominator, the KL term, dual clip, diagnostics and a variant's
own hyperparameters."""

from __future__ import annotations

import math

import torch

from bicc.method.losses.agg import StepTotals, aggregate, masked_mean
from bicc.method.losses.kl import KL_ESTIMATORS


def log_ratio(logp, old_logp, ref_logp, cfg) -> torch.Tensor:
    """log pi_theta - log pi_denominator per token, the denominator chosen by ``cfg.ratio_denominator``:
    ``old`` (the sampling policy, standard) or ``ref`` (the frozen initial policy, as the seed paper's
    Table 1 writes Dr.GRPO)."""
    if cfg.ratio_denominator == "ref":
        if ref_logp is None:
            raise ValueError("algo.ratio_denominator=ref needs reference log-probs, but none were computed")
        return logp - ref_logp
    return logp - old_logp


def kl_term(logp, ref_logp, mask, cfg, totals: StepTotals):
    """beta * aggregated KL to the reference, and its logged value; zero when beta = 0."""
    if cfg.kl_coef == 0:
        return logp.new_zeros(()), {}
    if ref_logp is None:
        raise ValueError("algo.kl_coef > 0 needs reference log-probs, but none were computed")
    kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logp, ref_logp)  # [B, L]
    kl_loss = aggregate(kl, mask, cfg.loss_agg, totals)
    return cfg.kl_coef * kl_loss, {"train/kl_ref": masked_mean(kl.detach(), mask)}


def importance_weighted(pg: torch.Tensor, is_weight: torch.Tensor | None) -> torch.Tensor:
    """Per-token policy-gradient terms [B, L] times the sampler correction weight (none: unchanged)."""
    return pg if is_weight is None else pg * is_weight


def dual_clip(pg: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """Dual clip (Ye et al. 2020) for A < 0: the per-token loss is capped at -c*A, so a huge ratio on a
    negative sample cannot dominate the update. ``cfg.dual_clip_c = 0`` turns it off."""
    if cfg.dual_clip_c == 0:
        return pg
    a = adv.unsqueeze(-1).expand_as(pg)
    return torch.where(a < 0, torch.minimum(pg, -cfg.dual_clip_c * a), pg)


@torch.no_grad()
def ratio_metrics(log_ratio, ratio, adv, mask, low: float, high: float) -> dict[str, torch.Tensor]:
    """Clip fractions (low: ratio < low on A<0; high: ratio > high on A>0), approx KL, ratio stats: 0-d tensors on
    the ratio's device, read once per optimizer step (``bicc.trainer.update``), not once per micro-batch. The four means are
    one masked sum over a stack (a few ops per micro-batch, not a reduction each)."""
    a = adv.unsqueeze(-1)
    keep = mask.to(ratio.dtype)
    stats = torch.stack([(ratio < low) & (a < 0), (ratio > high) & (a > 0)]).to(ratio.dtype)  # [2, B, L]
    stats = torch.cat([stats, torch.stack([0.5 * log_ratio**2, ratio])])  # [4, B, L]
    low_frac, high_frac, kl, mean = ((stats * keep).sum((1, 2)) / keep.sum().clamp(min=1)).unbind()
    top = ratio.masked_fill(keep == 0, -math.inf).amax()
    return {
        "train/clip_frac_low": low_frac,
        "train/clip_frac_high": high_frac,
        "train/approx_kl_old": kl,
        "train/ratio_mean": mean,
        "train/ratio_max": torch.where(top > -math.inf, top, 1.0),  # no output token: 1
    }


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over each row's tokens. [B, L] -> [B]"""
    mask = mask.to(x.dtype)
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def variant_params(cfg, params: type):
    """``cfg.params`` (``algo.params``: a dict, or an OmegaConf node) as the loss's dataclass ``params``, its
    defaults where a key is not set."""
    return params(**cfg.params)
