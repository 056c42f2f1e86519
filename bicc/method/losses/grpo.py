"""The token-level clipped surrogate of GRPO (Shao et al. 2024; the BiCC paper's eq. 4), which DAPO and
Dr.GRPO also use with other knobs (conf/algo/dapo.yaml, conf/algo/dr_grpo.yaml):

    L = -agg_t min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta * agg_t KL_it

rho_it = pi_theta / pi_old per token (or / pi_ref with ``ratio_denominator=ref``); agg = ``loss_agg``.

- GRPO: eps 0.2/0.2, seq-mean-token-mean, std-normalised advantage.
- DAPO (Yu et al. 2025): clip-higher eps 0.2/0.28, token-mean over the step; dynamic sampling and
  overlong shaping are ``bicc.method.dapo`` (``algo.dynamic_sampling``, ``algo.overlong_buffer_share``).
- Dr.GRPO (Liu et al. 2025): mean-centred advantage, seq-mean-token-sum-norm, KL beta 0.01.

How we differ from the papers: (1) eps_low and eps_high are always separate knobs; (2) the KL term is
optional (beta = 0 unless the algo config sets it); (3) dual clip for A < 0 is an option (off by default).
"""

from __future__ import annotations

import torch

from bicc.method.losses import LOSSES
from bicc.method.losses.agg import StepTotals, aggregate
from bicc.method.losses.common import dual_clip, importance_weighted, kl_term, log_ratio, ratio_metrics


@LOSSES.register("grpo")
def grpo_loss(logp, old_logp, ref_logp, adv, mask, cfg, totals: StepTotals, is_weight=None):
    log_rho = log_ratio(logp, old_logp, ref_logp, cfg)  # [B, L]
    ratio = torch.exp(log_rho)  # [B, L]
    a = adv.unsqueeze(-1)  # [B, 1]
    pg_unclipped = -a * ratio
    pg_clipped = -a * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    pg = dual_clip(torch.maximum(pg_unclipped, pg_clipped), adv, cfg)  # [B, L]: max of losses = min of objectives
    pg_loss = aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals)
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, cfg, totals)
    metrics = {**ratio_metrics(log_rho.detach(), ratio.detach(), adv, mask, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high),
               **kl_metrics}
    return pg_loss + kl_loss, metrics
