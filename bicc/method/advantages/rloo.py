"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., arXiv 2402.14740), verl's ``rloo`` estimator.

Each output's baseline is the mean reward of the other outputs of its group:

    A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j = G / (G - 1) * (r_i - mean r)

no std normalisation. (verl gives a group of one output its own reward; here every group needs two, as every
estimator's.)
"""

from __future__ import annotations

from bicc.method.advantages import ADVANTAGES, _degenerate_share, group_stats


@ADVANTAGES.register("rloo")
def rloo_advantage(rewards, group_ids, delta, cfg):
    mean, std, counts = group_stats(rewards, group_ids)
    adv = (rewards.double() - mean) * counts / (counts - 1)
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts)}
