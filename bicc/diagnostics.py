"""Diagnostics computed from a step's tensors without changing the update."""

from __future__ import annotations

import torch


@torch.no_grad()
def conditioning_weights(log_w: torch.Tensor, conditioned: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """BiCC's conditioning weight w_i = pi_theta(o_i | x^c) / pi_theta(o_i | q), from the summed log-ratio
    of the step's first pass (theta = theta_old there), over conditioned samples split by reward. The
    paper's case study expects w > 1 on correct and w < 1 on incorrect outputs. Reported as the mean of
    log w (w itself is a product over tokens and overflows) and the share with w > 1."""
    metrics = {}
    for name, side in (("pos", correct == 1), ("neg", correct != 1)):
        sel = conditioned & side
        if sel.any():
            metrics[f"bicc/log_w_{name}"] = log_w[sel].mean().item()
            metrics[f"bicc/w_gt1_share_{name}"] = (log_w[sel] > 0).float().mean().item()
    return metrics
