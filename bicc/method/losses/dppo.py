"""DPPO: Divergence-bounded Policy Optimization (arXiv 2602.04879), verl's ``dppo_tv`` and ``dppo_kl``.

PPO bounds the ratio rho = pi_theta / pi_old; DPPO bounds the divergence of the token's probability instead, so that
a rare token (p_old small) may move by as much, in probability, as a common one. Per token, with p = exp(log
pi_theta), p_old = exp(log pi_old):

    L = -agg_t  m_it * sg(min(rho_it, C)) * A_i * log pi_theta(o_it)

a REINFORCE term weighted by the ratio truncated at C (detached: truncated importance sampling, where PPO has its dual
clip), and m_it = 1 while the token stays inside the divergence bound on the side its advantage pushes it:

- ``dppo_tv`` (binary total variation): A > 0 keeps p - p_old <= d_high, A <= 0 keeps p - p_old >= -d_low;
- ``dppo_kl`` (binary KL of Bernoulli(p_old) to Bernoulli(p)): A > 0 keeps KL <= d_high or p <= p_old, A <= 0 keeps
  KL <= d_low or p >= p_old, KL = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)).

verl reads d_low and d_high from its PPO clip ratios; here they are ``algo.params.divergence_low`` and
``divergence_high`` (0.2 each, verl's clip_ratio default), C is ``algo.params.truncation`` (verl's clip_ratio_c, 20).
The log-ratio is clamped to [-20, 20] before the exp, as verl does. The mask and the weight are detached, so the
gradient is -m w A grad log pi (``stop_gradient``).
How we differ: optional KL and the sampler correction's weight as every loss; ``ratio_denominator=ref`` takes pi_ref
for pi_old in the ratio and the bound alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bicc.config.fields import need
from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate, masked_mean
from bicc.method.losses.common import importance_weighted, kl_term, log_ratio, ratio_metrics, variant_params


@dataclass(frozen=True)
class DppoParams:
    """The divergence bounds on the side of negative (low) and positive (high) advantages, and the truncation of
    the importance weight."""

    divergence_low: float = 0.2
    divergence_high: float = 0.2
    truncation: float = 20.0

    def check(self) -> None:
        need(self.divergence_low > 0, "algo.params.divergence_low", f"must be > 0, got {self.divergence_low}")
        need(self.divergence_high > 0, "algo.params.divergence_high", f"must be > 0, got {self.divergence_high}")
        need(self.truncation > 0, "algo.params.truncation", f"must be > 0, got {self.truncation}")


def total_variation_mask(p, p_old, positive, p_params: DppoParams) -> torch.Tensor:
    """Tokens inside the binary-TV bound on their advantage's side. [B, L] bool"""
    return torch.where(positive, p - p_old <= p_params.divergence_high, p - p_old >= -p_params.divergence_low)


def binary_kl_mask(p, p_old, positive, p_params: DppoParams) -> torch.Tensor:
    """Tokens inside the binary-KL bound, or moving away from their advantage's side. [B, L] bool"""
    kl = p_old * (torch.log(p_old) - torch.log(p)) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return torch.where(positive, (kl <= p_params.divergence_high) | (p <= p_old),
                       (kl <= p_params.divergence_low) | (p >= p_old))


def dppo(inside):
    """The DPPO loss whose trust region is ``inside(p, p_old, A > 0, params)``."""

    def loss_fn(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
        p_params = variant_params(cfg, DppoParams)
        raw = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
        log_rho = raw.clamp(-20.0, 20.0)
        ratio = torch.exp(log_rho)
        weight = ratio.clamp(max=p_params.truncation).detach()  # [B, L]
        a = adv.unsqueeze(-1)  # [B, 1]
        p, p_old = torch.exp(logp.detach()), torch.exp((logp - raw).detach())  # [B, L]: the ratio's denominator
        keep = inside(p, p_old, (a > 0).expand_as(p), p_params).to(logp.dtype)  # [B, L], detached
        pg = -a * weight * logp * keep
        pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
        kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
        metrics = ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 0.0, p_params.truncation)
        metrics["train/dppo_masked_frac"] = masked_mean(1 - keep, mask)
        return pg_loss + kl_loss, {**metrics, **kl_metrics}

    loss_fn.stop_gradient = True  # the weight and the mask are detached
    return loss_fn


LOSSES.register("dppo_tv", params=DppoParams)(dppo(total_variation_mask))
LOSSES.register("dppo_kl", params=DppoParams)(dppo(binary_kl_mask))
