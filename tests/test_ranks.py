"""What a step's ranks share (bicc/machine/ranks.py), by hand on a stand-in process group of 4 ranks whose every
all-reduce multiplies a sum by 4 and returns 5 as the max (another rank runs 5 micro-batches), so that each method
is seen doing its own arithmetic; in one process each is the identity. (Real process groups: tests/test_distributed.py.)"""

import pytest
import torch

from bicc.machine import ranks
from bicc.machine.distributed import Dist
from bicc.method.losses import StepTotals


@pytest.fixture
def four(monkeypatch):
    def all_reduce(t, op=ranks.collective.ReduceOp.SUM):
        t.copy_(t * 4 if op == ranks.collective.ReduceOp.SUM else torch.full_like(t, 5))

    monkeypatch.setattr(ranks.collective, "all_reduce", all_reduce)
    monkeypatch.setattr(ranks, "is_sharded", lambda model: model == "sharded")
    return Dist(rank=1, world=4, strategy="fsdp2", device="cpu")


def test_the_steps_collectives_by_hand(four):
    on = ranks.Ranks(four)
    assert on.totals(StepTotals(tokens=30.0, seqs=3.0, max_len=8.0)) == StepTotals(tokens=120.0, seqs=12.0, max_len=8.0)
    assert on.sum_value(1.5) == 6.0
    torch.testing.assert_close(on.sum(torch.tensor([1.0, 2.0])), torch.tensor([4.0, 8.0], dtype=torch.float64))
    assert on.loss_scale == 4.0  # FSDP2 averages gradients over the 4 ranks; the global totals need their sum
    assert ranks.Ranks(Dist(rank=1, world=4, strategy="ddp", device="cpu")).loss_scale == 1.0
    plan = [torch.tensor([0, 1]), torch.tensor([2])]
    padded = on.micro_batches(plan, "sharded")  # another rank runs 5 micro-batches: this one adds 3 empty forwards
    assert [p.tolist() for p in padded] == [[0, 1], [2], [], [], []]
    assert on.micro_batches(plan, "unsharded") == plan  # DDP's forwards are no collectives


def test_one_process_is_the_identity():
    on = ranks.Ranks()
    totals = StepTotals(tokens=30.0, seqs=3.0, max_len=8.0)
    assert on.totals(totals) is totals and on.sum_value(1.5) == 1.5 and on.loss_scale == 1.0
    plan = [torch.tensor([0])]
    assert on.micro_batches(plan, "sharded") is plan


def test_the_micro_batches_a_step_runs_are_those_every_rank_runs(four):
    """``bicc.kernels.batching.micro_batches`` asks the ranks: the no-grad passes and the update run as many forwards
    on every rank."""
    from bicc.kernels.batching import micro_batches

    class Rows:  # three rows of 4 tokens, one padded row per output
        lengths, kv = torch.tensor([[2, 2], [2, 2], [2, 2]]), False

    got = micro_batches(torch.arange(3), Rows, 2, 0, "sharded", ranks.Ranks(four))
    assert [p.tolist() for p in got] == [[0, 1], [2], [], [], []]
