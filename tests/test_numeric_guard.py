"""A non-finite loss or gradient skips the optimizer step, counts it, and leaves weights and Adam state
untouched; a finite step resets the streak."""

import torch

from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import QueryRows
from bicc.trainer.update import update_policy
from tests.helpers import guard_setup


def test_nonfinite_advantage_skips_the_step_and_finite_resets_the_streak():
    state, batch, cfg = guard_setup()
    plain = QueryRows(batch)
    old = logprobs_no_grad(state.model, plain, 4, 4, 1.0)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    bad = torch.tensor([1.0, float("nan"), -1.0, 0.5])
    for _ in range(2):
        metrics, _ = update_policy(state, batch, plain, old, None, bad, cfg, 0)
        assert metrics["train/nonfinite_skip"] == 1.0
    assert state.nonfinite_skips == 2 and state.nonfinite_streak == 2
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert state.optimizer.state_dict()["state"] == {} and state.scheduler.last_epoch == 0
    metrics, _ = update_policy(state, batch, plain, old, None, torch.tensor([1.0, -1.0, -1.0, 1.0]), cfg, 1)
    assert metrics["train/nonfinite_skip"] == 0.0
    assert state.nonfinite_skips == 2 and state.nonfinite_streak == 0
    assert any(not torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert state.trainer_state()["nonfinite_skips"] == 2
