"""The metrics sinks (bicc/machine/tracking.py): what metrics.jsonl holds, a non-main rank writing nothing, and the
rewind a resumed run does."""

import json

from bicc.machine.tracking import Tracker, rewind_jsonl


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_rows(tmp_path):
    """One row per call with its step; ints become floats, a non-finite value becomes null (JSON has no NaN),
    booleans and strings stay as they are."""
    tracker = Tracker(tmp_path / "run", "r", {}, "disabled", "p")
    tracker.log({"train/loss": 2, "train/grad_norm": float("nan"), "eval/ok": True, "run/name": "x"}, step=1)
    tracker.log({"train/loss": 0.5, "reward/accuracy": float("inf")}, step=2)
    tracker.finish()
    assert rows(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "train/loss": 2.0, "train/grad_norm": None, "eval/ok": True, "run/name": "x"},
        {"step": 2, "train/loss": 0.5, "reward/accuracy": None}]
    assert isinstance(rows(tmp_path / "run" / "metrics.jsonl")[0]["train/loss"], float)


def test_only_the_main_rank_writes(tmp_path):
    tracker = Tracker(tmp_path / "run", "r", {}, "offline", "p", enabled=False)  # wandb is never started either
    tracker.log({"train/loss": 1.0}, step=1)
    assert tracker._wandb is None and not (tmp_path / "run").exists()


def test_rewind_drops_later_steps_and_a_cut_line(tmp_path):
    """A resume from step 2 recomputes steps 3 and 4: their rows go, and so does the last line a kill cut short;
    the earlier steps stay, in order."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train/loss": s / 10}) for s in (1, 2, 3, 4)] + ['{"step": 5, "train/lo']
    path.write_text("\n".join(lines) + "\n")
    assert rewind_jsonl(path, 2) == 3
    assert [r["step"] for r in rows(path)] == [1, 2]
    assert rewind_jsonl(path, 2) == 0 and rewind_jsonl(tmp_path / "absent.jsonl", 2) == 0
