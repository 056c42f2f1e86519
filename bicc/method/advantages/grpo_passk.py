"""Pass@k training (arXiv 2503.19595), verl's ``grpo_passk`` estimator: only the best output of a group learns.

    A_best = (r_max - r_second) / (std r + eps),   A_i = 0 for every other output

with std the group's sample std (unbiased, as ``torch.std``: verl's) and eps ``algo.adv_eps``; verl's default
``norm_adv_by_std_in_grpo=true``, the only form here. A group whose top two rewards are equal learns nothing; where
several outputs hold the top reward, ``torch.topk`` picks which one carries the (zero) margin.
"""

from __future__ import annotations

import torch

from bicc.method.advantages import ADVANTAGES


@ADVANTAGES.register("grpo_passk")
def grpo_passk_advantage(rewards, group_ids, delta, cfg):
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    margins = []
    for g in torch.unique(group_ids):
        rows = (group_ids == g).nonzero().flatten()
        if len(rows) < 2:
            raise ValueError(f"advantage 'grpo_passk' needs >= 2 samples per group; group {int(g)} has {len(rows)}")
        group = rewards[rows].double()
        top, at = torch.topk(group, 2)
        adv[rows[at[0]]] = (top[0] - top[1]) / (group.std() + cfg.adv_eps)
        margins.append(float(top[0] - top[1] > 0))
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": 1 - sum(margins) / len(margins)}
