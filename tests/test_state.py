"""The state ``build_rl_state`` builds for a run: the learning-rate schedule spans every optimizer step."""

import math

import torch

from bicc.model.load import build_tiny
from bicc.trainer.state import build_rl_state
from tests.conftest import compose_cfg
from tests.helpers import ARCH


def test_the_cosine_spans_steps_times_epochs_times_minibatches(tmp_path):
    """4 rollouts x 2 epochs x 3 minibatches = 24 optimizer steps: warmup over 2, the cosine reaches its floor at
    step 24 and is halfway at step 13."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = compose_cfg(["train.steps=4", "train.epochs_per_rollout=2", "train.minibatches_per_rollout=3",
                       "optim.warmup_steps=2", "optim.min_lr_ratio=0.1", "optim.lr=1e-4", "rcc=off"])
    s = build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"))
    multiplier = s.scheduler.lr_lambdas[0]
    assert [multiplier(0), multiplier(1)] == [0.5, 1.0]
    assert math.isclose(multiplier(13), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 11 / 22)))  # = 0.55
    assert math.isclose(multiplier(24), 0.1) and multiplier(23) > 0.1 + 1e-6
    assert s.optimizer.param_groups[0]["lr"] == 1e-4 * multiplier(0)


def test_the_state_carries_the_runs_backward_hooks_and_collection_rule(tmp_path):
    """What the step takes from the state rather than the run config: FSDP2's backward hooks from the dist group
    (the update calls them; ``tests/test_update.py`` holds when) and the collection rule from algo, rollout and data."""
    from bicc.machine.ranks import Ranks
    from bicc.rollout.collect import Collection

    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for options, hooks in (([], (False, False)), (["dist.reduce_grads=step"], (True, False)),
                           (["dist.reshard_after_backward=false", "algo=dapo"], (False, True))):
        cfg = compose_cfg(["rcc=off", *options])
        s = build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"))
        assert s.ranks == Ranks(s.dist, *hooks)
        assert s.collection == Collection.of(cfg.algo, cfg.rollout, cfg.data)
        assert s.collection.dynamic_sampling == ("algo=dapo" in options)


def test_a_checkpoints_full_state_dict_is_kept_by_the_rank_that_writes_it(monkeypatch):
    """Under FSDP2 every rank joins each parameter's gather (a collective), but only rank 0, which writes the HF
    weights, keeps the full host copy: the others return nothing (a full bf16 model each, before)."""
    from bicc.machine import distributed

    model, _ = build_tiny(ARCH, seed=0)
    gathered = []
    full = distributed.full_tensor
    monkeypatch.setattr(distributed, "full_tensor", lambda t: gathered.append(t.shape) or full(t))
    kept = distributed.full_state_dict(model, torch.bfloat16, keep=True)
    assert set(kept) == set(model.state_dict()) and all(t.dtype == torch.bfloat16 for t in kept.values())
    joined = len(gathered)
    assert distributed.full_state_dict(model, torch.bfloat16, keep=False) == {}
    assert len(gathered) == 2 * joined  # every gather joined all the same
