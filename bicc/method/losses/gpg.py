"""GPG: Group Policy Gradient (arXiv 2504.02546), verl's ``gpg`` loss: the plain policy gradient, no ratio, no clip.

    L = -agg_t A_i * log pi_theta(o_it)

Its gradient is REINFORCE's, -A grad log pi per token; pi_old enters only through the advantage (conf/algo/gpg.yaml
pairs it with the ``gpg`` advantage, as the paper does). How we differ: optional KL and the sampler correction's
weight as every loss.
"""

from __future__ import annotations

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import importance_weighted, kl_term, log_ratio, ratio_metrics


@LOSSES.register("gpg")
def gpg_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    pg = -adv.unsqueeze(-1) * logp  # [B, L]
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg).detach().clamp(-20.0, 20.0)
    metrics = ratio_metrics(log_rho, log_rho.exp(), adv, mask, 0.0, float("inf"))  # no clip: fractions 0
    return pg_loss + kl_loss, {**metrics, **kl_metrics}
