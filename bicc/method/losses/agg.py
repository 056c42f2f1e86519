"""Loss aggregation over tokens and sequences, with the optimizer step's GLOBAL normaliser.

An optimizer step may be split into micro-batches (and, later, ranks). Each micro-batch contributes
its share of the step's loss, normalised by counts over the WHOLE step (``StepTotals``), so the
accumulated gradient is identical however the step is split. Normalising by a micro-batch's own
token count instead would weight tokens unequally across micro-batches.

Modes, for per-token values x_it, mask m_it, lengths T_i = sum_t m_it, over the step's S sequences:
- token-mean:              sum_it m x / sum_it m                          (DAPO)
- token-sum:               sum_it m x                                     (verl's token-sum: no normaliser)
- seq-mean-token-mean:     (1/S) sum_i (1/T_i) sum_t m x                  (GRPO, paper eq. 4)
- seq-mean-token-sum:      (1/S) sum_i sum_t m x
- seq-mean-token-sum-norm: sum_it m x / (S * L_max), L_max a constant    (Dr.GRPO)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bicc.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


@dataclass(frozen=True)
class StepTotals:
    """Counts over the whole optimizer step (all micro-batches and ranks)."""

    tokens: float
    seqs: float
    max_len: float

    @staticmethod
    def of(mask: torch.Tensor, max_len: int) -> "StepTotals":
        return StepTotals(tokens=float(mask.sum()), seqs=float(mask.shape[0]), max_len=float(max_len))


@AGGREGATIONS.register("token-mean")
def token_mean(x, mask, totals: StepTotals):
    return (x * mask).sum() / totals.tokens


@AGGREGATIONS.register("token-sum")
def token_sum(x, mask, totals: StepTotals):
    return (x * mask).sum()


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(x, mask, totals: StepTotals):
    per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    return per_seq.sum() / totals.seqs


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(x, mask, totals: StepTotals):
    return (x * mask).sum() / totals.seqs


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(x, mask, totals: StepTotals):
    # two divisions, not one by the product: compiled on torch 2.11, a product of the two floats made Dynamo specialise
    # on their values, a new graph for every other step total
    return (x * mask).sum() / totals.seqs / totals.max_len


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str, totals: StepTotals) -> torch.Tensor:
    return AGGREGATIONS.get(mode)(x, mask.to(x.dtype), totals)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked entries, for diagnostics."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)
