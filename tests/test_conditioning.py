"""The BiCC context builder: partition, budget, truncation, matching modes, fallbacks."""

import random

import pytest
import torch

from bicc.data.rewards import extract_answer
from bicc.method.conditioning import answer_start, build_contexts, fair_shares, partition, truncate
from tests.helpers import TOK, BiccCfg, enc, group


def attempts_in(ids, cfg=None):
    """The attempt texts shown in a context, split on the numbered headers."""
    cfg = cfg or BiccCfg()
    text = TOK.decode(ids)
    body = text.split(cfg.preamble, 1)[1].split("<|im_end|>")[0]
    return [part.split(") ", 1)[1] for part in body.split("\n(")[1:]]


def test_fair_shares():
    assert fair_shares([3, 100, 100], 30) == [3, 14, 13]  # short one keeps all, the rest split 27
    assert fair_shares([5, 5], 30) == [5, 5]  # under budget: everything fits
    assert sum(fair_shares([40, 50, 60, 70], 101)) == 101
    assert fair_shares([], 10) == []
    assert fair_shares([1, 5, 10], 12) == [1, 5, 6]  # what the short ones leave goes to the longest


def water_fill(lengths, budget):
    """The slow reference: one token at a time to the item with the fewest tokens that still wants more (ties: the
    shorter item, then the earlier one)."""
    order = sorted(range(len(lengths)), key=lambda j: lengths[j])
    shares = [0] * len(lengths)
    for _ in range(budget):
        wanting = [j for j in order if shares[j] < lengths[j]]
        if not wanting:
            break
        shares[min(wanting, key=lambda j: shares[j])] += 1
    return shares


def test_fair_shares_equal_water_filling_one_token_at_a_time():
    gen = random.Random(0)
    for _ in range(300):
        lengths = [gen.randint(0, 40) for _ in range(gen.randint(1, 7))]
        budget = gen.randint(0, 120)
        assert fair_shares(lengths, budget) == water_fill(lengths, budget), (lengths, budget)


def test_partition_rejects_non_binary_without_threshold():
    with pytest.raises(ValueError, match="bicc.reward_threshold"):
        partition(torch.tensor([1.0, 0.5]), None)
    assert partition(torch.tensor([1.0, 0.5, 0.2]), 0.5).tolist() == [True, True, False]


def test_truncate_middle_keeps_head_and_final_answer():
    ids = enc("12+34=46\n46-5=41\n\\boxed{41}")
    start = answer_start(ids, TOK)
    assert TOK.decode(ids[start:]) == "\n\\boxed{41}"  # the answer began a line: its line break is kept
    cut = truncate(ids, 16, "middle", enc("..."), start, min_tokens=12)
    assert len(cut) == 16 and TOK.decode(cut) == "12...\n\\boxed{41}"
    assert truncate(ids, 11, "middle", enc("..."), start, min_tokens=12) is None  # below the minimum: dropped
    assert truncate(ids, 12, "middle", enc("..."), start, min_tokens=12) is None  # answer + marker do not fit
    assert TOK.decode(truncate(ids, 14, "tail", enc("..."), start, 12)) == "...\n\\boxed{41}"
    assert TOK.decode(truncate(ids, 14, "head", enc("..."), start, 12)) == "12+34=46\n46-5="
    assert truncate(ids, 100, "middle", enc("..."), start, 12) == ids


def test_an_attempt_cut_to_its_elision_marker_alone_is_dropped():
    """An answer-less attempt "W000W" with a 3-token share and a 3-token marker: middle truncation would show
    "..." and nothing of the attempt (found by the fuzz test); it is dropped instead. One token more keeps
    one token of it."""
    ids = enc("W000W")
    assert truncate(ids, 3, "middle", enc("..."), len(ids), min_tokens=1) is None
    assert TOK.decode(truncate(ids, 4, "middle", enc("..."), len(ids), min_tokens=1)) == "W..."
    assert truncate(ids, 3, "tail", enc("..."), len(ids), min_tokens=1) is None


def test_partition_mode_contexts_budget_and_sampled_ids():
    texts = ["1+2=3\n\\boxed{3}", "1+2=4\n\\boxed{4}", "1+2=5 and then a long detour here\n\\boxed{5}", "1+2=3\n\\boxed{3}"]
    g = group(texts, [1, 0, 0, 1])
    cfg = BiccCfg()
    out = build_contexts(**{k: v for k, v in g.items() if k != "plain_prompt_ids"}, bicc_cfg=cfg, max_tokens=80,
                         plain_prompt_ids=g["plain_prompt_ids"])
    budget = int(0.4 * 80)  # 32 tokens for all attempts of one context
    assert out.conditioned.tolist() == [True] * 4
    assert out.context_key[0] == out.context_key[3] != out.context_key[1] == out.context_key[2]
    # correct samples see the two wrong attempts, wrong ones see the (identical) correct attempts
    shown_to_pos = attempts_in(out.prompt_ids[0])
    assert len(shown_to_pos) == 2 and sum(len(enc(a)) for a in shown_to_pos) <= budget
    assert all(extract_answer(a) in ("4", "5") for a in shown_to_pos)  # every kept attempt keeps its answer
    assert "..." in shown_to_pos[1]  # the long one was cut in the middle
    assert attempts_in(out.prompt_ids[1]) == ["1+2=3\n\\boxed{3}"] * 2
    # which rows each context shows, in order, and which of them were cut (what samples.jsonl reports)
    assert out.shown == [[1, 2], [0, 3], [0, 3], [1, 2]] and out.cut == [[2], [], [], [2]]
    # the context is the plain prompt with the attempts inside the user turn, assistant turn last
    text = TOK.decode(out.prompt_ids[0])
    assert text.startswith("<|im_start|>user\nCompute 1+2.\nOther attempts:")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert g["completion_ids"][0][-1] == TOK.eos_token_id  # sampled ids untouched (EOS kept in the output)
    assert out.metrics["bicc/groups_conditioned_share"] == 1.0


@pytest.mark.parametrize("correct", [[1, 1, 1], [0, 0, 0]])
def test_empty_partition_falls_back_to_plain_prompt(correct):
    g = group(["\\boxed{3}"] * 3, correct)
    out = build_contexts(**g, bicc_cfg=BiccCfg(), max_tokens=64)
    assert out.prompt_ids == g["plain_prompt_ids"] and not out.conditioned.any()
    assert len(set(out.context_key)) == 3
    assert out.metrics["bicc/groups_conditioned_share"] == 0.0


def test_paired_mode_round_robin_reuses_minority():
    texts = [f"x\\boxed{{{i}}}" for i in range(5)]
    g = group(texts, [1, 0, 0, 0, 0])  # G+ = 1, G- = 4
    out = build_contexts(**g, bicc_cfg=BiccCfg(mode="paired", paired_k=1), max_tokens=64)
    # each of the 4 wrong samples sees the single correct attempt; the correct one sees wrong attempt 1
    for r in range(1, 5):
        assert attempts_in(out.prompt_ids[r]) == ["x\\boxed{0}"]
    assert attempts_in(out.prompt_ids[0]) == ["x\\boxed{1}"]
    out2 = build_contexts(**group(texts, [1, 1, 0, 0, 0]), bicc_cfg=BiccCfg(mode="paired", paired_k=2), max_tokens=64)
    # k = 2: correct sample j sees wrong attempts (2j, 2j+1) mod 3 -> {2,3} and {4,2}
    assert [extract_answer(a) for a in attempts_in(out2.prompt_ids[0])] == ["2", "3"]
    assert [extract_answer(a) for a in attempts_in(out2.prompt_ids[1])] == ["4", "2"]


def test_too_small_budget_drops_attempts_and_counts_them():
    g = group(["1+2=4 with many extra words\n\\boxed{4}"] * 3 + ["\\boxed{3}"], [0, 0, 0, 1])
    out = build_contexts(**g, bicc_cfg=BiccCfg(), max_tokens=64)  # 25-token budget for three long attempts
    shown = attempts_in(out.prompt_ids[3])
    assert 1 <= len(shown) < 3 and sum(len(enc(a)) for a in shown) <= 25
    assert out.metrics["bicc/dropped_share"] > 0
    assert out.shown[3] == [0, 1, 2][:len(shown)]  # the latest attempts dropped first


@pytest.mark.parametrize("ratio", [0.2, 0.4, 0.6])
def test_budget_is_never_exceeded_on_random_groups(ratio):
    gen = torch.Generator().manual_seed(int(ratio * 10))
    for trial in range(20):
        n = 8
        lengths = [int(torch.randint(1, 60, (1,), generator=gen)) for _ in range(n)]
        texts = ["".join(chr(48 + int(c)) for c in torch.randint(0, 10, (length,), generator=gen)) + f"\\boxed{{{trial}}}"
                 for length in lengths]
        correct = torch.randint(0, 2, (n,), generator=gen).tolist()
        out = build_contexts(**group(texts, correct), bicc_cfg=BiccCfg(context_ratio=ratio), max_tokens=128)
        for r in range(n):
            if out.conditioned[r]:
                shown = attempts_in(out.prompt_ids[r])
                assert sum(len(enc(a)) for a in shown) <= int(ratio * 128)
                assert all(extract_answer(a) == str(trial) for a in shown)


def test_truncation_keeps_the_answer_line_of_the_tasks_extractors():
    """DAPO-Math outputs end with an 'Answer:' line: with the \\boxed / 'answer is' anchors alone, middle
    truncation cut it away; the anchors now come from the data's extractors."""
    from bicc.data.answers import answer_anchors
    from bicc.method.conditioning import DEFAULT_ANCHORS, answer_start, truncate
    from bicc.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    text = "Let me think step by step about this long problem and its parts.\nAnswer: 42"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    anchors = answer_anchors(["answer_line", "boxed", "answer_is"])
    assert anchors == ("Answer:", "\\boxed", "answer is")
    elision = tok(" ... ", add_special_tokens=False)["input_ids"]
    kept = tok.decode(truncate(ids, 30, "middle", elision, answer_start(ids, tok, anchors), 12))
    assert kept.endswith("Answer: 42") and " ... " in kept
    lost = tok.decode(truncate(ids, 30, "middle", elision, answer_start(ids, tok, DEFAULT_ANCHORS), 12))
    assert "Answer: 42" not in lost


def test_a_group_with_one_side_dropped_falls_back_whole():
    """Long incorrect attempts that cannot fit the budget: the correct samples (shown O-) would keep q while
    the incorrect ones (shown O+) see attempts; the whole group keeps q instead, and is counted."""
    from omegaconf import OmegaConf

    from bicc.config import BiccConfig
    from bicc.method.conditioning import build_contexts
    from bicc.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = OmegaConf.structured(BiccConfig(enabled=True, max_tokens=100, context_ratio=0.4, min_attempt_tokens=12,
                                          truncate="head"))
    short, long = [40] * 12, [50] * 200
    completions = [short, short, long, long, short, long, short, long]  # group 0: +,+,-,-; group 1: +,-,+,-
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 1, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    plain = [[1, 2, 3]] * 8
    ctx = build_contexts(["p"] * 8, completions, correct, groups, tok, cfg, 100, plain)
    # budget 40: 2 long attempts of 200 get 20 each (head cut, kept); 2 short ones 12 each (kept whole)
    assert ctx.conditioned.all() and ctx.metrics["bicc/attempts_shown"] == 2
    cfg.min_attempt_tokens = 41  # now a long attempt never fits (budget 40): O- shows nothing, O+ still would
    ctx = build_contexts(["p"] * 8, completions, correct, groups, tok, cfg, 100, plain)
    assert not ctx.conditioned.any() and ctx.prompt_ids == plain
    assert ctx.metrics["bicc/groups_dropped_share"] == 1.0 and ctx.metrics["bicc/samples_conditioned_share"] == 0.0


@pytest.mark.parametrize("how", ["head", "middle"])
def test_an_attempt_cut_to_exactly_the_minimum_is_kept_and_one_token_less_drops_the_group(how):
    """The right output's context holds int(0.4 x 30) = 12 tokens for the one wrong attempt (49 tokens): cut to 12,
    it is kept at bicc.min_attempt_tokens=12, and at 13 it is dropped, so the group keeps q."""
    g = group(["x" * 40 + "\\boxed{4}", "\\boxed{3}"], [0, 1])
    kept, dropped = (build_contexts(**g, bicc_cfg=BiccCfg(truncate=how, min_attempt_tokens=m), max_tokens=30) for m in (12, 13))
    assert kept.shown[1] == [0] and kept.cut[1] == [0] and kept.conditioned.all()
    assert kept.metrics["bicc/context_tokens"] == (9 + 12) / 2  # the right attempt whole, the wrong one cut to 12
    assert dropped.shown == [[], []] and not dropped.conditioned.any()
