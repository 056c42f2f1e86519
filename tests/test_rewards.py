import re
import time

import pytest

from bicc.data.answers import last_boxed, normalize_answer
from bicc.data.rewards import exact_match_reward, extract_answer


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


# ---- a reward named by dotted path (data.reward) ------------------------------------------------------------

def task_with(reward, batched=False):
    from bicc.data import build_task
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["sft.cache_dir=/tmp/unused", f"data.reward={reward}", f"data.reward_batched={batched}"])
    return build_task(cfg.data)


def test_a_reward_by_path_replaces_the_tasks_in_rollouts_and_evaluation():
    from bicc.evaluation.evaluate import TaskBenchmark

    task = task_with("tests.rewards:length_parity")
    problem = task.train_problem(3)
    assert problem.prompt.startswith("Compute ")  # problems stay the task's
    assert task.reward_many(["ab", "abc", ""], [problem] * 3) == [1.0, 0.0, 1.0]
    right = rf"\boxed{{{problem.answer}}}x"  # 11 characters: the task's reward 1, the named one 0
    assert task.task.reward(right, problem) == 1.0 and task.reward(right, problem) == 0.0
    bench = TaskBenchmark(None, task, type("E", (), {"limit": 2, "num_problems": 2})())
    assert bench.score_many(["ab", "a"], bench.problems()) == [1.0, 0.0]


def test_a_batched_reward_sees_a_groups_rows_together():
    task = task_with("tests.rewards:first_of_group", batched=True)
    kept = [task.train_problem(i) for i in range(12)]
    a, b = [p for p in kept if not __import__("tests.rewards").rewards.degenerate(p)][:2]
    # G = 3 rows of a, then 2 of b: the first row of each group is right
    assert task.reward_many(["x"] * 5, [a, a, a, b, b]) == [1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("path, batched, says", [
    ("tests.rewards", False, "not of the form"),
    ("tests.no_such_module:score", False, "cannot import"),
    ("tests.rewards:no_such_function", False, "cannot import"),
    ("tests.rewards:takes_one", False, "must take (completion, problem)"),
    ("tests.rewards:length_parity", True, "not a list of one number per completion"),
    ("tests.rewards:returns_text", False, "returned '1'"),
    ("tests.rewards:returns_nan", False, "returned nan"),
])
def test_a_bad_reward_path_is_an_error_naming_the_field(path, batched, says):
    with pytest.raises(ValueError, match="data.reward") as err:
        task_with(path, batched)
    assert says in str(err.value)


def test_a_bad_value_at_run_time_names_the_problem():
    from tests import rewards

    task = task_with("tests.rewards:length_parity")
    task.functions[0].fn = rewards.returns_text  # passed the start-up check, then returned text
    with pytest.raises(ValueError, match="tests.rewards:length_parity .* returned '1' on sample 0 of 2 "
                                         "\\(problem arith-train-0\\)"):
        task.reward_many(["ab", "a"], [task.train_problem(0), task.train_problem(1)])


# ---- Rewards as TRL users write them, several with weights ---------------------------------------------------

def trl_task(*extra):
    from bicc.data import build_task
    from tests.conftest import compose_cfg

    return build_task(compose_cfg(["sft.cache_dir=/tmp/unused", *extra]).data)


def test_trl_style_rewards_with_weights_are_summed_and_kept_by_name():
    """A reward written in TRL's form (keyword columns, a list back) and one taking prompts too, weighted 1 and 0.5:
    the sum is the reward, each function's values are kept under its name."""
    task = trl_task("data.rewards=[tests.rewards:boxed_is_ground_truth,tests.rewards:brevity]",
                    "data.reward_weights=[1.0,0.5]")
    p = task.train_problem(0)
    right, wrong = rf"so \boxed{{{p.answer}}}", r"\boxed{-1}"
    total, parts = task.score([right, wrong], [p, p])
    assert parts["boxed_is_ground_truth"] == [1.0, 0.0]
    assert parts["brevity"] == [-len(right) / 100, -len(wrong) / 100]
    assert total == pytest.approx([1.0 - 0.5 * len(right) / 100, -0.5 * len(wrong) / 100])
    assert task.reward_many([right], [p]) == pytest.approx([1.0 - 0.5 * len(right) / 100])


@pytest.mark.parametrize(("reward", "says"), [
    ("tests.rewards:one_short", "returned 1 values for 2 completions on sample 0 of 2"),
    ("tests.rewards:fails_on_long", "raised RuntimeError: too long on sample 0 of 2"),
])
def test_a_failing_trl_reward_names_itself_and_the_sample_or_scores_0_when_asked(reward, says):
    task = trl_task(f"data.rewards=[{reward}]")
    p = task.train_problem(0)
    with pytest.raises(ValueError, match=re.escape(f"{reward} (data.rewards) {says}")):
        task.score(["long one", "x"], [p, p])
    forgiving = trl_task(f"data.rewards=[{reward}]", "data.reward_errors=zero")
    total, parts = forgiving.score(["long one", "x"], [p, p])
    assert total == [0.0, 0.0] and parts["scoring_errors"] == [1.0, 1.0]


def test_zero_on_error_zeroes_the_failing_sample_of_the_failing_function_alone():
    """Under data.reward_errors=zero a NaN for sample 1 scores that sample 0 for that function only: its neighbours
    keep their values, and the sample keeps the other function's."""
    task = trl_task("data.rewards=[tests.rewards:nan_on_long,tests.rewards:brevity]", "data.reward_errors=zero")
    p = task.train_problem(0)
    total, parts = task.score(["x", "long one", "abc"], [p, p, p])
    assert parts["nan_on_long"] == [1.0, 0.0, 3.0] and parts["scoring_errors"] == [0.0, 1.0, 0.0]
    assert parts["brevity"] == [-0.01, -0.08, -0.03]
    assert total == pytest.approx([0.99, -0.08, 2.97])


def test_data_reward_and_data_rewards_are_not_both_set():
    with pytest.raises(ValueError, match="'data.reward' and 'data.rewards': set one"):
        trl_task("data.reward=tests.rewards:length_parity", "data.rewards=[tests.rewards:brevity]")
    with pytest.raises(ValueError, match="'data.reward_weights': 1 weights for 2 rewards"):
        trl_task("data.rewards=[tests.rewards:brevity,tests.rewards:boxed_is_ground_truth]", "data.reward_weights=[1.0]")
