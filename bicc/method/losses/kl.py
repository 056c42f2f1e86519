"""KL estimators between the policy and the frozen reference, per token (Schulman's k1/k2/k3).

With log r = log pi_ref - log pi_theta on tokens sampled from pi_theta:
- k1 = -log r                   (unbiased, high variance, can be negative)
- k2 = (log r)^2 / 2            (biased, low variance)
- k3 = r - 1 - log r            (unbiased, non-negative; GRPO's choice)
"""

from __future__ import annotations

import torch

from bicc.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logp - logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = (ref_logp - logp).clamp(-20, 20)  # clamp: exp of a huge log-ratio overflows
    return log_r.exp() - 1 - log_r
