"""The seed paper's contrastive reformulation of GRPO, checked on random inputs.

With binary rewards, population std and sequence-level ratios rho_i, GRPO's objective for one query is
    J = sigma_q * (mean_{O+} min(rho, 1+eps) - mean_{O-} max(rho, 1-eps))
      = sum_i sum_j sigma_q / (G+ G-) * (C_up(rho_i+) - C_low(rho_j-)).
Derivation: A = (1-p)/sigma for r=1 and -p/sigma for r=0 (p = G+/G, sigma^2 = p(1-p)); min(rho A, clip A)
is A*C_up(rho) for A>0 and A*C_low(rho) for A<0; (1/G) sum gives (1-p)p/sigma = sigma per side.
"""

import pytest
import torch

from bicc.method.advantages import ADVANTAGES
from bicc.method.losses import LOSSES, StepTotals
from tests.losses.helpers import cfg


class AdvCfg:
    adv_eps = 0.0


@pytest.mark.parametrize("seed", range(10))
def test_grpo_equals_contrastive_and_pairwise_forms(seed):
    gen = torch.Generator().manual_seed(seed)
    num_queries, G, length, eps = 3, 8, 7, 0.2
    rewards = torch.randint(0, 2, (num_queries, G), generator=gen).double()
    rewards[:, 0], rewards[:, 1] = 1, 0  # both partitions non-empty in every group
    rho = torch.exp(torch.randn(num_queries, G, generator=gen, dtype=torch.float64) * 0.4)
    lengths = torch.randint(1, length + 1, (num_queries * G,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    old = torch.randn(num_queries * G, length, generator=gen, dtype=torch.float64)
    logp = old + rho.log().reshape(-1, 1)  # the same ratio at every token of a sequence

    group_ids = torch.arange(num_queries).repeat_interleave(G)
    adv, _ = ADVANTAGES.get("grpo")(rewards.flatten(), group_ids, None, AdvCfg)
    loss, _ = LOSSES.get("grpo")(logp, old, None, adv, mask, cfg(clip_eps_low=eps, clip_eps_high=eps),
                                 StepTotals.of(mask, length))
    grpo_objective = -loss.item()

    contrastive, pairwise = 0.0, 0.0
    for q in range(num_queries):
        pos, neg = rho[q][rewards[q] == 1], rho[q][rewards[q] == 0]
        sigma = rewards[q].std(unbiased=False)
        c_up, c_low = pos.clamp(max=1 + eps), neg.clamp(min=1 - eps)
        contrastive += (sigma * (c_up.mean() - c_low.mean())).item() / num_queries
        pairs = c_up[:, None] - c_low[None, :]  # [G+, G-]
        pairwise += (sigma / (len(pos) * len(neg)) * pairs.sum()).item() / num_queries
    assert grpo_objective == pytest.approx(contrastive, abs=1e-6)
    assert grpo_objective == pytest.approx(pairwise, abs=1e-6)
