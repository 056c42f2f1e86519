"""The rollout engine's sampling log-probs against the trainer's pi_old: their gap, and truncated importance
sampling (TIS), the per-token weight every registered loss takes as ``is_weight``."""

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


def sampler_importance_weights(sampler_logprobs: list[list[float]], old_logp: torch.Tensor, mask: torch.Tensor,
                               cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS) for a rollout engine whose numerics differ from the trainer's:
    the tokens were drawn from pi_sampler, not from the trainer's pi_old, so each token's policy-gradient
    term is weighted by w = min(pi_old / pi_sampler, cap), detached. w = 1 where the engine gave no
    usable log-prob. Returns w [N, L] and its statistics over completion tokens."""
    sampled, valid = sampler_grid(sampler_logprobs, old_logp, mask)
    raw = torch.where(valid, torch.exp(old_logp - sampled), torch.ones_like(old_logp))  # [N, L]
    weight = raw.clamp(max=cap)
    m = mask.bool()
    n = max(1, int(m.sum()))
    return weight, {"rollout/tis_weight_mean": weight[m].sum().item() / n,
                    "rollout/tis_weight_min": weight[m].min().item() if m.any() else 1.0,
                    "rollout/tis_clip_frac": (raw[m] > cap).sum().item() / n}
