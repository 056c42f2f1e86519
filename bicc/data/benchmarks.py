"""Math benchmarks and training sets from a local JSONL / parquet file or a Hugging Face dataset id.

Rows are validated as they load: a line that is not UTF-8 or not JSON, a missing or empty problem or
answer, or a duplicate id is an error naming the file and line. With ``on_bad_row="skip"`` such rows
are skipped instead, counted by reason, and summarised in one line; nothing is dropped silently.
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


def _rows_hub(dataset_id: str, split: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading the HF dataset {dataset_id!r} needs the `datasets` package "
                          f"(make setup-gpu, or pip install datasets), or point the path at a local JSONL/parquet file") from None
    for number, row in enumerate(datasets.load_dataset(dataset_id, split=split), 1):
        yield number, dict(row)


def load_problems(source: str, fields: FieldNames | None = None, split: str = "test", on_bad_row: str = "error",
                  limit: int | None = None, dedupe: bool = False) -> tuple[list[Problem], dict[str, int]]:
    """Problems from ``source`` (a .jsonl / .parquet path, or an HF dataset id when no such file
    exists) and the counts of skipped rows by reason. ``dedupe``: a row whose problem text and answer
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
    elif is_absent_file(source):
        raise FileNotFoundError(f"data file {source} does not exist (the benchmarks ship in the repo's data/; "
                                "BICC_DATA_DIR or eval.data_dir points elsewhere)")
    else:
        rows, where = _rows_hub(source, split), f"{source}[{split}]"
    problems, skipped, seen, texts = [], Counter(), {}, {}
    for number, row in rows:
        if dedupe and isinstance(row, dict) and field_value(row, fields.problem) is not None:
            text, answer = str(field_value(row, fields.problem)), str(field_value(row, fields.answer)).strip()
            if text in texts:
                first, first_answer = texts[text]
                if first_answer != answer:
                    reason = f"problem repeats line {first} with answer {answer!r} instead of {first_answer!r}"
                    if on_bad_row == "error":
                        raise BadRowError(f"{where}:{number}: {reason} (set on_bad_row=skip to keep the first)")
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
                raise BadRowError(f"{where}:{number}: {reason} (set on_bad_row=skip to skip such rows)")
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
