"""What the ranks of one RL step share, behind one object the machine layer builds into the state (``Ranks.of``) and
the step calls: the loss's normalisers and any statistic over the whole step summed over ranks, the micro-batch count
every rank runs (with the no-op forwards that keep a rank holding fewer rows in step), FSDP2's hooks before each
backward, DDP's gradient sum and the loss's scale. In one process each is the identity. Every tensor a collective
reduces is on ``Dist.device`` (NCCL has no CPU path)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as collective

from bicc.machine.distributed import Dist, is_sharded


@dataclass(frozen=True)
class Ranks:
    dist: Dist = field(default_factory=Dist)
    reduce_once: bool = False  # dist.reduce_grads=step: gradients reduce-scattered in a minibatch's last backward
    keep_gathered: bool = False  # dist.reshard_after_backward=false: gathered weights freed in its last backward only

    @classmethod
    def of(cls, d: Dist, dist_cfg) -> "Ranks":
        return cls(d, dist_cfg.reduce_grads == "step", not dist_cfg.reshard_after_backward)

    def _reduced(self, values: list, dtype, op=collective.ReduceOp.SUM) -> list:
        t = torch.tensor(values, dtype=dtype, device=self.dist.device)
        collective.all_reduce(t, op=op)
        return t.tolist()

    def totals(self, totals):
        """``StepTotals`` (tokens, sequences) over every rank's rows: the loss's normalisers (``max_len`` is a
        setting, not a count)."""
        if not self.dist.enabled:
            return totals
        tokens, seqs = self._reduced([totals.tokens, totals.seqs], torch.float64)
        return type(totals)(tokens=tokens, seqs=seqs, max_len=totals.max_len)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor summed over ranks: what a statistic over the whole step's outputs needs when each rank holds
        its shards (``bicc.method.advantages``, ``reads``)."""
        if not self.dist.enabled:
            return t
        out = t.to(self.dist.device, torch.float64)
        collective.all_reduce(out)
        return out.cpu()

    def sum_value(self, value: float) -> float:
        return self._reduced([value], torch.float64)[0] if self.dist.enabled else value

    @property
    def loss_scale(self) -> float:
        """FSDP2 averages gradients over ranks; losses normalised by the global totals need their sum."""
        return float(self.dist.world) if self.dist.enabled and self.dist.strategy == "fsdp2" else 1.0

    def micro_batches(self, plan: list[torch.Tensor], model) -> list[torch.Tensor]:
        """``plan`` with empty micro-batches up to the largest count of any rank when the model is sharded: under
        FSDP2 every forward and backward is a collective, and ranks hold different numbers of rows (DAPO's dynamic
        sampling)."""
        if not (self.dist.enabled and is_sharded(model)):
            return plan
        most = int(self._reduced([len(plan)], torch.int64, collective.ReduceOp.MAX)[0])
        return plan + [torch.zeros(0, dtype=torch.long)] * (most - len(plan))

    def no_op(self, model, inputs, temperature: float) -> None:
        """An empty micro-batch's forward (and, with grad enabled, backward) of one row, contributing nothing: the
        other ranks' forward and backward are collectives."""
        logp = inputs.logprobs(model, torch.arange(0, 1), temperature)[0]
        if torch.is_grad_enabled():
            (logp.sum() * 0.0).backward()

    def before_backward(self, model, last: bool) -> None:
        """FSDP2's hooks before a backward of ``model`` (``last``: its minibatch's last): with ``dist.reduce_grads=step``
        the gradients are reduced, and with ``dist.reshard_after_backward=false`` the gathered weights freed, in the
        minibatch's last backward only (kept gathered past it, they would be the weights before its optimizer step).
        Unsharded, or with FSDP2's defaults, nothing is touched."""
        if is_sharded(model) and self.reduce_once:
            model.set_requires_gradient_sync(last)
        if is_sharded(model) and self.keep_gathered:
            model.set_reshard_after_backward(last)

    def sync_gradients(self, model, bucket_numel: int = 1 << 24) -> None:
        """DDP: every gradient summed over ranks, in flat buckets of at most ``bucket_numel`` elements (FSDP2 reduces
        inside backward)."""
        if not self.dist.enabled or self.dist.strategy != "ddp":
            return
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in (p for p in model.parameters() if p.requires_grad):
            if p.grad is None:  # unused on this rank in this step: contributes zero, but must join the sum
                p.grad = torch.zeros_like(p)
            if buckets[-1] and size + p.numel() > bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(p.grad)
            size += p.numel()
        for bucket in (b for b in buckets if b):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            collective.all_reduce(flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
