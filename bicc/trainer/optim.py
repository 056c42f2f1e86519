"""AdamW and a linear-warmup cosine schedule (the paper: warmup 100 of 3000 steps)."""

from __future__ import annotations

import math

import torch


def build_optimizer(model, lr: float, betas, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, fused (one kernel over every parameter, on CPU and CUDA, FSDP2's
    DTensors included) where torch has it for their dtype and device: the per-parameter loop launched ~30 ops
    per parameter tensor each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in FUSED_DTYPES for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused or None)


FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """LR multiplier: linear 0->1 over warmup, then cosine 1->min_lr_ratio at total_steps."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
