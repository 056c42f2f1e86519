"""The embedded arithmetic task's binary reward and DAPO's overlong penalty.

Extraction and normalisation come from ``bicc.data.answers``: the last balanced ``\\boxed{...}`` (the one that
closes last, so an outer box wins over a box nested in it; an empty box counts), else the number right after
the last "The answer is"; else nothing.
"""

from __future__ import annotations

import torch

from bicc.data.answers import MAX_CHARS, extract_answer_number, last_boxed, normalize_answer


def extract_answer(text: str) -> str | None:
    text = text[-MAX_CHARS:]
    boxed = last_boxed(text)
    return boxed if boxed is not None else extract_answer_number(text)


def exact_match_reward(completion: str, ground_truth: str) -> float:
    """1.0 when the extracted final answer equals the ground truth after normalisation, else 0.0."""
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return float(normalize_answer(predicted) == normalize_answer(ground_truth))


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then falling linearly to -penalty at
    max_len: min(0, -(len - (max_len - buffer)) / buffer) * penalty. ``buffer = 0`` gives zeros."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    return (-(lengths.double() - (max_len - buffer)) / buffer).clamp(max=0) * penalty


# ---- a reward named by dotted path (data.reward) ------------------------------------------------

def load_reward(path: str, batched: bool, probe):
    """The function ``data.reward`` names (``package.module:function``), checked on ``probe`` (a Problem) before
    any model loads: it must import, take ``(completion, problem)`` (``data.reward_batched``: lists of both) and
    return a finite number (a list of them) for an empty completion."""
    import importlib
    import inspect
    import math

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"config field 'data.reward': {path!r} is not of the form package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"config field 'data.reward': cannot import {path!r} ({err})") from None
    args = ([""], [probe]) if batched else ("", probe)
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config field 'data.reward': {path} must take (completion{'s' if batched else ''}, "
                         f"problem{'s' if batched else ''}) ({err})") from None
    out = fn(*args)
    values = out if batched and isinstance(out, (list, tuple)) else [out] if not batched else None
    if values is None or len(values) != 1 or not all(_is_number(v) and math.isfinite(v) for v in values):
        wanted = "a list of finite numbers, one per completion" if batched else "a finite number"
        raise ValueError(f"config field 'data.reward': {path} returned {out!r} for an empty completion of problem "
                         f"{probe.id}; it must return {wanted}")
    return fn


def _is_number(value) -> bool:
    import numbers

    return isinstance(value, numbers.Real)


class CustomReward:
    """A task whose reward is ``data.reward``: problems, prompts, answer anchors and demonstrations stay the
    task's. Every returned value is checked (finite, one per completion); a bad one is an error naming the
    problem."""

    def __init__(self, task, path: str, batched: bool):
        self.task, self.path, self.batched = task, path, batched
        self.fn = load_reward(path, batched, task.train_problem(0))

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward(self, completion: str, problem) -> float:
        return self.reward_many([completion], [problem])[0]

    def reward_many(self, completions: list[str], problems: list) -> list[float]:
        import math

        out = list(self.fn(completions, problems)) if self.batched else [self.fn(c, p) for c, p in zip(completions, problems)]
        if len(out) != len(completions):
            raise ValueError(f"data.reward={self.path}: returned {len(out)} values for {len(completions)} completions")
        for value, problem in zip(out, problems):
            if not (_is_number(value) and math.isfinite(value)):
                raise ValueError(f"data.reward={self.path}: returned {value!r} on problem {problem.id}; "
                                 "it must return a finite number")
        return [float(v) for v in out]
