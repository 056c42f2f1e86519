"""REINFORCE++ with a group baseline (arXiv 2501.03262), verl's ``reinforce_plus_plus_baseline`` estimator.

The group's mean reward is removed, then the result is whitened over every token of the step's outputs:

    a_i = r_i - mean r,   A_i = (a_i - mu) / sqrt(var + 1e-8)

mu and var the mean and unbiased variance of a over the step's tokens (output i counts |o_i| times), as verl's
``masked_whiten`` over the batch. The sums run over every rank's outputs (``reads = ("step_sum",)``), so two
processes give what one gives.
"""

from __future__ import annotations

import torch

from bicc.method.advantages import ADVANTAGES, _degenerate_share, group_stats


@ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(rewards, group_ids, delta, cfg, lengths=None, step_sum=None):
    if lengths is None or step_sum is None:
        raise ValueError("advantage 'reinforce_plus_plus_baseline' needs each output's length and the step's sums "
                         "(lengths=, step_sum=: the step gives them, reads)")
    mean, std, counts = group_stats(rewards, group_ids)
    centred = rewards.double() - mean
    tokens, first, second = step_sum(torch.stack([lengths.sum(), (lengths * centred).sum(),
                                                  (lengths * centred**2).sum()])).tolist()
    if tokens < 2:
        raise ValueError("advantage 'reinforce_plus_plus_baseline': the step has fewer than 2 output tokens to whiten over")
    mu = first / tokens
    var = (second / tokens - mu**2) * tokens / (tokens - 1)
    adv = (centred - mu) / (var + 1e-8) ** 0.5
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts)}


reinforce_plus_plus_baseline_advantage.reads = ("lengths", "step_sum")
