"""The answer checker: extraction per dataset, the fast path, math-verify under a deadline, and
untrusted outputs."""

import json
import time
from pathlib import Path

import pytest

from bicc.checking import MathChecker, canonical, extract


@pytest.fixture(scope="module")
def checker():
    c = MathChecker(extractors=("boxed", "answer_is"))
    c.pool.start()  # evaluation starts its workers once, before scoring
    yield c
    c.close()


def test_extractors_in_order():
    assert extract("so \\boxed{\\frac{1}{2}} done", ("boxed",)) == "\\frac{1}{2}"
    assert extract("outer \\boxed{a \\boxed{b} c}", ("boxed",)) == "a \\boxed{b} c"
    assert extract("The answer is 42. Next", ("boxed", "answer_is")) == "42"
    assert extract("Total 5.\n#### 1,234", ("gsm8k",)) == "1,234"
    assert extract("x\nA: 80 dollars", ("gsm8k",)) == "80"
    assert extract("numbers 3 and 7", ("boxed", "last_number")) == "7"
    assert extract("nothing here", ("boxed", "answer_is")) is None


def test_canonical_forms():
    assert canonical("\\dfrac{1}{2}") == canonical("\\frac{1}{2}")
    assert canonical("1,000") == "1000" and canonical("025") == "25" and canonical("27.0") == "27"
    assert canonical("\\text{(B)}") == "(B)" and canonical("90^\\circ") == "90"


def test_equivalences_through_math_verify(checker):
    cases = [("\\boxed{0.5}", "\\frac{1}{2}", 1.0), ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
             ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
             ("\\boxed{3}", "4", 0.0), ("The answer is 10000", "10{,}000", 1.0)]
    scores = checker.score_many([c[0] for c in cases], [c[1] for c in cases])
    assert scores == [c[2] for c in cases]


@pytest.mark.parametrize("name,text", [
    ("100k characters", "x" * 100_000 + "\\boxed{7}"),
    ("10k nested braces", "\\boxed{" + "{" * 10_000 + "7" + "}" * 10_000 + "}"),
    ("unclosed boxed", "the answer is \\boxed{7" + " and more" * 1000),
    ("code in a box", "\\boxed{__import__('os').system('touch /tmp/bicc_pwned')}"),
    ("code without dunder", "\\boxed{eval(\"1+1\")}"),
    ("huge power", "\\boxed{9^{9^{9^{9^{9}}}}}"),
    ("deep fraction", "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}"),
])
def test_untrusted_outputs_score_quickly_without_raising(checker, name, text):
    marker = Path("/tmp/bicc_pwned")
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    score = checker.score(text, "7")
    elapsed = time.perf_counter() - start
    assert score in (0.0, 1.0)
    assert elapsed < 2.0, f"{name}: {elapsed:.2f}s"
    assert not marker.exists()


def test_checker_agrees_with_labels_on_a_sample(shared_data):
    rows = [json.loads(line) for line in (shared_data / "labelled_completions.jsonl").read_text().splitlines()]
    math_rows = [r for r in rows if r["dataset"] == "MATH test"][:200]
    c = MathChecker(extractors=("boxed", "answer_is"))
    try:
        scores = c.score_many([r["completion"] for r in math_rows], [r["answer"] for r in math_rows])
    finally:
        c.close()
    agree = sum(int(s) == int(r["is_correct"]) for s, r in zip(scores, math_rows)) / len(math_rows)
    assert agree >= 0.98
