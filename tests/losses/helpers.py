"""Shared inputs for loss tests."""

from dataclasses import dataclass, replace

import torch


@dataclass
class AlgoCfg:
    """The algo fields a loss reads, with GRPO's values; tests override with ``replace``."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 0.0
    ratio_denominator: str = "old"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "seq-mean-token-mean"


def cfg(**overrides) -> AlgoCfg:
    return replace(AlgoCfg(), **overrides)


def random_case(seed: int, n: int = 8, length: int = 6, scale: float = 0.3):
    """Random log-probs (float64) with ragged masks, and advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.randn(n, length, generator=gen, dtype=torch.float64) * scale
    old = torch.randn(n, length, generator=gen, dtype=torch.float64) * scale
    ref = torch.randn(n, length, generator=gen, dtype=torch.float64) * scale
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    return logp, old, ref, adv, mask
