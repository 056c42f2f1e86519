"""What the ranks of one RL step share, behind one object the machine layer builds (``Ranks.of``) and hands to the
step: the loss's normalisers and any statistic over the whole step summed over ranks, the micro-batch count every
rank runs (with the no-op forwards that keep a rank holding fewer rows in step), FSDP2's hooks before each backward,
the gradients' sum and the loss's scale. In one process each is the identity, and the step reads the same."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bicc.machine.distributed import (
    BackwardHooks,
    Dist,
    all_reduce_sum,
    global_max,
    global_totals,
    is_sharded,
    loss_scale,
    summed_over_ranks,
    sync_gradients,
)


@dataclass(frozen=True)
class Ranks:
    dist: Dist = field(default_factory=Dist)
    hooks: BackwardHooks = field(default_factory=BackwardHooks)  # FSDP2's, from the dist group

    @classmethod
    def of(cls, d: Dist, dist_cfg) -> "Ranks":
        return cls(d, BackwardHooks.of(dist_cfg))

    def totals(self, totals):
        """``StepTotals`` over every rank's rows: the loss's normalisers."""
        return global_totals(totals, self.dist)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor summed over ranks (what an advantage reading the whole step's outputs needs)."""
        return summed_over_ranks(self.dist)(t)

    def sum_value(self, value: float) -> float:
        return all_reduce_sum(value, self.dist)

    @property
    def loss_scale(self) -> float:
        """FSDP2 averages gradients over ranks; losses normalised by the global totals need their sum."""
        return loss_scale(self.dist)

    def micro_batches(self, plan: list[torch.Tensor], model) -> list[torch.Tensor]:
        """``plan`` with empty micro-batches up to the largest count of any rank when the model is sharded: under
        FSDP2 every forward and backward is a collective, and ranks hold different numbers of rows (DAPO's dynamic
        sampling)."""
        if self.dist.enabled and is_sharded(model):
            empty = plan[0][:0] if plan else torch.zeros(0, dtype=torch.long)
            plan = plan + [empty] * (global_max(len(plan), self.dist) - len(plan))
        return plan

    def no_op(self, model, inputs, temperature: float) -> None:
        """An empty micro-batch's forward (and, with grad enabled, backward) of one row, contributing nothing: the
        other ranks' forward and backward are collectives."""
        logp = inputs.logprobs(model, torch.arange(0, 1), temperature)[0]
        if torch.is_grad_enabled():
            (logp.sum() * 0.0).backward()

    def before_backward(self, model, last: bool) -> None:
        """FSDP2's hooks before a backward; ``last``: the minibatch's last."""
        self.hooks.before(model, last)

    def sync_gradients(self, model) -> None:
        """DDP: every gradient summed over ranks (FSDP2 reduces inside backward)."""
        sync_gradients(model, self.dist)
