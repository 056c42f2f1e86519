"""The answer checker: extraction per dataset, the fast path, math-verify under a deadline, and
untrusted outputs."""

import json
import time
from pathlib import Path

import pytest

from bicc.data.answers import canonical, extract
from bicc.data.checking import MathChecker

# The answer checker scores in worker processes (math-verify under a deadline).
pytestmark = pytest.mark.launch


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


def test_a_long_output_is_read_at_its_end():
    """Only the last 20,000 characters are searched (a bound on untrusted text): the final answer, written last,
    is found past them, and an early draft answer is not."""
    from bicc.data.answers import MAX_CHARS

    text = "\\boxed{1} " + "x" * (MAX_CHARS + 5000) + " \\boxed{2}"
    assert extract(text, ("boxed",)) == "2"
    assert extract("The answer is 7. " + "y" * (MAX_CHARS + 10), ("answer_is",)) is None


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


def test_gsm8k_extraction_is_linear_in_newlines():
    """``A:`` lines used to be matched with a leading ``\\s*`` that re-scanned every run of newlines from each
    newline in it: 0.02 / 0.09 / 0.38 s on 5k / 10k / 20k newlines (the 20k-character cap of ``extract`` bounded
    it there), ~10 s for the 100k here, past the cap."""
    from bicc.data.answers import extract_gsm8k

    start = time.perf_counter()
    assert extract_gsm8k("\n" * 100_000 + "A: 12 apples") == "12"
    assert extract_gsm8k("\n \n" * 50_000) is None
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text", ["The answer is \\boxed{42", "the answer is \\boxed{42" + " and more" * 100,
                                  "The answer is {42"])
def test_an_unclosed_box_is_not_an_answer(checker, text):
    """An answer whose braces do not balance is malformed: it scores 0 and is counted as rejected (it used to
    reach math-verify wrapped in a box of ours, which closed it)."""
    before = checker.stats["rejected"]
    assert checker.score(text, "42") == 0.0
    assert checker.stats["rejected"] == before + 1
    assert checker.score("The answer is \\frac{84}{2}", "42") == 1.0  # balanced braces still go through


def test_items_after_deadline_kills_do_not_wait_for_imports():
    """Two items past their deadline kill both workers; warm spares take their places at once, so the item
    behind them is scored as soon as a worker is free, not after a fresh worker imports math-verify: its wait past
    the deadline is under half that of a pool without spares, timed on the same items beside it (a machine busy
    with other work slows both). The items after that do not wait for the new spares' imports either. The deadline
    is ``eval=arith``'s 1.5 s: the easy item is scored while the two new spares import math-verify on the same
    core (the worker's pinned one), and at 0.5 s it timed out on a busy host."""
    from bicc.data.checking import VerifyPool

    deadline = 1.5
    hard = ("7", "$\\boxed{9^{9^{9^{9^{9}}}}}$", ("latex", "expr"), 6, False, True)
    easy = ("$\\frac{1}{2}$", "$\\boxed{0.5}$", ("latex", "expr"), 6, False, True)

    def timed(pool) -> float:
        start = time.perf_counter()
        assert pool.run([hard, hard, easy]) == [False, False, True]
        assert pool.timeouts == 2
        return time.perf_counter() - start

    cold = VerifyPool(workers=2, deadline_s=deadline, spares=0)
    cold.start()
    try:
        without_spares = timed(cold)
    finally:
        cold.close()
    pool = VerifyPool(workers=2, deadline_s=deadline)
    pool.start()
    try:
        elapsed = timed(pool)
        assert elapsed - deadline < (without_spares - deadline) / 2, f"{elapsed:.2f} s, {without_spares:.2f} s without spares"
        # And again at once: the two spares used are being replaced in the background, and the run does not wait
        # for their imports (it returns while they are still importing; no wall-clock bound, which a busy host breaks).
        assert pool.spares_importing == 2
        assert pool.run([easy, easy]) == [True, True]
        assert pool.spares_importing >= 1
    finally:
        pool.close()


BIG_MAIN = '''
import mmap
import sys
from pathlib import Path

with open(Path(__file__).with_suffix(".imports"), "a") as f:  # one line each time a process imports this file
    f.write(__name__ + "\\n")
_RESERVED = mmap.mmap(-1, 6 << 30)  # like CUDA torch at import: gigabytes mapped, little touched

from bicc.data.checking import MathChecker

if __name__ == "__main__":
    checker = MathChecker(workers=1, deadline_s=20.0)
    try:
        print(checker.score("so \\\\boxed{(x+1)^2}", "x^2+2x+1"), checker.stats["verify"])
    finally:
        checker.close()
'''


def test_workers_import_nothing_of_the_main_module_and_verify(tmp_path):
    """A multiprocessing spawn would import the parent's ``__main__`` in each worker (``train.py``: torch and its CUDA
    libraries, gigabytes of mappings, seconds before the worker could notice its parent was gone). The workers
    import the checker alone: the main module here, which maps 6 GiB at import, is imported once (by its own
    process), and an answer only math-verify can decide scores 1 (the memory cap is headroom over what a worker
    maps, not a silent 0 from a MemoryError)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "big_main.py"
    script.write_text(BIG_MAIN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0", "1"], out.stdout
    assert (tmp_path / "big_main.imports").read_text().split() == ["__main__"]


def test_a_worker_starts_on_a_light_import_and_ends_when_its_parent_is_gone_already():
    """The worker asks the kernel to end it with its parent before its imports of math-verify, so the window in
    which a killed trainer could leave it behind is the interpreter's start and the checker's light modules: no
    torch, no transformers. A worker whose parent ended before that request (its parent pid is not the one it was
    given) ends at once, without waiting on its connection."""
    import os
    import socket
    import subprocess
    import sys

    from bicc.data.checking import PACKAGE_ROOT

    probe = "import sys, bicc.data.verify_worker; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["[]"], out.stdout + out.stderr[-2000:]
    ours, theirs = socket.socketpair()
    with ours, theirs:  # our end stays open: a worker that served would wait on it until the timeout
        proc = subprocess.run([sys.executable, "-m", "bicc.data.verify_worker", str(theirs.fileno()), str(os.getpid() + 1),
                               "0"], cwd=PACKAGE_ROOT, pass_fds=(theirs.fileno(),), capture_output=True, text=True,
                              timeout=20)
    assert proc.returncode == 0, proc.stderr[-2000:]
