"""Rollout collection (dynamic sampling, overlong shaping) with a scripted engine and task."""

import pytest
import torch

from bicc.data import Problem
from bicc.method.dapo import overlong_penalty
from bicc.model.tokenizer import build_char_tokenizer
from bicc.rollout import Engine, RolloutOutput
from bicc.rollout.collect import Collection, DataCursor, collect_rollout


class ScriptedTask:
    """Problem i is 'all right' if i % 3 == 0, 'all wrong' if i % 3 == 1, mixed otherwise."""

    def train_problem(self, index):
        return Problem(id=str(index), prompt=f"q{index}", answer="1")

    def reward(self, text, problem):
        return float(text == "right")


class ScriptedEngine(Engine):
    def __init__(self, tokenizer, long_completion=False):
        self.tokenizer, self.calls, self.long_completion = tokenizer, 0, long_completion
        self.asked = []  # (problem indices, seed) of each call

    def generate(self, prompts, sampling):
        self.calls += 1
        out = RolloutOutput([], [], [], [])
        indices = [int(self.tokenizer.decode(ids).split("q")[1].split("<")[0]) for ids in prompts]
        self.asked.append((indices, sampling.seed))
        for ids, index in zip(prompts, indices):
            for j in range(sampling.n):
                right = index % 3 == 0 or (index % 3 == 2 and j % 2 == 0)
                text = "right" if right else "wrong"
                length = 30 if (self.long_completion and j == 0) else 5
                out.prompt_ids.append(ids)
                out.completion_ids.append([10] * length)
                out.texts.append(text)
                out.finished.append(True)
        return out


def make_plan(dynamic, rounds=4, buffer=0, prompts=4, G=4, max_new=32):
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", f"rollout.prompts_per_step={prompts}", f"rollout.group_size={G}",
                       f"rollout.max_new_tokens={max_new}", f"algo.dynamic_sampling={dynamic}",
                       f"algo.max_sampling_rounds={rounds}", f"algo.overlong_buffer_share={buffer / max_new}"])
    plan = Collection.of(cfg.algo, cfg.rollout, cfg.data)
    assert (plan.dynamic_sampling, plan.max_rounds, plan.overlong_buffer) == (dynamic, rounds, buffer)
    return plan


def collect(engine, plan, cursor=None):
    return collect_rollout(engine, engine.tokenizer, ScriptedTask(), plan, cursor or DataCursor(), seed=0)


def test_without_dynamic_sampling_every_group_is_kept():
    tok = build_char_tokenizer()
    cursor = DataCursor(pos=0)
    ro = collect(ScriptedEngine(tok), make_plan(False), cursor)
    assert ro.prompts_drawn == 4 and ro.rounds == 1 and cursor.pos == 4
    assert len(ro.correct) == 16 and ro.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert ro.correct.view(4, 4)[0].tolist() == [1, 1, 1, 1]  # problem 0 is all right


def test_dynamic_sampling_drops_degenerate_groups_and_refills():
    tok = build_char_tokenizer()
    cursor = DataCursor(pos=0)
    ro = collect(ScriptedEngine(tok), make_plan(True, rounds=10), cursor)
    # only problems 2, 5, 8, 11 (i % 3 == 2) are mixed: 4 groups need problems 0..11 drawn
    groups = ro.correct.view(-1, 4)
    assert len(groups) == 4 and all(0 < g.sum() < 4 for g in groups)
    assert ro.prompts_drawn == cursor.pos == 12 and ro.rounds > 1
    assert ro.group_ids.tolist() == torch.arange(4).repeat_interleave(4).tolist()


def test_dynamic_sampling_is_bounded_and_returns_what_it_has():
    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok)
    ro = collect(engine, make_plan(True, rounds=1))
    assert engine.calls == 1 and ro.rounds == 1
    assert len(ro.correct) == 4  # one mixed group among problems 0..3


def test_shards_read_their_own_problems_with_their_own_seeds():
    """Two prompt shards of 2 queries under dynamic sampling: shard s reads problems s, s + 2, s + 4, ... (mixed
    only where i % 3 == 2), every generate call of every shard and round has its own seed, the cursor counts each
    shard's draws, and groups are numbered over both shards. Shard 0 draws [0, 2] (keeps 2), [4], [6], [8] (keeps
    8); shard 1 draws [1, 3], [5, 7] (keeps 5), [9], [11] (keeps 11)."""
    tok = build_char_tokenizer()
    engine, cursor = ScriptedEngine(tok), DataCursor()
    ro = collect_rollout(engine, tok, ScriptedTask(), make_plan(True, rounds=10), cursor, seed=3, shards=(0, 1),
                         num_shards=2)
    assert [indices for indices, _ in engine.asked] == [[0, 2], [4], [6], [8], [1, 3], [5, 7], [9], [11]]
    seeds = [seed for _, seed in engine.asked]
    assert len(set(seeds)) == len(seeds)
    assert cursor.shard_pos == [5, 6] and ro.prompts_drawn == 11 and ro.rounds == 4
    assert ro.prompts == [f"q{i}" for i in (2, 8, 5, 11) for _ in range(4)]
    assert ro.group_ids.tolist() == torch.arange(4).repeat_interleave(4).tolist()


def test_overlong_shaping_changes_rewards_not_correctness():
    tok = build_char_tokenizer()
    ro = collect(ScriptedEngine(tok, long_completion=True), make_plan(False, buffer=8, max_new=32))
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
    ro = collect(ScriptedEngine(tok, long_completion=True), make_plan(True, rounds=10, buffer=8, max_new=32))
    # problem 0 is all right; its long sample makes the shaped rewards differ, yet the group is dropped
    groups = ro.correct.view(-1, 4)
    assert all(0 < g.sum() < 4 for g in groups)


@pytest.mark.launch
def test_the_rollout_package_sits_below_the_rl_state():
    """Collection takes the engine, the task and its settings as arguments: no module of ``bicc/rollout`` imports
    the RL state or anything built on it (not even for type hints), and importing collection loads none of them."""
    import ast
    import subprocess
    import sys

    from tests.helpers import ROOT

    above = {"bicc.trainer.state", "bicc.trainer.step", "bicc.trainer.update", "bicc.trainer.loop", "bicc.trainer.plan"}
    for path in (ROOT / "bicc" / "rollout").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not above & set(names), f"{path.name} imports {above & set(names)}"
    code = "import sys, bicc.rollout.collect; print(sorted(m for m in sys.modules if m in %r))" % above
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_queries_that_do_not_split_over_the_processes_are_refused_by_name():
    """32 queries over 3 processes (rollout.shards null: one shard each) would train 30 a step without a word."""
    from types import SimpleNamespace

    from bicc.machine.distributed import Dist, num_shards

    rollout = SimpleNamespace(prompts_per_step=32, shards=None)
    assert num_shards(rollout, Dist(world=2)) == 2
    with pytest.raises(ValueError, match="'rollout.prompts_per_step': 32 queries cannot be split into 3 prompt shards"):
        num_shards(rollout, Dist(world=3))
    assert num_shards(SimpleNamespace(prompts_per_step=33, shards=None), Dist(world=3)) == 3


class LongEveryThird(ScriptedTask):
    """Problem i's prompt is padded in front to a long one when i % 3 == 1."""

    def train_problem(self, index):
        return Problem(id=str(index), prompt=("x" * 40 if index % 3 == 1 else "") + f"q{index}", answer="1")


@pytest.mark.parametrize("overflow", ["drop", "truncate"])
def test_prompts_over_max_prompt_length_are_dropped_or_truncated_and_counted(overflow):
    """data.max_prompt_length as TRL and verl read it: a prompt over it is replaced by the next problem (drop) or
    keeps its last tokens (truncate); either way counted."""
    from dataclasses import replace

    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok)
    short, long = (len(collect_ids(tok, LongEveryThird().train_problem(i))) for i in (0, 1))
    limit = short + 2
    assert long > limit
    plan = replace(make_plan(False, prompts=4, G=2), max_prompt_length=limit, prompt_overflow=overflow)
    cursor = DataCursor()
    ro = collect_rollout(engine, tok, LongEveryThird(), plan, cursor, seed=0)
    assert all(len(ids) <= limit for ids in ro.out.prompt_ids)
    if overflow == "drop":  # problems 0, 2, 3, 5: 1 and 4 were drawn and dropped
        assert [p.lstrip("x") for p in ro.prompts[::2]] == ["q0", "q2", "q3", "q5"]
        assert ro.prompts_over_length == 2 and ro.prompts_drawn == 6 and cursor.pos == 6
    else:  # problems 0..3, 1 cut to its last tokens (the end of the question and the assistant turn)
        assert [p.lstrip("x") for p in ro.prompts[::2]] == ["q0", "q1", "q2", "q3"]
        assert ro.prompts_over_length == 1 and cursor.pos == 4
        assert ro.out.prompt_ids[2] == collect_ids(tok, LongEveryThird().train_problem(1))[-limit:]


def collect_ids(tok, problem):
    from bicc.data import encode_prompt

    return encode_prompt(tok, problem.prompt)


def test_rollout_metrics_by_hand():
    """Two groups of two: outputs of 3, 5, 1 and 7 tokens (mean 4), one cut at max_new_tokens; the verdicts 1, 0, 1, 1
    and a shaped reward below them; a scoring error counted, a reward part averaged."""
    from bicc.rollout.collect import Rollout, rollout_metrics

    out = RolloutOutput([[1]] * 4, [[5] * 3, [5] * 5, [5], [5] * 7], ["a", "b", "c", "d"], [True, True, False, True])
    ro = Rollout(out, ["q1", "q1", "q2", "q2"], torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.5, 0.0, 1.0, 0.5]),
                 torch.tensor([0, 0, 1, 1]), prompts_drawn=3, rounds=2,
                 reward_parts={"scoring_errors": torch.tensor([0.0, 1.0, 0.0, 1.0]), "boxed": torch.tensor([1.0, 0, 0, 0])})
    got = rollout_metrics(ro, group_size=2)
    assert got == {"reward/accuracy": 0.75, "reward/mean": 0.5, "rollout/response_len": 4.0,
                   "rollout/truncated_share": 0.25, "rollout/prompts_drawn": 3, "rollout/generate_rounds": 2,
                   "rollout/prompts_over_length": 0.0, "rollout/groups": 2, "reward/scoring_errors": 2.0,
                   "reward/boxed": 0.25}
