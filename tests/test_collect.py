"""Rollout collection (dynamic sampling, overlong shaping) with a scripted engine and task."""

from dataclasses import dataclass

import pytest
import torch

from bicc.data import Problem
from bicc.rewards import overlong_penalty
from bicc.rollout import RolloutOutput
from bicc.rollout.collect import collect_rollout
from bicc.tokenizer import build_char_tokenizer


class ScriptedTask:
    """Problem i is 'all right' if i % 3 == 0, 'all wrong' if i % 3 == 1, mixed otherwise."""

    def train_problem(self, index):
        return Problem(id=str(index), prompt=f"q{index}", answer="1")

    def reward(self, text, problem):
        return float(text == "right")


class ScriptedEngine:
    def __init__(self, tokenizer, long_completion=False):
        self.tokenizer, self.calls, self.long_completion = tokenizer, 0, long_completion

    def generate(self, prompts, sampling):
        self.calls += 1
        out = RolloutOutput([], [], [], [])
        for ids in prompts:
            index = int(self.tokenizer.decode(ids).split("q")[1].split("<")[0])
            for j in range(sampling.n):
                right = index % 3 == 0 or (index % 3 == 2 and j % 2 == 0)
                text = "right" if right else "wrong"
                length = 30 if (self.long_completion and j == 0) else 5
                out.prompt_ids.append(ids)
                out.completion_ids.append([10] * length)
                out.texts.append(text)
                out.finished.append(True)
        return out


@dataclass
class State:
    task: object
    engine: object
    tokenizer: object
    data_pos: int = 0


def make_cfg(dynamic, rounds=4, buffer=0, prompts=4, G=4, max_new=32):
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", f"rollout.prompts_per_step={prompts}", f"rollout.group_size={G}",
                       f"rollout.max_new_tokens={max_new}", f"algo.dynamic_sampling={dynamic}",
                       f"algo.max_sampling_rounds={rounds}", f"algo.overlong_buffer_share={buffer / max_new}"])
    return cfg


def test_without_dynamic_sampling_every_group_is_kept():
    tok = build_char_tokenizer()
    state = State(ScriptedTask(), ScriptedEngine(tok), tok)
    ro = collect_rollout(state, make_cfg(False), seed=0)
    assert ro.prompts_drawn == 4 and ro.rounds == 1 and state.data_pos == 4
    assert len(ro.correct) == 16 and ro.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert ro.correct.view(4, 4)[0].tolist() == [1, 1, 1, 1]  # problem 0 is all right


def test_dynamic_sampling_drops_degenerate_groups_and_refills():
    tok = build_char_tokenizer()
    state = State(ScriptedTask(), ScriptedEngine(tok), tok)
    ro = collect_rollout(state, make_cfg(True, rounds=10), seed=0)
    # only problems 2, 5, 8, 11 (i % 3 == 2) are mixed: 4 groups need problems 0..11 drawn
    groups = ro.correct.view(-1, 4)
    assert len(groups) == 4 and all(0 < g.sum() < 4 for g in groups)
    assert ro.prompts_drawn == state.data_pos and ro.rounds > 1
    assert ro.group_ids.tolist() == torch.arange(4).repeat_interleave(4).tolist()


def test_dynamic_sampling_is_bounded_and_returns_what_it_has():
    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok)
    state = State(ScriptedTask(), engine, tok)
    ro = collect_rollout(state, make_cfg(True, rounds=1), seed=0)
    assert engine.calls == 1 and ro.rounds == 1
    assert len(ro.correct) == 4  # one mixed group among problems 0..3


def test_overlong_shaping_changes_rewards_not_correctness():
    tok = build_char_tokenizer()
    state = State(ScriptedTask(), ScriptedEngine(tok, long_completion=True), tok)
    ro = collect_rollout(state, make_cfg(False, buffer=8, max_new=32), seed=0)
    # sample 0 of each group has 30 tokens: penalty -(30 - (32 - 8))/8 = -0.75
    assert ro.rewards.view(4, 4)[0].tolist() == [0.25, 1, 1, 1]
    assert ro.correct.view(4, 4)[0].tolist() == [1, 1, 1, 1]


def test_overlong_penalty_values():
    lengths = torch.tensor([10, 24, 28, 32])
    # max_len 32, buffer 8: free up to 24, then -(len - 24)/8: [0, 0, -0.5, -1]
    assert overlong_penalty(lengths, 32, 8, 1.0).tolist() == [0, 0, -0.5, -1]
    assert overlong_penalty(lengths, 32, 0, 1.0).tolist() == [0, 0, 0, 0]
    assert overlong_penalty(lengths, 32, 8, 2.0).tolist() == pytest.approx([0, 0, -1, -2])


def test_dynamic_sampling_filters_on_correctness_not_shaped_reward():
    tok = build_char_tokenizer()
    state = State(ScriptedTask(), ScriptedEngine(tok, long_completion=True), tok)
    ro = collect_rollout(state, make_cfg(True, rounds=10, buffer=8, max_new=32), seed=0)
    # problem 0 is all right; its long sample makes the shaped rewards differ, yet the group is dropped
    groups = ro.correct.view(-1, 4)
    assert all(0 < g.sum() < 4 for g in groups)
