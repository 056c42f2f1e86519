"""Benchmark files: the shared sets load with their sizes; bad rows name file and line or are skipped."""

import pytest

from bicc.data.benchmarks import BadRowError, load_problems


@pytest.mark.parametrize("name,count", [("math500", 500), ("amc23", 40), ("aime24", 30), ("aime25", 30),
                                        ("gsm8k_test", 1319)])
def test_shared_benchmarks_load_with_their_counts(shared_data, name, count):
    problems, skipped = load_problems(str(shared_data / f"{name}.jsonl"))
    assert len(problems) == count and skipped == {}
    assert all(p.prompt and p.answer for p in problems)
    assert len({p.id for p in problems}) == count


def test_limit(shared_data):
    problems, _ = load_problems(str(shared_data / "math500.jsonl"), limit=20)
    assert len(problems) == 20


BAD = [
    (b'{"id": "a", "problem": "p", "answer": "1"}\n{"id": "b", "problem": "q"}\n', "line 2", "missing field 'answer'"),
    (b'{"id": "a", "problem": "p", "answer": " "}\n', ":1", "empty field 'answer'"),
    (b'{"id": "a", "problem": "p", "answer": "1"}\nnot json\n', ":2", "not JSON"),
    (b'{"id": "a", "problem": "p", "answer": "1"}\n{"id": "a", "problem": "q", "answer": "2"}\n', ":2", "duplicate id"),
    (b'{"id": "a", "problem": "p\xff", "answer": "1"}\n', ":1", "not UTF-8"),
    (b'[1, 2]\n', ":1", "not a JSON object"),
]


@pytest.mark.parametrize("content,where,what", BAD)
def test_bad_rows_raise_naming_file_and_line(tmp_path, content, where, what):
    path = tmp_path / "bench.jsonl"
    path.write_bytes(content)
    with pytest.raises(BadRowError) as err:
        load_problems(str(path))
    message = str(err.value)
    assert str(path) in message and what in message
    assert f"{path}{where}" in message or f"{path}:{where.split()[-1]}" in message


def test_skip_mode_counts_and_keeps_good_rows(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    path.write_bytes(b"".join(c for c, _, _ in BAD) + b'{"id": "z", "problem": "ok", "answer": "3"}\n')
    problems, skipped = load_problems(str(path), on_bad_row="skip")
    # kept: the first "a" and "z"; skipped: b (no answer), the empty answer, three later "a"s, the
    # non-JSON line, the non-UTF-8 line and the non-object
    assert [p.id for p in problems] == ["a", "z"]
    assert sum(skipped.values()) == 8 and skipped["duplicate id 'a'"] == 3
    assert "skipped" in capsys.readouterr().out


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(str(tmp_path / "nope.jsonl"))


def test_math_task_trains_on_files_with_the_checker_as_reward(shared_data):
    from types import SimpleNamespace

    from bicc.config import MathDataConfig
    from bicc.data import build_task

    cfg = SimpleNamespace(task="math", math=MathDataConfig(train_source=str(shared_data / "gsm8k_train.jsonl"),
                                                           test_source=str(shared_data / "gsm8k_test.jsonl"),
                                                           extractors=["gsm8k", "boxed", "answer_is"]))
    task = build_task(cfg)
    try:
        first = task.train_problem(0)
        assert first.answer == "72" and "\\boxed{}" in first.prompt
        assert task.train_problem(len(task.train)) == first  # the stream wraps around
        assert len(task.test_problems(10)) == 10
        assert task.reward_many(["so 48+24 = \\boxed{72}", "#### 71", "A: 72"], [first] * 3) == [1.0, 0.0, 1.0]
    finally:
        task.checker.close()
