"""DAPO's two changes to what a step trains on (Yu et al. 2025), besides its loss settings (conf/algo/dapo.yaml):

- **overlong shaping**: a soft penalty on outputs that run into the length limit, added to the reward;
- **dynamic sampling**: only groups whose outputs are neither all right nor all wrong are kept, and more queries are
  drawn until the step is full (``bicc.rollout.collect`` draws them; the rule is here).
"""

from __future__ import annotations

import torch


def overlong_buffer_tokens(algo_cfg, max_new_tokens: int) -> int:
    """L_cache in tokens: ``algo.overlong_buffer_share`` of the response length limit."""
    return round(algo_cfg.overlong_buffer_share * max_new_tokens)


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float):
    """The soft overlong punishment: 0 up to max_len - buffer, then falling linearly to -penalty at max_len:
    min(0, -(len - (max_len - buffer)) / buffer) * penalty. ``buffer = 0`` gives zeros."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    return (-(lengths.double() - (max_len - buffer)) / buffer).clamp(max=0) * penalty


def mixed_groups(correct: torch.Tensor) -> torch.Tensor:
    """[groups] the groups of ``correct`` [groups, G] that dynamic sampling keeps: neither all right nor all wrong."""
    return correct.max(1).values > correct.min(1).values
