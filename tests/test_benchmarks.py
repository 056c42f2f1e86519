"""Benchmark files: the sets shipped in data/ load with their sizes and checksums, every default path points
inside the repo, an absent file falls back to the benchmark's HF dataset; bad rows name file and line or are
skipped."""

import hashlib
import json
import re
from pathlib import Path

import pytest

from bicc.data.benchmarks import BadRowError, load_problems
from tests.helpers import ROOT

DATA = ROOT / "data"


@pytest.mark.parametrize("name,count", [("math500", 500), ("amc23", 40), ("aime24", 30), ("aime25", 30),
                                        ("gsm8k_test", 1319), ("math_train", 7470)])
def test_shipped_benchmarks_load_with_their_counts(name, count):
    problems, skipped = load_problems(str(DATA / f"{name}.jsonl"))
    assert len(problems) == count and skipped == {}
    assert all(p.prompt and p.answer for p in problems)
    assert len({p.id for p in problems}) == count


def test_shipped_files_match_their_provenance():
    """Every data file is listed in data/SOURCES.md with its row count and sha256, and matches it."""
    table = {m.group(1): (int(m.group(2)), m.group(3))
             for m in re.finditer(r"^\| (\S+\.jsonl) \| (\d+) \| ([0-9a-f]{64}) \|", (DATA / "SOURCES.md").read_text(), re.M)}
    shipped = sorted(p.name for p in DATA.glob("*.jsonl"))
    assert shipped and sorted(table) == shipped
    for name, (rows, sha) in table.items():
        raw = (DATA / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == sha and raw.count(b"\n") == rows, name


def test_no_default_path_leaves_the_repo(monkeypatch):
    from tests.conftest import compose_cfg

    monkeypatch.delenv("BICC_DATA_DIR", raising=False)
    monkeypatch.delenv("BICC_DAPO_MATH", raising=False)
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert "../shared" not in path.read_text(), path
    sources = []
    for eval_name in ("paper", "math500", "amc23", "aime24", "aime25", "gsm8k"):
        sources += [b.source for b in compose_cfg([f"eval={eval_name}"]).eval.benchmarks]
    for data in ("math_train", "dapo_math17k"):
        math = compose_cfg([f"data={data}"]).data.math
        sources += [math.test_source] + ([math.train_source] if data == "math_train" else [])
    for source in sources:
        assert Path(source).parent == DATA and Path(source).exists(), source


def test_an_absent_file_falls_back_to_the_benchmarks_hub_dataset(monkeypatch, tmp_path, capsys):
    """eval.data_dir without the file: the benchmark's ``hub`` dataset, read with its own field names."""
    from bicc.data import benchmarks
    from bicc.evaluation.evaluate import FileBenchmark
    from tests.conftest import compose_cfg

    asked = []

    def hub(dataset_id, split, subset=None, revision=None):  # a stand-in for datasets.load_dataset: AMC23's layout
        asked.append((dataset_id, split, subset, revision)[: 2 if subset is None and revision is None else 4])
        yield from enumerate([{"question": "What is 1+1?", "answer": 2.0, "id": 7},
                              {"question": "What is 2+2?", "answer": 4.0, "id": 8}], 1)

    monkeypatch.setattr(benchmarks, "_rows_hub", hub)
    cfg = compose_cfg(["eval=amc23", f"eval.data_dir={tmp_path}"])
    problems = FileBenchmark(cfg.eval.benchmarks[0], None, cfg.eval).problems()
    assert asked == [("math-ai/amc23", "test")]
    assert [(p.id, p.prompt, p.answer) for p in problems] == [("7", "What is 1+1?", "2.0"), ("8", "What is 2+2?", "4.0")]
    assert "amc23.jsonl is absent" in capsys.readouterr().out
    cfg = compose_cfg(["eval=gsm8k", f"eval.data_dir={tmp_path}"])  # no hub fallback: the absent file is named
    with pytest.raises(FileNotFoundError, match="gsm8k_test.jsonl"):
        FileBenchmark(cfg.eval.benchmarks[0], None, cfg.eval).problems()


def test_limit():
    problems, _ = load_problems(str(DATA / "math500.jsonl"), limit=20)
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


def test_a_repeated_problem_with_another_answer_follows_on_bad_row(tmp_path):
    """DAPO-Math-17k's HF copy repeats each prompt; one repeated with another answer stopped the run even under
    on_bad_row=skip. Now: an error naming both lines, or under skip the later row is skipped and counted."""
    rows = [("p1", "1"), ("p2", "2"), ("p1", "1"), ("p1", "7"), ("p3", "3")]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps({"problem": t, "answer": a, "id": f"x{i}"}) + "\n" for i, (t, a) in enumerate(rows)))
    with pytest.raises(BadRowError, match=r"dapo.jsonl:4: problem repeats line 1 with answer '7' instead of '1'"):
        load_problems(str(path), dedupe=True)
    problems, skipped = load_problems(str(path), dedupe=True, on_bad_row="skip")
    assert [(p.prompt, p.answer) for p in problems] == [("p1", "1"), ("p2", "2"), ("p3", "3")]
    assert skipped == {"repeated problem": 1, "repeated problem with another answer": 1}


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


def test_each_epoch_walks_every_row_in_an_order_of_its_own_fixed_by_the_index(tmp_path):
    """Under data.math.shuffle epoch e reads the 20 rows in an order drawn from (data.seed, e): every row once per
    epoch; epoch 0 in data.seed's order (as before epochs had orders of their own); epoch 1 in another; the same
    row for the same index in a task built afresh (a resumed process), also read backwards across the wrap (shards
    read two epochs about it). Without shuffle, every epoch in the file's order. A task smaller than one step's
    prompts is read the same way: a step of 8 prompts over 3 rows takes whole epochs and the start of the next."""
    import torch

    from bicc.data import build_task
    from tests.conftest import compose_cfg

    def task(rows, *extra):
        path = tmp_path / f"rows{rows}.jsonl"
        path.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1), "id": f"r{i}"}) + "\n"
                                for i in range(rows)))
        return build_task(compose_cfg(["data=jsonl", f"data.math.train_source={path}", f"data.math.test_source={path}",
                                       "data.seed=3", *extra]).data)

    shuffled, again, plain, small = task(20, "data.math.shuffle=true"), task(20, "data.math.shuffle=true"), task(20), \
        task(3, "data.math.shuffle=true")
    try:
        ids = [shuffled.train_problem(i).id for i in range(60)]
        epochs = [ids[0:20], ids[20:40], ids[40:60]]
        assert all(sorted(e) == sorted(f"r{i}" for i in range(20)) for e in epochs)
        assert epochs[0] == [f"r{i}" for i in torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()]
        assert epochs[0] != epochs[1] != epochs[2]
        assert [again.train_problem(i).id for i in reversed(range(60))] == ids[::-1]
        assert [plain.train_problem(i).id for i in range(40)] == [f"r{i % 20}" for i in range(40)]
        step = [small.train_problem(i).id for i in range(8)]
        assert sorted(step[:3]) == sorted(step[3:6]) == ["r0", "r1", "r2"] and set(step[6:]) <= {"r0", "r1", "r2"}
    finally:
        for t in (shuffled, again, plain, small):
            t.checker.close()


def test_data_jsonl_trains_on_a_local_file_with_its_own_field_names(tmp_path):
    """``data=jsonl``: a local JSONL with other field names, scored by the checker; without its files the error
    names the field before any file or model is read."""
    from bicc.data import build_task
    from bicc.trainer.validation import validate
    from tests.conftest import compose_cfg

    rows = [{"uid": f"r{i}", "question": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(1, 4)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = ["data.math.problem_field=question", "data.math.answer_field=solution", "data.math.id_field=uid"]
    cfg = compose_cfg(["data=jsonl", f"data.math.train_source={tmp_path / 'mine.jsonl'}",
                       f"data.math.test_source={tmp_path / 'mine.jsonl'}", *fields])
    task = build_task(cfg.data)
    try:
        first = task.train_problem(0)
        assert (first.id, first.answer) == ("r1", "2") and first.prompt.startswith("What is 1 + 1?")
        assert [p.id for p in task.test_problems(3)] == ["r1", "r2", "r3"]
        assert task.reward_many(["so \\boxed{2}", "\\boxed{3}"], [first, first]) == [1.0, 0.0]
    finally:
        task.checker.close()
    validate(cfg)
    with pytest.raises(ValueError, match="'data.math.test_source': is empty"):
        validate(compose_cfg(["data=jsonl", f"data.math.train_source={tmp_path / 'mine.jsonl'}", *fields]))
    with pytest.raises(ValueError, match="'data.math.train_source': is empty"):
        validate(compose_cfg(["data=jsonl", *fields]))


# ---- One loader for every form a dataset comes in ---------------------------------------------------------------

GSM8K_LIKE = [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2 #### 2", "meta": {"uid": "a"}},
              {"question": "What is 2 + 3?", "answer": "2 + 3 = 5 #### 5", "meta": {"uid": "b"}},
              {"question": "What is 4 + 4?", "answer": "#### 8", "meta": {"uid": "c"}}]
GSM8K_FIELDS = dict(problem="question", answer="answer", id="meta.uid")


@pytest.fixture
def written(tmp_path, monkeypatch):
    """The same three rows as JSONL, parquet, a ``save_to_disk`` dir (splits train and test) and a dataset repo dir
    with two subsets ("main", "socratic"; its README's ``configs``), all written here (no network)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_LIKE))
    table = datasets.Dataset.from_list(GSM8K_LIKE)
    table.to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict({"train": table, "test": table.select([2])}).save_to_disk(str(tmp_path / "saved"))
    repo = tmp_path / "repo"
    for subset, rows in (("main", GSM8K_LIKE), ("socratic", GSM8K_LIKE[:1])):
        (repo / subset).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(repo / subset / "train-00000-of-00001.parquet"))
    (repo / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {name}\n  data_files:\n  - split: train\n    path: {name}/train-*\n"
        for name in ("main", "socratic")) + "---\n")
    return tmp_path


@pytest.mark.parametrize(("source", "split", "subset", "count"), [
    ("rows.jsonl", "train", None, 3), ("rows.parquet", "train", None, 3), ("saved", "train", None, 3),
    ("saved", "test", None, 1), ("repo", "train", "main", 3), ("repo", "train", "socratic", 1)])
def test_every_form_loads_through_one_loader_with_a_column_map(written, source, split, subset, count):
    from bicc.data.benchmarks import FieldNames

    problems, _ = load_problems(str(written / source), FieldNames(**GSM8K_FIELDS), split, subset=subset)
    assert len(problems) == count
    expected = GSM8K_LIKE[2:] if (source, split) == ("saved", "test") else GSM8K_LIKE[:count]
    assert [(p.id, p.prompt, p.answer) for p in problems] == [(r["meta"]["uid"], r["question"], r["answer"])
                                                              for r in expected]


def test_a_bad_row_of_a_dataset_names_it_its_split_and_the_row(written):
    import datasets

    from bicc.data.benchmarks import FieldNames

    bad = [*GSM8K_LIKE[:2], {"question": "", "answer": "#### 1", "meta": {"uid": "d"}}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(bad)}).save_to_disk(str(written / "bad"))
    with pytest.raises(BadRowError, match=r"bad\[train\] row 3: empty field 'question'"):
        load_problems(str(written / "bad"), FieldNames(**GSM8K_FIELDS), "train")
    with pytest.raises(KeyError, match="no split 'validation'; it has \\['train'\\]"):
        load_problems(str(written / "bad"), FieldNames(**GSM8K_FIELDS), "validation")


def test_an_hf_id_passes_its_subset_split_and_revision(monkeypatch):
    """openai/gsm8k needs its subset ("main"); a revision pins the data a run read."""
    import datasets

    asked = []

    def load_dataset(dataset_id, name=None, split=None, revision=None):
        asked.append((dataset_id, name, split, revision))
        return datasets.Dataset.from_list(GSM8K_LIKE)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    from bicc.data.benchmarks import FieldNames

    problems, _ = load_problems("openai/gsm8k", FieldNames(**GSM8K_FIELDS), "train", subset="main", revision="e53f048")
    assert asked == [("openai/gsm8k", "main", "train", "e53f048")] and len(problems) == 3


def test_data_math_reads_a_dataset_by_subset_and_split(written):
    """data.math.subset, .train_split and .test_split through the math task."""
    from bicc.data import build_task
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["data=jsonl", f"data.math.train_source={written / 'repo'}", "data.math.subset=main",
                       f"data.math.test_source={written / 'saved'}", "data.math.test_subset=null",
                       "data.math.test_split=test", "data.math.problem_field=question", "data.math.id_field=meta.uid"])
    task = build_task(cfg.data)
    try:
        assert [task.train_problem(i).id for i in range(3)] == ["a", "b", "c"]
        assert [p.id for p in task.test_problems(5)] == ["c"]
    finally:
        task.checker.close()


def test_without_datasets_the_error_names_the_install(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "datasets" else real(name, *a, **k))
    with pytest.raises(ImportError, match="needs the `datasets` package \\(in requirements.txt"):
        load_problems("openai/gsm8k", split="train")
