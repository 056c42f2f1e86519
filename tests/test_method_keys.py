"""The method's config groups (conf/algo, conf/bicc, conf/rcc) hold mathematics only: every key of their schemas
changes what a step computes. Each key is set to another value on the same recorded rollout, and one plain SGD
step lands elsewhere; the speed and memory choices (train.context_packing*) land on the
same weights. A key added to a method group without a row here fails the first test."""

import dataclasses

import pytest
import torch

from bicc.config import AlgoConfig, BiccConfig, RccConfig, StepConfig
from bicc.rollout.collect import Collection
from bicc.trainer.state import build_rl_state, peak_lr
from bicc.trainer.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import COMBINATION_CFG, CoinTask, ReplayEngine, recorded_rollout, sgd

# The paper's method with a KL term, so that every switch has something to act on.
BASE = [*COMBINATION_CFG, "algo=grpo", "bicc=on", "rcc=on", "algo.kl_coef=0.05"]
# key: (what it is set to, overrides it needs to act, e.g. the variant's own advantage for the advantage's keys)
CHANGES = {
    "algo.loss": ("gspo", []),
    "algo.advantage": ("mean_centered", ["rcc=off"]),
    "algo.loss_agg": ("token-mean", []),
    "algo.clip_eps_low": (0.01, []),
    "algo.clip_eps_high": (0.01, []),
    "algo.dual_clip_c": (1.01, []),
    "algo.ratio_denominator": ("ref", []),
    "algo.kl_coef": (0.5, []),
    "algo.kl_estimator": ("k1", []),
    "algo.adv_eps": (1.0, ["rcc=off"]),
    "algo.overlong_buffer_share": (0.5, []),
    "algo.overlong_penalty": (0.25, ["algo.overlong_buffer_share=0.5"]),
    "algo.partition": ("reward", ["algo.overlong_buffer_share=0.1"]),  # right outputs of 32 tokens fall to 0
    "bicc.enabled": (False, []),
    "bicc.mode": ("paired", []),
    "bicc.paired_k": (2, ["bicc.mode=paired"]),
    "bicc.context_ratio": (0.2, []),
    "bicc.max_tokens": (16, []),
    "bicc.truncate": ("head", []),
    "bicc.min_attempt_tokens": (8, []),
    "bicc.reward_threshold": (1.5, []),
    "bicc.preamble": ("\nSee:", []),
    "bicc.attempt_header": ("\n#{i}\n", []),
    "bicc.elision": ("~", []),
    "bicc.old_on_context": (True, []),
    "bicc.lr_scale": (0.5, []),
    "bicc.context_in": ("denominator", []),
    "bicc.layout": ("released", []),
    "bicc.separator_id": (3, ["bicc.layout=released"]),
    "rcc.enabled": (False, []),
    "rcc.delta": ("mean", []),
    "rcc.delta_context": ("xc", []),
    "rcc.scale": ("std", ["rcc=on"]),
}
# Keys that change which samples a step collects (DAPO's dynamic sampling): held on the collection's own choice.
COLLECTION = {"algo.dynamic_sampling": (True, []), "algo.max_sampling_rounds": (1, ["algo.dynamic_sampling=true"])}
# The variant's name: a label for run names and logs; its own hyperparameters, held by its own tests
# (tests/losses/test_<variant>.py).
LABELS = {"algo.name", "algo.params"}
# Speed and memory choices: the same step to float rounding.
SAME = ["train.context_packing=false", "train.context_packing_impl=mask",
        "train.context_packing_impl=mask train.max_packed_len=40"]


def test_every_key_of_the_method_groups_has_a_row():
    keys = {f"{group}.{f.name}" for group, schema in (("algo", AlgoConfig), ("bicc", BiccConfig), ("rcc", RccConfig))
            for f in dataclasses.fields(schema)}
    assert keys == set(CHANGES) | set(COLLECTION) | LABELS


def one_step(recorded, overrides):
    """The policy after one SGD step (lr times bicc.lr_scale under BiCC) on the recorded rollout."""
    tmp, out, _, _ = recorded
    cfg = compose_cfg([*BASE, *overrides])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    s.engine, s.plan = ReplayEngine(out), None
    s.task = CoinTask(s.task)
    sgd(s)
    for group in s.optimizer.param_groups:  # the run's peak lr over optim.lr: bicc.lr_scale under BiCC
        group["lr"] *= peak_lr(cfg.optim, cfg.bicc) / cfg.optim.lr
    rl_step(s, StepConfig.of(cfg))
    return torch.cat([p.detach().flatten() for p in s.model.parameters()])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return recorded_rollout(tmp_path_factory.mktemp("method_keys"))


@pytest.fixture(scope="module")
def base_step(recorded):
    return one_step(recorded, [])


@pytest.mark.parametrize("key", CHANGES)
def test_each_key_changes_the_step(key, recorded, base_step):
    value, needs = CHANGES[key]
    base = base_step if not needs else one_step(recorded, needs)
    changed = one_step(recorded, [*needs, f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"])
    assert (changed - base).abs().max() > 1e-6, f"{key}={value} left the step where it was"


@pytest.mark.parametrize("key", COLLECTION)
def test_each_sampling_key_changes_what_is_collected(key):
    value, needs = COLLECTION[key]
    base, changed = (Collection.of(c.algo, c.rollout, c.data)
                     for c in (compose_cfg([*BASE, *needs]), compose_cfg([*BASE, *needs, f"{key}={value}"])))
    correct = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]])  # one uniform group, one mixed
    assert base != changed
    if key == "algo.dynamic_sampling":
        assert base.keep(correct).tolist() == [True, True] and changed.keep(correct).tolist() == [False, True]


@pytest.mark.parametrize("override", SAME)
def test_speed_and_memory_choices_leave_the_step_where_it_was(override, recorded, base_step):
    torch.testing.assert_close(one_step(recorded, override.split()), base_step, atol=2e-6, rtol=1e-4)
