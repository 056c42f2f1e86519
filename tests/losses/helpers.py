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


# The six presets' loss settings (conf/algo), and the loss each one uses.
VARIANTS = {
    "grpo": cfg(),
    "dr_grpo": cfg(loss_agg="seq-mean-token-sum-norm", kl_coef=0.01),
    "dapo": cfg(clip_eps_high=0.28, loss_agg="token-mean"),
    "gspo": cfg(clip_eps_low=3e-4, clip_eps_high=4e-4),
    "gmpo": cfg(clip_eps_low=0.4, clip_eps_high=0.4),
    "aspo": cfg(clip_eps_high=0.28, loss_agg="token-mean", dual_clip_c=3.0),
}
LOSS_OF = {"grpo": "grpo", "dr_grpo": "grpo", "dapo": "grpo", "gspo": "gspo", "gmpo": "gmpo", "aspo": "aspo"}
