import copy
import random

import pytest

from bicc.data import build_task, encode_prompt
from bicc.data.rewards import exact_match_reward
from bicc.data.tasks.arith import _parse
from bicc.model.tokenizer import build_char_tokenizer


def evaluate_left_to_right(expression):
    operands, ops = _parse(expression)
    value = operands[0]
    for op, x in zip(ops, operands[1:]):
        value = value + x if op == "+" else value - x
    return value


def test_problems_are_deterministic_and_correct(cfg):
    task, again = build_task(cfg.data), build_task(cfg.data)
    for i in range(50):
        p = task.train_problem(i)
        assert p == again.train_problem(i)
        expression = p.prompt.removeprefix("Compute ").removesuffix(".")
        assert int(p.answer) == evaluate_left_to_right(expression)
        assert 2 <= len(_parse(expression)[0]) <= 3


def test_train_and_test_are_disjoint(cfg):
    task = build_task(cfg.data)
    test = {p.prompt for p in task.test_problems(500)}
    assert len(test) == 500
    train = {task.train_problem(i).prompt for i in range(5000)}
    assert not (train & test)


def test_demonstrations_without_slips_are_correct(cfg):
    cfg.data.arith.slip_rate = 0.0
    task = build_task(cfg.data)
    for i in range(100):
        p = task.train_problem(i)
        demo = task.demonstration(p, random.Random(i))
        assert exact_match_reward(demo, p.answer) == 1.0
        assert demo.count("\n") == len(_parse(p.prompt[8:-1])[1])


def test_slip_rate_is_respected(cfg):
    task = build_task(cfg.data)  # slip_rate 0.3 by default
    wrong = sum(exact_match_reward(task.demonstration(task.train_problem(i), random.Random(i)), task.train_problem(i).answer) == 0
                for i in range(2000))
    assert 0.25 < wrong / 2000 < 0.35


def test_prompt_encoding_round_trips():
    tok = build_char_tokenizer()
    ids = encode_prompt(tok, "Compute 12+3.")
    assert tok.decode(ids) == "<|im_start|>user\nCompute 12+3.<|im_end|>\n<|im_start|>assistant\n"


def test_too_small_a_problem_space_names_the_field_instead_of_looping():
    import pytest

    from tests.conftest import compose_cfg

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "data.arith.max_operands=2", "data.arith.max_operand=3",
                       "data.arith.test_size=50"])
    with pytest.raises(ValueError, match="data.arith.test_size"):
        build_task(cfg.data).test_problems(10)


def test_instruction_and_worked_example_change_the_prompt_not_the_problems(cfg):
    plain = build_task(cfg.data)
    dressed_cfg = copy.deepcopy(cfg.data)
    dressed_cfg.arith.instruction = "Put your final answer within \\boxed{}."
    dressed_cfg.arith.worked_example = True
    dressed = build_task(dressed_cfg)
    example = dressed.worked_example()
    for i in range(30):
        p, q = plain.train_problem(i), dressed.train_problem(i)
        assert p.prompt.startswith("Compute ") and "\n" not in p.prompt  # the default prompt is unchanged
        assert (q.id, q.answer) == (p.id, p.answer)
        assert q.prompt == f"{example}\n\n{p.prompt}\nPut your final answer within \\boxed{{}}."
        # the SFT demonstration reads the question, not the example
        assert dressed.demonstration(q, random.Random(i)) == plain.demonstration(p, random.Random(i))
    assert [(p.id, p.answer) for p in dressed.test_problems(50)] == [(p.id, p.answer) for p in plain.test_problems(50)]
    # the example: a training expression, each step right, the boxed value left to right
    header, question, *steps, boxed = example.split("\n")
    assert header == "Example:" and question.startswith("Compute ") and question.endswith(".")
    expression = question.removeprefix("Compute ").removesuffix(".")
    assert not plain._is_test(expression)
    operands, ops = _parse(expression)
    assert len(steps) == len(ops)
    for step in steps:
        left, right = step.split("=")
        assert evaluate_left_to_right(left) == int(right)
    assert boxed == f"\\boxed{{{evaluate_left_to_right(expression)}}}"


def test_extractors_choose_how_the_reward_reads_the_answer(cfg):
    task = build_task(cfg.data)
    p = task.train_problem(0)
    ends_on_equals = f"{p.prompt.removeprefix('Compute ').removesuffix('.')} = {p.answer}"
    boxed_wrong = f"\\boxed{{{int(p.answer) + 1}}} so {p.answer}"
    assert task.reward(ends_on_equals, p) == 0.0 and task.reward(boxed_wrong, p) == 0.0  # the task's own reading
    assert task.answer_anchors == ("\\boxed", "answer is")
    lenient_cfg = copy.deepcopy(cfg.data)
    lenient_cfg.arith.extractors = ["boxed", "last_number"]
    lenient = build_task(lenient_cfg)
    assert lenient.reward(ends_on_equals, p) == 1.0
    assert lenient.reward(boxed_wrong, p) == 0.0  # the box still wins over the last number
    assert lenient.reward(f"\\boxed{{{p.answer}}} then 3", p) == 1.0
    assert lenient.reward("no number", p) == 0.0
    assert lenient.answer_anchors == ("\\boxed",)  # last_number has no anchor
    bad_cfg = copy.deepcopy(cfg.data)
    bad_cfg.arith.extractors = ["boxed", "lastnumber"]
    with pytest.raises(ValueError, match="data.arith.extractors.*lastnumber"):
        build_task(bad_cfg)
