"""Shared inputs for loss tests."""

import torch

from bicc.config import AlgoConfig
from tests.conftest import CONF, algo_preset


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


def preset(name: str) -> AlgoConfig:
    """conf/algo/<name>.yaml as the loss reads it."""
    return AlgoConfig(**algo_preset(name))


# Every conf/algo preset's loss settings, found on disk (a new variant's YAML joins every test over them), and the
# loss each one uses.
VARIANTS = {path.stem: preset(path.stem) for path in sorted((CONF / "algo").glob("*.yaml"))}
LOSS_OF = {name: c.loss for name, c in VARIANTS.items()}


def split_invariant(variant: str) -> bool:
    """Whether the variant's loss is the same however a step is split (not so for one that selects tokens by the
    statistics of the micro-batch it is given)."""
    from bicc.method.losses import LOSSES

    return not getattr(LOSSES.get(LOSS_OF[variant]), "micro_batch_statistics", False)
