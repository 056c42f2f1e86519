"""Rewards that subprocess runs name by dotted path (``data.reward=tests.rewards:first_of_group``,
``data.reward_batched=true``): they build the groups a test needs whatever the model samples, so no test's
precondition depends on what a trained model happens to sample on a given CPU."""

import re
import zlib


def degenerate(problem) -> bool:
    """A third of the problems, by a stable hash of their text: every sample of theirs scores 0, so DAPO's dynamic
    sampling drops their groups."""
    return zlib.crc32(problem.prompt.encode()) % 3 == 0


def first_of_group(completions, problems):
    """1 for the first row of each group (a run of rows with one problem), 0 for the others: every group is mixed
    (one right answer in G) unless its problem is ``degenerate``."""
    return [float(not degenerate(p) and (i == 0 or p != problems[i - 1])) for i, p in enumerate(problems)]


def length_parity(completion, problem):
    """A per-sample reward: 1 when the completion has an even number of characters."""
    return float(len(completion) % 2 == 0)


def takes_one(completion):
    return 0.0


def returns_text(completion, problem):
    return "1"


def returns_nan(completion, problem):
    return float("nan")


def first_right(completions, problems):
    """1 for the first row of each group, 0 for the others: every group is mixed (one right answer in G), so DAPO's
    dynamic sampling keeps every group of its first round and BiCC conditions every sample."""
    return [float(i == 0 or p != problems[i - 1]) for i, p in enumerate(problems)]


# ---- Rewards in TRL's form (``reward_funcs``): keyword arguments, a list of floats back ----------------------

def boxed_is_ground_truth(completions, ground_truth, **kwargs):
    """1 where the completion's first boxed value equals the sample's ground truth, else 0 (TRL's form: the
    dataset's columns arrive as keyword arguments)."""
    found = [re.search(r"\\boxed\{([^}]*)\}", text) for text in completions]
    return [float(m is not None and m.group(1).strip() == truth) for m, truth in zip(found, ground_truth)]


def brevity(prompts, completions, **kwargs):
    """Minus the completion's length in hundreds of characters."""
    assert len(prompts) == len(completions) and "answer" in kwargs
    return [-len(text) / 100 for text in completions]


def one_short(completions, **kwargs):
    """One value whatever it is given: right for one completion (the start-up check), short for more."""
    return [0.0]


def nan_on_long(completions, **kwargs):
    """Each completion's length, but NaN for one longer than 3 characters: a value that fails for one sample only."""
    return [float("nan") if len(text) > 3 else float(len(text)) for text in completions]


def fails_on_long(completions, **kwargs):
    if any(len(text) > 3 for text in completions):
        raise RuntimeError("too long")
    return [1.0] * len(completions)


# ---- Rewards that start processes or stall, for what a rollout worker does with them (tests/test_async.py) ------

def in_rollout_worker() -> bool:
    import sys

    return sys.argv[0].endswith(("bicc/rollout/worker.py", "bicc\\rollout\\worker.py"))


def parity(text: str) -> float:
    return float(len(text) % 2 == 0)


def pooled_parity(completions, **kwargs):
    """TRL's form, scored by a ``multiprocessing.Pool`` whose with-block ends it with SIGTERM, then a child process
    ended with SIGTERM: each returns only where the process calling it lets its children take the signal."""
    import multiprocessing
    import subprocess
    import sys

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        busy = pool.map_async(time_sleep, [600])  # a worker busy when the pool's exit terminates it
        scores = [parity(text) for text in completions]
        del busy
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child.terminate()
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        raise RuntimeError("a child process ignored SIGTERM: it inherited an ignored disposition") from None
    return scores


def time_sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def stalls_in_worker(completions, **kwargs):
    """Parity, except in a rollout worker, where it never returns (its first call is the reward's check at start)."""
    if in_rollout_worker():
        time_sleep(10**6)
    return [parity(text) for text in completions]


def signals_trainer_in_worker(completions, **kwargs):
    """In a rollout worker: SIGTERM to the trainer that started it (a preemption before the first step), then never
    returns. Elsewhere parity."""
    import os
    import signal

    if in_rollout_worker():
        os.kill(os.getppid(), signal.SIGTERM)
        time_sleep(10**6)
    return [parity(text) for text in completions]


def first_of_group_slow_start(completions, problems):
    """``first_of_group``, with 15 s more at the first call in the trainer (the reward's check, before the model
    loads): a trainer that is slow to reach its rollout workers."""
    if not in_rollout_worker() and not _CALLED:
        _CALLED.append(True)
        time_sleep(15)
    return first_of_group(completions, problems)


_CALLED: list = []
