"""Every numeric field of the run's schemas (found by walking ``RunConfig``: a new field is covered without an edit) at
0, at a negative value, at 1 and at a huge one (10^12): either a clear error naming the field before any model
loads (``bicc.trainer.validation.validate``), or a value the run takes for what it means. Accepted zeros and
negatives then run (``-m slow``: a short run each, which must finish); a negative is accepted only where the field
is signed by meaning."""

import copy
import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from bicc.config import RunConfig
from bicc.trainer.validation import validate
from tests.conftest import compose_cfg
from tests.helpers import SMALL, run_train

# a partition threshold for rewards that may be negative (a shaped reward); a reward's weight (negative: a penalty)
SIGNED = {"bicc.reward_threshold", "data.reward_weights"}


def numeric_fields(schema=RunConfig, path=""):
    """(dotted name, int or float, whether it is a list) of every number a run's config holds."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        inner = [t for t in (hint, *typing.get_args(hint)) for t in (t, *typing.get_args(t))]
        nested = [t for t in inner if dataclasses.is_dataclass(t)]
        if nested and typing.get_origin(hint) is not list:
            yield from numeric_fields(nested[0], f"{path}{f.name}.")
        elif not f.metadata.get("choices") and (kind := next((t for t in inner if t in (int, float)), None)):
            yield f"{path}{f.name}", kind, any(typing.get_origin(t) in (list, tuple) for t in (hint, *typing.get_args(hint)))


FIELDS = list(numeric_fields())
CASES = [(name, v, listed) for name, kind, listed in FIELDS
         for v in ((0, -1, 1, 10**12) if kind is int else (0.0, -1.0, 1.0, 1e12))]


@pytest.fixture(scope="module")
def base():
    return compose_cfg(["sft.cache_dir=/tmp/x"])


def setting(base, name, value, listed):
    """The value as the field takes it: a list field gets it in each of its places (one at least)."""
    return [value] * max(1, len(OmegaConf.select(base, name) or [])) if listed else value


def outcome(base, name, value, listed):
    """None when the value is accepted, else the error's message; any other exception propagates."""
    cfg = copy.deepcopy(base)
    OmegaConf.update(cfg, name, setting(base, name, value, listed), merge=False)
    try:
        validate(cfg)
    except ValueError as err:
        return str(err)
    return None


def test_the_walk_finds_the_fields():
    names = {name for name, _, _ in FIELDS}
    assert {"train.steps", "optim.lr", "model.tiny.hidden_size", "eval.ks", "rollout.group_size", "seed"} <= names
    assert len(names) >= 100


@pytest.mark.parametrize(("name", "value", "listed"), CASES, ids=[f"{n}={v}" for n, v, _ in CASES])
def test_an_edge_is_refused_naming_its_field_or_taken(name, value, listed, base):
    message = outcome(base, name, value, listed)
    if message is not None:
        assert message.startswith("config field '") and (f"'{name}" in message or f"{name}=" in message), message
    elif value < 0:
        assert name in SIGNED, f"{name}={value} is accepted: refuse it, or declare the field signed"


ZEROS_AND_NEGATIVES = [case for case in CASES if case[1] in (0, -1)]


@pytest.mark.slow
@pytest.mark.launch
@pytest.mark.parametrize(("name", "value", "listed"), ZEROS_AND_NEGATIVES,
                         ids=[f"{n}={v}" for n, v, _ in ZEROS_AND_NEGATIVES])
def test_an_accepted_zero_or_negative_runs(name, value, listed, base, tmp_path):
    """A short run (the tiny model, 2 RL steps) with a zero or negative the validation takes must finish (one it
    refuses is the test above's)."""
    if outcome(base, name, value, listed) is not None:
        pytest.skip("refused by the validation")
    override = f"{name}={setting(base, name, value, listed)}".replace(" ", "")
    args = [*[a for a in SMALL if not a.startswith(name + "=")], override, f"hydra.run.dir={tmp_path / 'run'}"]
    run_train(args, tmp_path, timeout=240)


@pytest.mark.launch
def test_a_huge_learning_rate_stops_with_a_message_naming_it(tmp_path):
    """optim.lr=10^12 is a value, not an error: the first step's update (clipped gradient, Adam's unit step) leaves
    finite weights whose logits are not, and the next rollout stops the run saying so (it crashed inside HF's
    sampler before)."""
    proc = run_train([*SMALL, "train.steps=4", "optim.lr=1e12", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                     check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "FloatingPointError: sampling at weight version 1" in out, out[-2000:]
    assert "optim.lr too high" in out
