"""OPO: On-Policy RL with Optimal reward baseline (arXiv 2505.23585), verl's ``opo`` estimator.

The baseline is the group's rewards weighted by the outputs' lengths, the variance-minimising baseline when a
sequence's gradient norm grows with its length:

    A_i = r_i - sum_j |o_j| r_j / sum_j |o_j|

no std normalisation; |o_j| is the output's token count (``reads = ("lengths",)``). Under BiCC the lengths are the
outputs' own, not their contexts': the update's numerator conditions each output on x^c, but what it sums over is
the output's tokens (docs/method.md).
"""

from __future__ import annotations

from bicc.method.advantages import ADVANTAGES, _degenerate_share, group_stats


@ADVANTAGES.register("opo")
def opo_advantage(rewards, group_ids, delta, cfg, lengths=None):
    if lengths is None:
        raise ValueError("advantage 'opo' needs each output's length (lengths=[N]: the step gives it, opo_advantage.reads)")
    _, std, counts = group_stats(rewards, group_ids)
    weighted, _, _ = group_stats(lengths * rewards.double(), group_ids)  # group means: the sums over G cancel
    total, _, _ = group_stats(lengths, group_ids)
    adv = rewards.double() - weighted / total.clamp(min=1e-12)
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts)}


opo_advantage.reads = ("lengths",)
