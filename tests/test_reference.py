"""``bicc.step.rl_step`` (packed or KV-reused contexts, micro-batches, the step plan, delta from the update's own
forward) against ``bicc.reference.algorithm1_step`` (the paper's Algorithm 1, one sequence per forward) on the
same rollout, under the published ``bicc=on rcc=on``. Both take one plain SGD step with clipping out of reach, so
the weights after it are the gradient itself: a wrong context, ratio, delta, advantage or normaliser moves them
differently (Adam's first step, about lr x sign(g), would hide every error of scale)."""

import copy

import pytest
import torch

from bicc import step as step_module
from bicc.models import build_tiny
from bicc.optim import warmup_cosine
from bicc.reference import algorithm1_step
from bicc.state import build_rl_state
from bicc.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import ARCH, CoinTask

LR = 0.5


def sgd(state):
    """Replace the state's AdamW by plain SGD at a constant LR."""
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=LR)
    state.scheduler = warmup_cosine(state.optimizer, 0, 10, 1.0)


# GRPO over packing (KV reuse, a packed mask, one row per output) x delta (from the update's forward or a
# no-grad pass) x micro-batches (all rows at once, or 5 rows: uneven splits); DAPO's loss and sampling on one
CASES = [("grpo", packing, from_update, micro) for packing in ("packing_impl=kv", "packing_impl=mask", "packing=false")
         for from_update in (True, False) for micro in (64, 5)] + [("dapo", "packing_impl=kv", True, 5)]


@pytest.mark.parametrize(("algo", "packing", "delta_from_update", "micro_batch"), CASES)
def test_rl_step_is_algorithm1(algo, packing, delta_from_update, micro_batch, tmp_path, monkeypatch):
    # pi_ref (the initial policy) and pi_old (a policy some steps on, here the initial one perturbed) differ, as
    # they do after the first step: a delta or KL read against the wrong one changes the update
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path / "init")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    # 32-token outputs: a 12-token context budget, above min_attempt_tokens 4, so mixed groups are conditioned
    cfg = compose_cfg([f"algo={algo}", "bicc=on", "rcc=on", f"bicc.{packing}", f"rcc.delta_from_update={delta_from_update}",
                       f"train.micro_batch_size={micro_batch}", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
                       "rollout.group_size=4", "rollout.max_new_tokens=32", "bicc.min_attempt_tokens=4",
                       "rcc.diag_every=0", "optim.warmup_steps=0", "optim.clip_grad=1e9"])
    s = build_rl_state(cfg, str(tmp_path / "policy"), str(tmp_path / "init"), torch.device("cpu"))
    ref_model = copy.deepcopy(s.ref_model)
    s.task = CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout

    def recording(*args, **kwargs):  # the rollout rl_step samples, kept for the reference
        rollouts.append(collect(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(step_module, "collect_rollout", recording)
    metrics, _ = rl_step(s, cfg)
    ro = rollouts[0]
    assert 0 < metrics["bicc/samples_conditioned_share"]  # contexts were built and read
    assert ro.rewards.std() > 0

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = algorithm1_step(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), tok,
                          ro, cfg, s.task.answer_anchors, s.end_ids)
    assert out["advantages"].abs().sum() > 0
    moved = [(p - b).abs().max().item() for p, b in zip(reference.parameters(), before.parameters())]
    assert max(moved) > 1e-3  # the step moved the weights: the comparison below is not of two no-ops
    for (name, p), q in zip(s.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-6, rtol=1e-4, msg=name)
