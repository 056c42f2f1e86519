"""Schemas of held-out evaluation (conf/eval) and logging (conf/logger), with the range checks of their fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from omegaconf import MISSING

from bicc.config.fields import OnBadRow, at_least, choice, need


@dataclass
class HubFallback:
    """The HF dataset a benchmark loads when its ``source`` file is absent (its own field names); ``id`` null:
    none, an absent file is an error."""

    id: Optional[str] = None
    split: str = "test"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str = "id"


@dataclass
class BenchmarkConfig:
    """One evaluation set: the training task's test split, or a file / HF dataset of math problems."""

    name: str = MISSING
    source: str = "task"
    split: str = "test"
    subset: Optional[str] = None
    revision: Optional[str] = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str = "id"
    extractors: List[str] = field(default_factory=lambda: ["boxed", "answer_is"])
    hub: HubFallback = field(default_factory=HubFallback)


@dataclass
class EvalConfig:
    """Held-out evaluation (conf/eval)."""

    name: str = MISSING
    benchmarks: List[BenchmarkConfig] = field(default_factory=list)
    num_problems: int = 200
    limit: Optional[int] = None
    samples_per_problem: int = 4
    temperature: float = 0.6
    top_p: float = 0.95
    also_temperatures: List[float] = field(default_factory=list)
    max_new_tokens: int = 64
    greedy: bool = True
    batch_size: int = 512
    batch_tokens: int = 0
    shards: Optional[int] = None
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    ks: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    bootstrap_samples: int = 2000
    on_bad_row: str = choice(OnBadRow, "error")
    data_dir: str = MISSING
    checker_workers: int = 2
    checker_deadline_s: float = 1.5

    @staticmethod
    def check(e) -> None:
        need(len(e.benchmarks) >= 1, "eval.benchmarks", "needs at least one benchmark")
        names = [b.name for b in e.benchmarks]
        need(len(set(names)) == len(names), "eval.benchmarks", f"benchmark names must be unique, got {names}")
        need(e.samples_per_problem >= 1, "eval.samples_per_problem", f"must be >= 1, got {e.samples_per_problem}")
        at_least(e, "eval", ("num_problems", "max_new_tokens", "checker_workers"), 1)
        need(2 <= e.bootstrap_samples <= 10**6, "eval.bootstrap_samples",
             f"must be in [2, 10^6] (an interval; each resample is a pass over the problems), got {e.bootstrap_samples}")
        need(e.samples_per_problem <= 10**4, "eval.samples_per_problem",
             f"must be <= 10^4 (the paper's pass@1 takes 32), got {e.samples_per_problem}")
        need(e.checker_workers <= 256, "eval.checker_workers", f"must be <= 256 (processes), got {e.checker_workers}")
        need(e.shards is None or e.shards <= 10**4, "eval.shards", f"must be <= 10^4, got {e.shards}")
        need(e.limit is None or e.limit >= 1, "eval.limit", f"must be null or >= 1, got {e.limit}")
        need(e.temperature >= 0, "eval.temperature", f"must be >= 0 (0 = greedy), got {e.temperature}")
        need(0 < e.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {e.top_p}")
        for i, t in enumerate(e.also_temperatures):
            need(t > 0, f"eval.also_temperatures[{i}]", f"must be > 0 (greedy is eval.greedy), got {t}")
        need(all(k >= 1 for k in e.ks), "eval.ks", f"every k must be >= 1, got {list(e.ks)}")
        need(e.batch_size >= 1, "eval.batch_size", f"must be >= 1, got {e.batch_size}")
        need(e.batch_tokens >= 0, "eval.batch_tokens", f"must be >= 0 (0 = rows alone decide), got {e.batch_tokens}")
        need(e.shards is None or e.shards >= 1, "eval.shards", f"must be null (one per process) or >= 1, got {e.shards}")
        need(e.checker_deadline_s > 0, "eval.checker_deadline_s", f"must be > 0, got {e.checker_deadline_s}")


@dataclass
class LoggerConfig:
    """Where metrics go (conf/logger)."""

    wandb_mode: str = choice(Literal["online", "offline", "disabled"], "offline")
    wandb_project: str = "bicc"
    progress: bool = True
    samples_every: int = 10
    samples_rows: int = 8
    samples_max_chars: int = 2000

    @staticmethod
    def check(lg) -> None:
        for name in ("samples_every", "samples_rows"):
            need(lg[name] >= 0, f"logger.{name}", f"must be >= 0, got {lg[name]}")
        need(lg.samples_max_chars >= 16, "logger.samples_max_chars", f"must be >= 16, got {lg.samples_max_chars}")
