"""The embedded arithmetic task's binary reward and DAPO's overlong penalty.

Extraction and normalisation come from ``bicc.data.answers``: the last balanced ``\\boxed{...}`` (the one that
closes last, so an outer box wins over a box nested in it; an empty box counts), else the number right after
the last "The answer is"; else nothing.
"""

from __future__ import annotations

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


# ---- rewards named by dotted path (data.reward, data.rewards) ---------------------------------

# The keyword arguments a TRL-style reward receives besides ``prompts`` and ``completions``: each sample's
# ground-truth answer under the names such rewards read it by (and the dataset's own answer column name).
ANSWER_COLUMNS = ("answer", "ground_truth")


class RewardFunction:
    """One reward function and how it is called: ``sample`` ``fn(completion, problem)``, ``batch``
    ``fn(completions, problems)`` (``data.reward_batched``), or ``trl`` (it takes ``**kwargs``: TRL's
    ``fn(prompts=..., completions=..., answer=..., ground_truth=..., ...)``, a list of floats back)."""

    def __init__(self, path: str, batched: bool, weight: float, answer_column: str, field_name: str):
        import importlib
        import inspect

        self.path, self.weight, self.field = path, weight, field_name
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ValueError(f"config field '{field_name}': {path!r} is not of the form package.module:function")
        try:
            self.fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"config field '{field_name}': cannot import {path!r} ({err})") from None
        params = inspect.signature(self.fn).parameters.values()
        self.style = ("trl" if any(p.kind is p.VAR_KEYWORD for p in params) else "batch" if batched else "sample")
        self.name = attr
        self.columns = tuple(dict.fromkeys((*ANSWER_COLUMNS, answer_column)))

    def __call__(self, completions: list[str], problems: list) -> list:
        if self.style == "sample":
            return [self.fn(c, p) for c, p in zip(completions, problems)]
        if self.style == "batch":
            out = self.fn(completions, problems)
        else:
            answers = [p.answer for p in problems]
            out = self.fn(prompts=[p.prompt for p in problems], completions=completions,
                          problem_id=[p.id for p in problems], **{c: answers for c in self.columns})
        if not isinstance(out, (list, tuple)):
            raise TypeError(f"returned {out!r}, not a list of one number per completion")
        return list(out)

    def check(self, probe) -> None:
        """Called once on an empty completion of ``probe`` before any model loads: it must take its arguments and
        return one finite number."""
        import inspect

        args = {"sample": ("", probe), "batch": ([""], [probe])}.get(self.style)
        if args is not None:
            try:
                inspect.signature(self.fn).bind(*args)
            except (TypeError, ValueError) as err:
                kind = "(completions, problems)" if self.style == "batch" else "(completion, problem)"
                raise ValueError(f"config field '{self.field}': {self.path} must take {kind}, or TRL's "
                                 f"(prompts, completions, **kwargs) ({err})") from None
        try:
            out = self([""], [probe])
        except Exception as err:  # noqa: BLE001 (named, with the function)
            raise ValueError(f"config field '{self.field}': {self.path} raised {type(err).__name__}: {err} on an empty "
                             f"completion of problem {probe.id}") from None
        if len(out) != 1 or not _finite(out[0]):
            shown = repr(out[0]) if len(out) == 1 else f"{len(out)} values"
            raise ValueError(f"config field '{self.field}': {self.path} returned {shown} for an empty completion of "
                             f"problem {probe.id}; it must return a finite number for each completion")


def _finite(value) -> bool:
    """A finite real number (a bool counts: True is 1)."""
    import math
    import numbers

    return isinstance(value, bool) or (isinstance(value, numbers.Real) and math.isfinite(value))


class CustomReward:
    """A task whose reward is ``data.reward`` or the weighted sum of ``data.rewards`` (``data.reward_weights``, 1 each
    by default): problems, prompts, answer anchors and demonstrations stay the task's. Every value is checked (one
    finite number per completion). A function that raises or returns a bad value is an error naming it and the
    sample's index and problem, or under ``data.reward_errors=zero`` scores that sample 0 for that function and is
    counted (``reward/scoring_errors``). ``score`` also gives each function's values (``reward/<name>``)."""

    def __init__(self, task, data_cfg):
        self.task = task
        paths = list(getattr(data_cfg, "rewards", None) or [])
        if data_cfg.reward and paths:
            raise ValueError("config fields 'data.reward' and 'data.rewards': set one (data.rewards lists several)")
        field_name = "data.rewards" if paths else "data.reward"
        paths = paths or [data_cfg.reward]
        weights = list(getattr(data_cfg, "reward_weights", None) or [1.0] * len(paths))
        if len(weights) != len(paths):
            raise ValueError(f"config field 'data.reward_weights': {len(weights)} weights for {len(paths)} rewards")
        answer_column = getattr(getattr(data_cfg, "math", None), "answer_field", "answer") or "answer"
        self.functions = [RewardFunction(p, bool(data_cfg.reward_batched), float(w), answer_column, field_name)
                          for p, w in zip(paths, weights)]
        names = [f.name for f in self.functions]
        for i, f in enumerate(self.functions):  # one metric name each
            f.name = f.name if names.count(f.name) == 1 else f"{f.name}_{i}"
        self.on_error = getattr(data_cfg, "reward_errors", "raise")
        probe = task.train_problem(0)
        for f in self.functions:
            f.check(probe)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward(self, completion: str, problem) -> float:
        return self.reward_many([completion], [problem])[0]

    def reward_many(self, completions: list[str], problems: list) -> list[float]:
        return self.score(completions, problems)[0]

    def score(self, completions: list[str], problems: list) -> tuple[list[float], dict[str, list[float]]]:
        """(the weighted sum per completion, {function name: its values, "scoring_errors": 1 where a value was zeroed})."""
        n = len(completions)
        total, parts, errors = [0.0] * n, {}, [0.0] * n
        for f in self.functions:
            try:
                out = f(completions, problems)
                bad = ([] if len(out) == n else list(range(n))) or [i for i, v in enumerate(out) if not _finite(v)]
                what = (f"returned {len(out)} values for {n} completions" if len(out) != n
                        else f"returned {out[bad[0]]!r}" if bad else "")
            except Exception as err:  # noqa: BLE001 (named, with the function and the samples)
                out, bad, what = [0.0] * n, list(range(n)), f"raised {type(err).__name__}: {err}"
            if bad and self.on_error != "zero":
                i = bad[0]
                raise ValueError(f"reward {f.path} ({f.field}) {what} on sample {i} of {n} (problem {problems[i].id}); "
                                 "it must return a finite number per completion (data.reward_errors=zero scores it 0)")
            values = [0.0 if i in set(bad) else float(v) for i, v in enumerate(out[:n] if len(out) >= n else [0.0] * n)]
            for i in bad:
                errors[i] = 1.0
            parts[f.name] = values
            total = [t + f.weight * v for t, v in zip(total, values)]
        return total, {**parts, "scoring_errors": errors} if self.on_error == "zero" else parts
