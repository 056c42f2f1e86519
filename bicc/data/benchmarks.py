"""Math benchmarks and training sets through one loader: a local JSONL or parquet file, a directory saved by
``datasets`` (``save_to_disk``), or a Hugging Face dataset id (or a local dataset directory of data files) with its
subset (config name), split and revision. A column map (``FieldNames``) names the problem, answer and id fields,
dotted paths reaching into nested ones.

Rows are validated as they load: a line that is not UTF-8 or not JSON, a missing or empty problem or
answer, or a duplicate id is an error naming the dataset, its split and the row (a file's line). With
``on_bad_row="skip"`` such rows are skipped instead, counted by reason, and summarised in one line; nothing is
dropped silently.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bicc.data import Problem

BAD_ROW_POLICIES = ("error", "skip")


class BadRowError(ValueError):
    pass


@dataclass
class FieldNames:
    problem: str = "problem"
    answer: str = "answer"
    id: str = "id"


def _rows_jsonl(path: Path):
    """(line number, parsed object or an error message) for each non-blank line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, f"not UTF-8 ({err.reason} at byte {err.start})"
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                yield number, f"not JSON ({err.msg} at column {err.colno})"


def _rows_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    for number, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield number, row


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {what} needs the `datasets` package (in requirements.txt: make setup, or pip "
                          "install datasets), or point the source at a local JSONL or parquet file") from None
    return datasets


def _rows_hub(dataset_id: str, split: str, subset: str | None = None, revision: str | None = None):
    datasets = _datasets(f"the HF dataset {dataset_id!r}")
    for number, row in enumerate(datasets.load_dataset(dataset_id, name=subset, split=split, revision=revision), 1):
        yield number, dict(row)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (one split, or a dict of splits)."""
    return path.is_dir() and any((path / name).exists() for name in ("dataset_dict.json", "state.json"))


def _rows_saved(path: Path, split: str):
    saved = _datasets(f"the saved dataset {path}").load_from_disk(str(path))
    if hasattr(saved, "keys"):  # a DatasetDict
        if split not in saved:
            raise KeyError(f"{path}: no split {split!r}; it has {sorted(saved.keys())}")
        saved = saved[split]
    for number, row in enumerate(saved, 1):
        yield number, dict(row)


def load_problems(source: str, fields: FieldNames | None = None, split: str = "test", on_bad_row: str = "error",
                  limit: int | None = None, dedupe: bool = False, subset: str | None = None,
                  revision: str | None = None) -> tuple[list[Problem], dict[str, int]]:
    """Problems from ``source`` (a .jsonl / .parquet path, a dir saved by ``datasets`` (its ``split``), or an HF
    dataset id when no such file exists, read with ``subset``, ``split`` and ``revision``) and the counts of
    skipped rows by reason. ``dedupe``: a row whose problem text and answer
    repeat an earlier row's is skipped and counted ("repeated problem"), whatever its id (the HF copy of
    DAPO-Math-17k holds each prompt about 100 times); a repeated text with another answer is a bad row (under
    ``skip`` the first row's answer is kept)."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row={on_bad_row!r}: choose from {', '.join(BAD_ROW_POLICIES)}")
    fields = fields or FieldNames()
    path = Path(source)
    if path.suffix == ".jsonl" and path.exists():
        rows, where = _rows_jsonl(path), str(path)
    elif path.suffix == ".parquet" and path.exists():
        rows, where = _rows_parquet(path), str(path)
    elif is_saved_dataset(path):
        rows, where = _rows_saved(path, split), f"{path}[{split}]"
    elif is_absent_file(source):
        raise FileNotFoundError(f"data file {source} does not exist (the benchmarks ship in the repo's data/; "
                                "BICC_DATA_DIR or eval.data_dir points elsewhere)")
    else:
        rows, where = _rows_hub(source, split, subset, revision), f"{source}[{subset + ', ' if subset else ''}{split}]"
    problems, skipped, seen, texts = [], Counter(), {}, {}
    row_of = (lambda n: f"{where}:{n}") if where == str(path) else (lambda n: f"{where} row {n}")  # file: line
    for number, row in rows:
        if dedupe and isinstance(row, dict) and field_value(row, fields.problem) is not None:
            text, answer = str(field_value(row, fields.problem)), str(field_value(row, fields.answer)).strip()
            if text in texts:
                first, first_answer = texts[text]
                if first_answer != answer:
                    reason = f"problem repeats line {first} with answer {answer!r} instead of {first_answer!r}"
                    if on_bad_row == "error":
                        raise BadRowError(f"{row_of(number)}: {reason} (set on_bad_row=skip to keep the first)")
                    skipped["repeated problem with another answer"] += 1
                    continue
                skipped["repeated problem"] += 1
                continue
            texts[text] = (number, answer)
            pid = field_value(row, fields.id)
            if pid is not None and str(pid) in seen:  # ids repeat across distinct problems in such copies
                row = {**row, fields.id: f"{pid}~{number}"}
                skipped["renamed repeated id (kept)"] += 1
        reason = _check_row(row, fields, seen)
        if reason is not None:
            if on_bad_row == "error":
                raise BadRowError(f"{row_of(number)}: {reason} (set on_bad_row=skip to skip such rows)")
            skipped[reason.split(" (")[0]] += 1
            continue
        pid = field_value(row, fields.id)
        pid = str(number if pid is None else pid)
        seen[pid] = number
        problems.append(Problem(pid, str(field_value(row, fields.problem)), str(field_value(row, fields.answer)).strip()))
        if limit and len(problems) >= limit:
            break
    if skipped:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
        print(f"[data] {where}: kept {len(problems)} rows; skipped or renamed: {counts}")
    return problems, dict(skipped)


def is_absent_file(source: str) -> bool:
    """``source`` names a local file (a .jsonl / .parquet suffix, or an absolute or relative path) that does not
    exist; anything else is taken for an HF dataset id."""
    path = Path(source)
    return not path.exists() and (path.suffix in (".jsonl", ".parquet") or path.is_absolute() or source.startswith("."))


def field_value(row: dict, path: str):
    """``row[path]``, where a dotted path walks nested objects and lists (``prompt.0.content``,
    ``reward_model.ground_truth``); None when any step is missing."""
    if path in row:
        return row[path]
    value = row
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def _check_row(row, fields: FieldNames, seen: dict) -> str | None:
    if isinstance(row, str):  # an error message from the reader
        return row
    if not isinstance(row, dict):
        return f"not a JSON object (got {type(row).__name__})"
    for name in (fields.problem, fields.answer):
        value = field_value(row, name)
        if value is None:
            return f"missing field '{name}'"
        if not str(value).strip():
            return f"empty field '{name}'"
    pid = field_value(row, fields.id)
    if pid is not None:
        pid = str(pid)
        if pid in seen:
            return f"duplicate id {pid!r} (first on line {seen[pid]})"
    return None
