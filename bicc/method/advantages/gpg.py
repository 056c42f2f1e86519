"""GPG: Group Policy Gradient (arXiv 2504.02546), verl's ``gpg`` estimator.

The group's mean is removed and the result scaled by the step's share of outputs with a reward:

    A_i = alpha * (r_i - mean r) / f_norm,   alpha = N / #{j : r_j != 0}

N the step's outputs and the count over them (every rank's: ``reads = ("step_sum",)``); f_norm = 1, verl's. No std
normalisation. alpha corrects for the groups whose rewards are all zero: they add nothing to the gradient but count
in the loss's normaliser.
"""

from __future__ import annotations

import torch

from bicc.method.advantages import ADVANTAGES, _degenerate_share, group_stats


@ADVANTAGES.register("gpg")
def gpg_advantage(rewards, group_ids, delta, cfg, step_sum=None):
    if step_sum is None:
        raise ValueError("advantage 'gpg' needs the step's sums (step_sum=: the step gives it, gpg_advantage.reads)")
    mean, std, counts = group_stats(rewards, group_ids)
    outputs, rewarded = step_sum(torch.tensor([float(len(rewards)), float((rewards != 0).sum())],
                                              dtype=torch.float64)).tolist()
    alpha = outputs / max(rewarded, 1.0)
    adv = alpha * (rewards.double() - mean)
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts), "train/gpg_alpha": alpha}


gpg_advantage.reads = ("step_sum",)
