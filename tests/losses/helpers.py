"""Shared inputs for loss tests."""

import torch

from bicc.config import AlgoConfig


def cfg(**overrides) -> AlgoConfig:
    """The algo config a loss reads, GRPO's values unless overridden."""
    fields = dict(name="test", loss="grpo", advantage="grpo", loss_agg="seq-mean-token-mean")
    return AlgoConfig(**{**fields, **overrides})


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
