import time

import pytest

from bicc.answers import last_boxed, normalize_answer
from bicc.rewards import exact_match_reward, extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{41}", "41"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept whole
        (r"first \boxed{1} then \boxed{2}", "2"),  # several boxes: the last
        (r"\boxed{\boxed{4}}", r"\boxed{4}"),  # outer box closes last
        (r"\boxed{3} and an unclosed \boxed{", "3"),  # unbalanced later box ignored
        (r"\boxed {7}", "7"),
        ("no answer here", None),
        ("The answer is 12.", "12"),
        ("The answer is -3 and then The answer is 1,234", "1,234"),
        (r"The answer is 5 but \boxed{6}", "6"),  # a box wins over the phrase
        (r"\boxed{5", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_empty_box():
    assert last_boxed(r"\boxed{}") == ""


@pytest.mark.parametrize("raw, norm", [("025", "25"), ("27.0", "27"), ("1,000", "1000"), (" $-3$ ", "-3"),
                                       ("0.50", "0.5"), ("x+1", "x+1"), (r"\text{B}", "B")])
def test_normalize(raw, norm):
    assert normalize_answer(raw) == norm


def test_reward_binary():
    assert exact_match_reward(r"12+3=15\n\boxed{15}", "15") == 1.0
    assert exact_match_reward(r"\boxed{16}", "15") == 0.0
    assert exact_match_reward("", "15") == 0.0


def test_adversarial_inputs_are_fast_and_safe():
    cases = ["9" * 100_000, "{" * 10_000 + "}" * 10_000, r"\boxed{" * 10_000, r"\boxed{__import__('os').system('id')}"]
    for text in cases:
        start = time.perf_counter()
        reward = exact_match_reward(text, "1")
        assert reward in (0.0, 1.0)
        assert time.perf_counter() - start < 2.0
