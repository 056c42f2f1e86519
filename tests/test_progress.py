"""Progress reporting: a bar on a terminal; occasional plain lines in a log file, never one redraw per step."""

import itertools

from bicc.machine import progress as progress_module
from bicc.machine.progress import LineProgress, progress


def test_a_log_file_gets_occasional_lines(capsys, monkeypatch):
    clock = itertools.count(0, 7)  # each call to the clock advances 7 s
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    bar = progress(100, "rl", enabled=True)  # pytest's stdout is not a terminal
    assert isinstance(bar, LineProgress)
    for _ in range(100):
        bar.update(1)
        bar.set_postfix(reward="0.50")
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert 10 <= len(lines) <= 40 and "\r" not in "".join(lines)  # a line per ~30 s, not one per step
    assert lines[-1].startswith("[rl] 100/100") and lines[-1].endswith("reward=0.50")


def test_disabled_progress_prints_nothing(capsys):
    bar = progress(10, "sft", enabled=False)
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert capsys.readouterr().out == ""
