"""The rollout engine's sampling log-probs against the trainer's pi_old: on the trainer's grid, and their gap. Their
correction (importance weights, the per-token weight every registered loss takes as ``is_weight``, and rejection) is
``bicc.method.correction``."""

from __future__ import annotations

import torch


def sampler_grid(sampler_logprobs: list[list[float]], like: torch.Tensor, mask: torch.Tensor):
    """The engine's per-token sampling log-probs on the trainer's [N, L] grid, and where they are usable
    (completion tokens with a finite value; none past the values a row was given)."""
    sampled = torch.zeros_like(like)
    given = torch.zeros(like.shape, dtype=torch.bool, device=like.device)
    for i, lp in enumerate(sampler_logprobs):
        n = min(len(lp), like.shape[1])
        sampled[i, :n] = torch.tensor(lp[:n], dtype=like.dtype)
        given[i, :n] = True
    valid = mask.bool() & given & torch.isfinite(sampled)
    return sampled, valid


def sampler_logprob_diff(sampler_logprobs: list[list[float]], old_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |log-prob of the rollout engine - the trainer's pi_old| over completion tokens: the mismatch
    between sampling and training numerics (0 for HF rollouts from the same module)."""
    sampled, valid = sampler_grid(sampler_logprobs, old_logp, mask)
    return ((sampled - old_logp).abs() * valid).sum().item() / max(1, int(valid.sum()))
