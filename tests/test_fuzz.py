"""Property tests: untrusted strings through extraction, the checker's fast path and the reward, and
arbitrary groups through the BiCC context builder. Nothing may raise or run long."""

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bicc.data.answers import canonical, extract
from bicc.data.checking import MathChecker
from bicc.data.rewards import exact_match_reward
from bicc.method.conditioning import build_contexts
from tests.helpers import BiccCfg, enc, group

# The answer checker scores in worker processes (math-verify under a deadline).
pytestmark = pytest.mark.launch

LATEX_BITS = st.sampled_from(["\\boxed{", "{", "}", "\\frac", "\\sqrt", "^", "_", "$", "\\left(", "\\right)", "1", "-",
                              "answer is", "####", "A:", "\\", "\n", "__import__", "e9", "9^{9^{9}}", ",", ".", " "])
NASTY = st.one_of(st.text(max_size=300), st.lists(LATEX_BITS, max_size=200).map("".join))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(NASTY, st.text(max_size=20))
def test_extraction_and_fast_path_never_raise(text, gold):
    start = time.perf_counter()
    for extractors in (("boxed", "answer_is"), ("gsm8k", "boxed", "answer_is", "last_number")):
        found = extract(text, extractors)
        assert found is None or isinstance(found, str)
    canonical(text)
    assert exact_match_reward(text, gold or "0") in (0.0, 1.0)
    assert time.perf_counter() - start < 0.5


CHECKER = MathChecker(extractors=("boxed", "answer_is"), deadline_s=1.5)


def setup_module():
    CHECKER.pool.start()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(NASTY, min_size=1, max_size=4))
def test_checker_scores_any_text_within_its_deadline(texts):
    start = time.perf_counter()
    scores = CHECKER.score_many(texts, ["\\frac{1}{2}"] * len(texts))
    assert all(s in (0.0, 1.0) for s in scores)
    # each item is under the 1.5 s deadline; a worker killed at its deadline restarts in the background
    # (a few seconds of imports), which can hold back the next item
    assert time.perf_counter() - start < 1.5 * len(texts) + 6.0


@SETTINGS
@given(st.lists(st.tuples(st.text(alphabet="0123456789+-=\\boxed{} \n", max_size=80), st.booleans()),
                min_size=2, max_size=8),
       st.sampled_from([0.2, 0.4, 0.6]), st.sampled_from(["middle", "head", "tail"]),
       st.sampled_from(["partition", "paired"]), st.integers(1, 3), st.integers(1, 20))
def test_context_builder_on_arbitrary_groups(samples, ratio, how, mode, k, min_tokens):
    # each output starts and ends with its partition's mark (R: right, W: wrong; neither is in the alphabet,
    # the prompt or the template), so a context shows which partition its attempts came from
    texts = [("R" if c else "W") + t + ("R" if c else "W") for t, c in samples]
    correct = [1.0 if c else 0.0 for _, c in samples]
    cfg = BiccCfg(context_ratio=ratio, truncate=how, mode=mode, paired_k=k, min_attempt_tokens=min_tokens)
    g = group(texts, correct)
    ctx = build_contexts(g["prompts"], g["completion_ids"], g["correct"], g["group_ids"], g["tokenizer"], cfg, 64,
                         g["plain_prompt_ids"])
    budget = int(ratio * 64)
    template = len(enc(cfg.preamble)) + len(enc(cfg.attempt_header.format(i=1))) * len(texts)
    for i, ids in enumerate(ctx.prompt_ids):
        assert all(isinstance(t, int) for t in ids)
        if not ctx.conditioned[i]:
            assert ids == g["plain_prompt_ids"][i]  # fallback keeps q exactly
        else:
            extra = len(ids) - len(g["plain_prompt_ids"][i])
            assert 0 < extra <= budget + template + len(enc(cfg.elision)) * len(texts)
            shown = g["tokenizer"].decode(ids)
            own, opposite = ("R", "W") if correct[i] else ("W", "R")
            assert own not in shown and opposite in shown  # x+ = [q; O-], x- = [q; O+]
    if all(correct) or not any(correct):
        assert not ctx.conditioned.any()
    assert len(ctx.prompt_ids) == len(texts) and ctx.conditioned.dtype == torch.bool


def teardown_module():
    CHECKER.close()
