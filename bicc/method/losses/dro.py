"""DRO: Direct Reward Optimization, verl's ``dro`` loss: the policy gradient with a quadratic penalty on the log-ratio.

    L = -agg_t (A_i * log pi_theta(o_it) - beta / 2 * (log pi_theta(o_it) - log pi_old(o_it))^2)

so each token's gradient is -(A - beta log rho) grad log pi: the pull of the advantage shrinks as the token's
probability moves away from pi_old, with no hard clip. beta is ``algo.params.beta`` (verl's
``policy_loss.dro_beta``, which it requires set; 0.1 here). How we differ: optional KL and the sampler correction's
weight as every loss; ``ratio_denominator=ref`` penalises the distance to pi_ref.
"""

from __future__ import annotations

from dataclasses import dataclass

from bicc.config.fields import need
from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import importance_weighted, kl_term, log_ratio, ratio_metrics, variant_params


@dataclass(frozen=True)
class DroParams:
    """The quadratic penalty's coefficient on the log-ratio."""

    beta: float = 0.1

    def check(self) -> None:
        need(self.beta > 0, "algo.params.beta", f"must be > 0, got {self.beta}")


@LOSSES.register("dro", params=DroParams)
def dro_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    beta = variant_params(cfg, DroParams).beta
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    pg = -(adv.unsqueeze(-1) * logp - 0.5 * beta * log_rho.square())  # [B, L]
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    clamped = log_rho.detach().clamp(-20.0, 20.0)
    metrics = ratio_metrics(clamped, clamped.exp(), adv, mask, 0.0, float("inf"))  # no clip: fractions 0
    return pg_loss + kl_loss, {**metrics, **kl_metrics}


dro_loss.penalty_off = {"beta": 0.0}  # the quadratic penalty is no policy-gradient term: gone at beta = 0
