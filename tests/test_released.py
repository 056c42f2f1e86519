"""The released BiCC code's form (``bicc=released``, ``algo=released``; docs/method.md, "The released code"), one
difference at a time: which attempt a context shows and how (``bicc.mode=last``, ``bicc.layout=released``,
``bicc.truncate=none``), the advantage sqrt(n-/n+) / -sqrt(n+/n-) (``algo.advantage=src``) and the ratio's
conditioning reversed (``bicc.context_in=denominator``). The trainer's step is held equal to the reference under
these switches by tests/test_reference.py; here each is pinned to what the released code computes."""

import copy
import json
import math

import pytest
import torch

from bicc.config import StepConfig
from bicc.method.advantages import ADVANTAGES
from bicc.method.conditioning import build_contexts
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.rollout import Engine, RolloutOutput
from bicc.trainer import step as step_module
from bicc.trainer.banner import describe_choices
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from bicc.trainer.validation import validate
from tests.conftest import compose_cfg
from tests.helpers import COMBINATION_CFG, TOK, BiccCfg, CoinTask, ReplayEngine, group

RELEASED = dict(mode="last", truncate="none", layout="released", separator_id=2)


# ---- the contexts ------------------------------------------------------------------------------------------
def test_released_layout_shows_the_last_opposite_attempt_whole_between_separators():
    texts = ["a\\boxed{3}", "bb\\boxed{4}", "ccc\\boxed{3}", "dddd\\boxed{5}", "e\\boxed{6}"]
    g = group(texts, [1, 0, 1, 0, 0])
    out = build_contexts(**g, bicc_cfg=BiccCfg(**RELEASED), max_tokens=64)
    q, outs = g["plain_prompt_ids"][0], g["completion_ids"]
    # right outputs see the last wrong one (row 4), wrong outputs the last right one (row 2): the released code's
    # loop writes every (positive, negative) pair's log-probs over the one before, so the last pair stays
    for r, opposite in ((0, 4), (2, 4), (1, 2), (3, 2), (4, 2)):
        assert out.prompt_ids[r] == q + [2] + outs[opposite] + [2], r  # its end token kept, nothing cut or added
        assert out.shown[r] == [opposite] and out.cut[r] == []
    assert outs[4][-1] == TOK.eos_token_id  # what the context shows is the output as sampled
    assert out.conditioned.all() and out.metrics["bicc/attempts_shown"] == 1.0


def test_last_mode_under_the_paper_layout_shows_one_attempt():
    texts = ["a\\boxed{3}", "bb\\boxed{4}", "ccc\\boxed{3}", "dddd\\boxed{5}"]
    out = build_contexts(**group(texts, [1, 0, 1, 0]), bicc_cfg=BiccCfg(mode="last"), max_tokens=64)
    assert [out.shown[r] for r in range(4)] == [[3], [2], [3], [2]]


def test_truncate_none_shows_an_attempt_longer_than_the_budget_whole():
    long = "x" * 40 + "\\boxed{4}"  # 49 tokens against a 25-token budget (0.4 x 64)
    g = group([long, "\\boxed{3}"], [0, 1])
    cut = build_contexts(**g, bicc_cfg=BiccCfg(mode="last"), max_tokens=64)
    whole = build_contexts(**g, bicc_cfg=BiccCfg(mode="last", truncate="none"), max_tokens=64)
    assert cut.cut[1] == [0] and whole.cut[1] == []
    assert long in TOK.decode(whole.prompt_ids[1]) and long not in TOK.decode(cut.prompt_ids[1])


def test_released_config_refuses_what_it_cannot_mean():
    validate(compose_cfg(["bicc=released", "algo=released"]))
    with pytest.raises(ValueError, match="bicc.truncate"):
        validate(compose_cfg(["bicc=on", "bicc.truncate=none"]))  # a whole partition, unbudgeted
    with pytest.raises(ValueError, match="bicc.context_in"):
        validate(compose_cfg(["bicc=released", "bicc.old_on_context=true"]))
    with pytest.raises(ValueError, match="bicc.reward_threshold"):  # it splits verdicts; this O+ is the shaped reward
        validate(compose_cfg(["bicc=released", "algo=released", "bicc.reward_threshold=0.5"]))


# ---- the advantage -----------------------------------------------------------------------------------------
def src_loop(rewards, group_ids):
    """The released code's per-group arithmetic, one group at a time."""
    out = torch.zeros(len(rewards), dtype=torch.float64)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().flatten()
        pos = [int(r) for r in rows if rewards[r] > 0.5]
        neg = [int(r) for r in rows if rewards[r] <= 0.5]
        if pos and neg:
            for r in pos:
                out[r] = math.sqrt(len(neg) / len(pos))
            for r in neg:
                out[r] = -math.sqrt(len(pos) / len(neg))
    return out


def test_src_advantage_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    adv, metrics = ADVANTAGES.get("src")(rewards, groups, None, BiccCfg())
    # group 0: n+ = 1, n- = 3 -> sqrt(3) and -sqrt(1/3); group 1 uniform -> 0; group 2: n+ = n- -> +-1
    expected = [math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), 0, 0, 0, 0, -1, 1, -1, 1]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)
    assert metrics["train/adv_zero_group_share"] == pytest.approx(1 / 3)


def test_src_advantage_is_grpo_without_eps_on_binary_rewards_and_the_loop_on_any():
    gen = torch.Generator().manual_seed(0)
    cfg = compose_cfg(["algo.adv_eps=0"]).algo
    for _ in range(50):
        groups = torch.randint(0, 5, (40,), generator=gen).sort().values
        groups = torch.cat([groups, torch.arange(5), torch.arange(5)])  # every group has 2 outputs at least
        binary = torch.randint(0, 2, (len(groups),), generator=gen).float()
        src, _ = ADVANTAGES.get("src")(binary, groups, None, cfg)
        grpo, _ = ADVANTAGES.get("grpo")(binary, groups, None, cfg)
        assert torch.allclose(src, torch.nan_to_num(grpo), atol=1e-6)
        shaped = binary - torch.rand(len(groups), generator=gen) * 0.8  # overlong shaping: only > 0.5 counts
        assert torch.allclose(ADVANTAGES.get("src")(shaped, groups, None, cfg)[0].double(), src_loop(shaped, groups),
                              atol=1e-6)


# ---- the ratio ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from tests.helpers import recorded_rollout

    return recorded_rollout(tmp_path_factory.mktemp("released"))


@pytest.mark.parametrize("context_in", ["denominator", "numerator"])
def test_the_first_update_reads_its_ratio_the_released_way(context_in, recorded, monkeypatch):
    """At theta = theta_old the update's ratio is pi(o | q) / pi(o | x^c) per token under bicc=released (1 / w), and
    pi(o | x^c) / pi(o | q) (w) with the paper's direction: train/ratio_mean says which was computed."""
    tmp, out, _, _ = recorded
    paper_ratio = [] if context_in == "denominator" else ["bicc.context_in=numerator"]  # bicc=released as it is, or not
    cfg = compose_cfg([*COMBINATION_CFG, "bicc=released", "algo=released", *paper_ratio,
                       "train.micro_batch_size=64"])  # one micro-batch: the metric is a mean over its tokens
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    s.engine, s.plan, s.task = ReplayEngine(out, None), None, CoinTask(s.task)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout
    monkeypatch.setattr(step_module, "collect_rollout", lambda *a, **k: rollouts.append(collect(*a, **k)) or rollouts[-1])
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    ro = rollouts[0]
    contexts = build_contexts(ro.prompts, ro.out.completion_ids, ro.correct, ro.group_ids, s.tokenizer, cfg.bicc,
                              cfg.bicc.max_tokens, ro.out.prompt_ids, s.end_ids, s.task.answer_anchors)
    pad, T = s.tokenizer.pad_token_id, cfg.rollout.temperature

    def logp(prompts):
        rows = [batch_logprobs(before, make_token_batch([p], [o], pad), T)[0][0] for p, o in zip(prompts, ro.out.completion_ids)]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    mask = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, pad).completion_mask.bool()
    with torch.no_grad():
        log_w = logp(contexts.prompt_ids) - logp(ro.out.prompt_ids)  # log pi(o | x^c) - log pi(o | q) per token
    released, paper = (-log_w).exp()[mask].mean().item(), log_w.exp()[mask].mean().item()
    assert contexts.conditioned.any() and abs(released - paper) > 5e-3  # the two directions differ measurably
    expected, other = (released, paper) if context_in == "denominator" else (paper, released)
    assert metrics["train/ratio_mean"] == pytest.approx(expected, rel=1e-5)
    assert metrics["train/ratio_mean"] != pytest.approx(other, rel=1e-3)


# ---- the partition: one rule for the contexts and the advantage (algo.partition) ----------------------------------
class ByFirstLetter(CoinTask):
    """The task with a reward read off the output's text: "R..." right, else wrong."""

    def reward(self, completion: str, problem) -> float:
        return float(completion.startswith("R"))


def test_the_released_partition_is_the_shaped_reward_strictly_above_half():
    """The script's lengths (3,072 tokens, a 1,700-token buffer): a right output of 2,221 tokens keeps 1 - 849/1700
    = 0.5006 and stays right; at 2,222 the penalty is 850/1700 = 0.5 exactly, and 0.5 is not above 0.5."""
    from types import SimpleNamespace

    from bicc.method.conditioning import positives
    from bicc.method.dapo import overlong_penalty

    lengths, correct = torch.tensor([1372, 2221, 2222, 3072, 100]), torch.tensor([1.0, 1, 1, 1, 0])
    ro = SimpleNamespace(correct=correct, rewards=correct + overlong_penalty(lengths, 3072, 1700, 1.0).float())
    assert ro.rewards[1].item() == pytest.approx(1 - 849 / 1700) and ro.rewards[2].item() == 0.5
    assert positives(ro, "reward", None).tolist() == [True, True, False, False, False]
    assert positives(ro, "correct", None).tolist() == [True, True, True, True, False]
    verdicts = SimpleNamespace(correct=torch.tensor([2.0, 0.5, 1.0, 0.0]), rewards=None)  # non-binary: a threshold
    assert positives(verdicts, "correct", 1.0).tolist() == [True, False, True, False]


def test_contexts_take_the_partition_as_given():
    """A bool O+ (``positives``, the threshold already applied) is the partition itself, not verdicts to split again."""
    from types import SimpleNamespace

    from bicc.method.conditioning import positives

    g = group(["a\\boxed{3}", "bb\\boxed{4}", "ccc\\boxed{3}", "dddd\\boxed{5}"], [2.0, 0.0, 2.0, 0.0])
    cfg = BiccCfg(reward_threshold=1.5)
    by_verdict = build_contexts(**g, bicc_cfg=cfg, max_tokens=64)
    given = build_contexts(**{**g, "correct": positives(SimpleNamespace(correct=g["correct"]), "correct", 1.5)},
                           bicc_cfg=cfg, max_tokens=64)
    assert by_verdict.conditioned.all() and given.shown == by_verdict.shown == [[1, 3], [0, 2], [1, 3], [0, 2]]


@pytest.mark.parametrize("form, rule", [(["bicc=released", "algo=released"], "reward"),
                                        (["bicc=on", "algo=released"], "reward"),
                                        (["bicc=released", "algo=released", "algo.partition=correct"], "correct")])
def test_the_contexts_and_the_advantage_read_one_partition(form, rule, recorded, monkeypatch):
    """Under overlong shaping a right output past the penalty's midpoint is on the wrong side by the released rule
    (refine_dapo_trainer.py:1596, shaped reward > 0.5; algo=released): it is shown the right outputs, they are shown
    it, and its advantage is negative. With algo.partition=correct it stays right in both. Either way every
    attempt a context shows is from the other side of the advantage's partition."""
    import dataclasses

    tmp, out, _, _ = recorded
    # outputs set by hand, whatever this host's model sampled: in each group of 4 a right and a wrong one of 10 tokens
    # and of 32; a buffer of 3 of the 32 tokens leaves the short right one at 1 and takes the long one to 0
    lengths, right = [10, 32, 10, 32] * 4, [True, True, False, False] * 4
    out = dataclasses.replace(out, completion_ids=[[7] * n for n in lengths], finished=[False] * 16, logprobs=None,
                              texts=[f"{'R' if r else 'W'}{i}" for i, r in enumerate(right)])
    cfg = compose_cfg([*COMBINATION_CFG, *form, "algo.overlong_buffer_share=0.1"])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    s.engine, s.plan, s.task = ReplayEngine(out, None), None, ByFirstLetter(s.task)
    seen = {}
    collect, contexts_of, inputs = step_module.collect_rollout, step_module.build_contexts, step_module.inputs_of
    monkeypatch.setattr(step_module, "collect_rollout", lambda *a, **k: seen.setdefault("ro", collect(*a, **k)))
    monkeypatch.setattr(step_module, "build_contexts", lambda *a, **k: seen.setdefault("contexts", contexts_of(*a, **k)))
    monkeypatch.setattr(step_module, "inputs_of", lambda *a, **k: seen.setdefault("inputs", inputs(*a, **k)))
    rl_step(s, StepConfig.of(cfg))
    ro, contexts = seen["ro"], seen["contexts"]
    adv, _ = ADVANTAGES.get("src")(ro.rewards, ro.group_ids, None, cfg.algo, **seen["inputs"])  # the step's own
    rule = ro.rewards > 0.5 if rule == "reward" else ro.correct == 1
    mixed = adv != 0
    assert ((adv > 0) == rule)[mixed].all()  # the advantage's sides are the rule's
    overlong_right = (ro.correct == 1) & (ro.rewards <= 0.5) & mixed & contexts.conditioned
    assert overlong_right.any()  # the case that tells the rules apart is in this rollout
    for r in contexts.conditioned.nonzero().flatten().tolist():
        assert contexts.shown[r] and all(bool(rule[a]) != bool(rule[r]) for a in contexts.shown[r]), r


def test_the_executed_preset_is_the_intended_script_with_no_conditioning():
    """experiment=bicc_released_executed is what the released update computes (docs/method.md, row 0): the script of
    experiment=bicc_released with BiCC off, its objective and its shaped partition kept."""
    from tests.presets import resolved

    intended, executed = resolved("experiment=bicc_released"), resolved("experiment=bicc_released_executed")
    moved = {k for k in intended.keys() | executed.keys() if intended.get(k) != executed.get(k)}
    assert moved - {"run_name"} == {"bicc.enabled", "bicc.mode", "bicc.truncate", "bicc.layout", "bicc.context_in"}
    assert not executed["bicc.enabled"] and executed["algo.name"] == "released" and executed["algo.partition"] == "reward"
    validate(compose_cfg(["experiment=bicc_released_executed", "sft.cache_dir=/tmp/x"]))


def test_train_py_says_at_start_that_the_form_is_the_released_codes():
    cfg = compose_cfg(["bicc=released", "algo=released"])
    text = describe_choices({"bicc": "released", "algo": "released"}, StepConfig.of(cfg), cfg.model, cfg.data, cfg.sft)
    assert ("bicc=released (the authors' released code's form, not the paper's; as its code describes it, not as its "
            "update runs it (bicc=off") in text
    assert "algo=released (the released code's objective" in text
    assert "pi_theta(o | q) / pi_old(o | x^c)" in text and "attempts shown whole" in text
    paper = describe_choices({"bicc": "on"}, StepConfig.of(compose_cfg(["bicc=on"])), cfg.model, cfg.data, cfg.sft)
    assert "released" not in paper and "context budget" in paper


# ---- ReMax: the script's estimator (dead for its update, docs/method.md), runnable as algo.advantage=remax ------
class GreedyEngine(Engine):
    """Samples are right at even positions of a group; the greedy output (temperature 0) of query i is right when
    i is even. A baseline drawn by sampling would be the first sample's reward instead: right for every query."""

    def __init__(self, tokenizer):
        self.tokenizer, self.asked = tokenizer, []

    def generate(self, prompts, sampling):
        self.asked.append((sampling.n, sampling.temperature))
        out = RolloutOutput([], [], [], [])
        for ids in prompts:
            index = int(self.tokenizer.decode(ids).split("q")[1].split("<")[0])
            for j in range(sampling.n):
                right = index % 2 == 0 if sampling.temperature == 0 else j % 2 == 0
                out.prompt_ids.append(ids)
                out.completion_ids.append([10] * (5 + j))
                out.texts.append("right" if right else "wrong")
                out.finished.append(True)
        return out


def test_remax_baselines_each_query_on_its_greedy_output():
    from bicc.model.tokenizer import build_char_tokenizer
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout
    from tests.test_collect import ScriptedTask

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4", "rollout.group_size=4",
                       "algo.advantage=remax"])
    plan = Collection.of(cfg.algo, cfg.rollout, cfg.data)
    assert plan.greedy_baseline and not Collection.of(compose_cfg().algo, cfg.rollout, cfg.data).greedy_baseline
    engine = GreedyEngine(build_char_tokenizer())
    ro = collect_rollout(engine, engine.tokenizer, ScriptedTask(), plan, DataCursor(), seed=0)
    assert engine.asked == [(4, cfg.rollout.temperature), (1, 0.0)]  # G samples, then one greedy output a query
    assert ro.baseline.tolist() == [1.0] * 4 + [0.0] * 4 + [1.0] * 4 + [0.0] * 4  # queries 0..3: even ones right
    adv, metrics = ADVANTAGES.get("remax")(ro.rewards, ro.group_ids, None, cfg.algo, baseline=ro.baseline)
    assert adv.tolist() == [0, -1, 0, -1, 1, 0, 1, 0, 0, -1, 0, -1, 1, 0, 1, 0]  # r - b, by hand
    assert metrics["train/remax_baseline"] == 0.5
    with pytest.raises(ValueError, match="greedy output"):
        ADVANTAGES.get("remax")(ro.rewards, ro.group_ids, None, cfg.algo)


@pytest.mark.launch
def test_train_py_runs_the_released_form_and_remax_end_to_end(tmp_path):
    """``python train.py bicc=released algo=released`` (ReMax's estimator in place of its advantage: the greedy output
    drawn by the HF engine at temperature 0) trains, conditions its groups and says which form it runs."""
    from tests.helpers import SMALL, conditioned_steps, run_train

    run_dir = tmp_path / "run"
    small = [a for a in SMALL if not a.startswith(("bicc=", "rcc="))]
    proc = run_train([*small, "bicc=released", "algo=released", "algo.advantage=remax", "eval.num_problems=2",
                      f"hydra.run.dir={run_dir}"], tmp_path)
    run_line = next(line for line in proc.stdout.splitlines() if line.startswith("[run]"))
    assert ("bicc=released (the authors' released code's form, not the paper's; as its code describes it, not as its "
            "update runs it (bicc=off") in run_line
    assert all(share > 0 for share in conditioned_steps(run_dir)) and len(conditioned_steps(run_dir)) == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [0 <= r["train/remax_baseline"] <= 1 for r in rows if "reward/mean" in r] == [True, True]
    assert [r["bicc/attempts_shown"] for r in rows if "bicc/attempts_shown" in r] == [1.0, 1.0]  # one attempt each
    assert max(r["bicc/context_tokens"] for r in rows if "bicc/context_tokens" in r) > 0


def test_a_warm_start_shows_its_contexts_in_the_released_layout():
    from bicc.data import encode_prompt
    from bicc.method.conditioning import render_context

    attempt = TOK("7\\boxed{7}", add_special_tokens=False)["input_ids"]
    shown = render_context(TOK, "Compute 3+4.", [attempt], BiccCfg(**RELEASED), 64)
    assert shown == encode_prompt(TOK, "Compute 3+4.") + [2] + attempt + [2]
    assert render_context(TOK, "Compute 3+4.", [attempt], BiccCfg(), 64) != shown  # the paper's template
