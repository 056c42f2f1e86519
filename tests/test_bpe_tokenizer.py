"""BiCC's contexts, prompts, end tokens, answers and evaluation on a real tokenizer: SmolLM2's byte-level BPE
with its ChatML template (tests/fixtures/smollm2_tokenizer), where pad = EOS = <|im_end|> and an anchor such as
``\\boxed`` is split across tokens that also carry the preceding space."""

import tempfile

import pytest
import torch

from bicc.data import encode_prompt
from bicc.data.answers import answer_anchors, extract
from bicc.method.conditioning import _encode_template, answer_start, build_contexts, context_budget, truncate
from bicc.model.load import end_token_ids
from tests.conftest import compose_cfg
from tests.helpers import BiccCfg, bpe_tokenizer, tiny_llama

PROMPT = "Tom has 12 apples and buys 7 more. How many apples does he have?"
EXTRACTORS = ["answer_line", "boxed", "answer_is"]
ANCHORS = answer_anchors(EXTRACTORS)
# two right attempts, three wrong ones; each final answer in another of the three formats the checker reads
ATTEMPTS = [("He starts with 12 and buys 7 more, so 12 + 7 = 19.\nThe answer is 19.", "19", 1),
            ("12 plus 7 makes 19 apples in total. \\boxed{19}", "19", 1),
            ("12 - 7 = 5, so he has 5 apples left over after buying them. \\boxed{5}", "5", 0),
            ("Adding the two numbers of apples gives 12 + 7 = 18.\nAnswer: 18", "18", 0),
            ("Tom has 84 apples because 12 times 7 is 84, which is the answer here.\\boxed{84}", "84", 0)]


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def shown_attempts(context, tok, cfg, shown):
    """The attempt ids of a context, read back between the template's pieces and its numbered headers."""
    enc = _encode_template(tok, PROMPT, cfg, shown)
    start, end = len(enc.head) + len(enc.preamble), len(context) - len(enc.tail)
    assert context[:start] == enc.head + enc.preamble and context[end:] == enc.tail
    body, parts = context[start:end], []
    for i, header in enumerate(enc.headers):
        assert body[:len(header)] == header, f"header {i + 1}"
        body = body[len(header):]
        nxt = enc.headers[i + 1] if i + 1 < shown else None
        cut = next(j for j in range(len(body) + 1) if nxt is None and j == len(body) or
                   nxt is not None and body[j:j + len(nxt)] == nxt)
        parts.append(body[:cut])
        body = body[cut:]
    return parts


def test_the_fixture_leaves_no_temp_dir_behind(tmp_path, monkeypatch):
    """The tokenizer is read whole from its unpacked files, which are then deleted (a 3.5 MB dir per test session
    otherwise); it still encodes, decodes and saves."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where tempfile makes its dirs
    tok = bpe_tokenizer.__wrapped__()
    assert list(tmp_path.iterdir()) == []
    assert tok.decode(ids_of(tok, PROMPT)) == PROMPT
    tok.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "tokenizer.json").stat().st_size > 1_000_000


def test_the_prompt_is_the_chatml_user_turn_and_im_end_ends_an_output():
    tok = bpe_tokenizer()
    text = tok.decode(encode_prompt(tok, PROMPT))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    assert end_token_ids(tok, tiny_llama(tok)) == [tok.convert_tokens_to_ids("<|im_end|>")] == [tok.pad_token_id]


@pytest.mark.parametrize("max_tokens", [400, 120, 90])  # every attempt whole; cut; cut hard
def test_contexts_show_the_opposite_side_exactly_within_the_budget(max_tokens):
    tok = bpe_tokenizer()
    cfg = BiccCfg(max_tokens=max_tokens, min_attempt_tokens=8, elision=" ... ")
    sampled = [ids_of(tok, text) + [tok.eos_token_id] for text, _, _ in ATTEMPTS]
    before = [list(s) for s in sampled]
    correct = torch.tensor([c for _, _, c in ATTEMPTS], dtype=torch.float)
    out = build_contexts([PROMPT] * 5, sampled, correct, torch.zeros(5, dtype=torch.long), tok, cfg, max_tokens,
                         [encode_prompt(tok, PROMPT)] * 5, end_ids=[tok.eos_token_id], anchors=ANCHORS)
    assert sampled == before  # the sampled ids are the policy's outputs: never re-tokenised or changed
    budget, elision = context_budget(cfg, max_tokens), ids_of(tok, cfg.elision)
    cuts = 0
    for r in range(5):
        assert out.conditioned[r]
        opposite = [i for i in range(5) if ATTEMPTS[i][2] != ATTEMPTS[r][2]]
        parts = shown_attempts(out.prompt_ids[r], tok, cfg, len(opposite))
        assert len(parts) == len(opposite)  # none dropped at these budgets
        for part, i in zip(parts, opposite):  # in order, each from the opposite side
            whole = sampled[i][:-1]  # the output's own ids, its end token stripped
            if part != whole:  # cut in the middle: its head, the marker, and the tail from the final answer on
                cuts += 1
                tail = whole[answer_start(whole, tok, ANCHORS):]
                head = len(part) - len(elision) - len(tail)
                assert head > 0 and part[:head] == whole[:head] and part[head:head + len(elision)] == elision
                assert part[head + len(elision):] == tail
            assert extract(tok.decode(part), EXTRACTORS) == ATTEMPTS[i][1]
        used = sum(len(p) for p in parts)
        wanted = sum(len(sampled[i]) - 1 for i in opposite)
        assert used == min(wanted, budget)  # exact in tokens: all of it, or the whole budget when cut
    assert (cuts > 0) == (max_tokens < 400)


@pytest.mark.parametrize("ending", ["\\boxed{7}", " \\boxed{7}", "\n\\boxed{7}", "So the answer is 7.",
                                    "\nThe answer is 7", "\nAnswer: 7", "\n\nAnswer: 7", " \nAnswer: 7"])
@pytest.mark.parametrize("keep", [14, 18, 25])
def test_middle_truncation_keeps_the_answer_line_whatever_the_split(ending, keep):
    tok = bpe_tokenizer()
    ids = ids_of(tok, "First we add the tens, then the units, and we carry one when the sum passes nine. " * 2 + ending)
    elision = ids_of(tok, " ... ")
    cut = truncate(ids, keep, "middle", elision, answer_start(ids, tok, ANCHORS), min_tokens=8)
    kept = tok.decode(cut)
    anchor = next(a for a in ANCHORS if a in ending)
    assert len(cut) == keep and kept.endswith(ending[ending.index(anchor):]) and " ... " in kept
    if ending.lstrip(" ").startswith("\n" + anchor):  # an answer that began a line still begins one
        assert kept.endswith(" ... \n" + ending.strip())
    assert extract(kept, EXTRACTORS) == "7"  # Answer: X is read only at a line start


def test_hf_engine_ends_outputs_at_im_end_although_it_is_also_the_pad():
    """pad = EOS: the engine cuts each output after its first <|im_end|>, pads never count as tokens; the texts
    are the outputs without it."""
    from bicc.rollout import EngineOptions, SamplingParams, build_engine

    tok = bpe_tokenizer()
    model = tiny_llama(tok)
    prompts = [encode_prompt(tok, PROMPT), encode_prompt(tok, "What is 2 + 2?")]
    with torch.no_grad():  # <|im_end|>'s output row along the mean hidden state: outputs end at many lengths
        hidden = model(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.model.embed_tokens.weight[tok.eos_token_id] = 10 * hidden / hidden.norm() ** 2  # logit 10 there
    engine = build_engine("hf", model, tok, compose_cfg([]).rollout, EngineOptions(end_ids=(tok.eos_token_id,)))
    out = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0))
    lengths = [len(c) for c in out.completion_ids]
    assert sum(out.finished) >= 4 and len(set(lengths)) >= 3  # not vacuous: many end early, at several lengths
    for ids, finished, text in zip(out.completion_ids, out.finished, out.texts):
        assert (tok.eos_token_id in ids) == finished
        if finished:
            assert ids.index(tok.eos_token_id) == len(ids) - 1
        assert text == tok.decode([t for t in ids if t != tok.eos_token_id])
        assert "<|im_end|>" not in text
