"""Schema of the data group: the task (the embedded arithmetic, or math problems from files or HF datasets) and its
rewards, with the range checks of its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from omegaconf import MISSING

from bicc.config.fields import OnBadRow, at_least, choice, need


@dataclass
class ArithConfig:
    """The embedded arithmetic task: integer expressions with worked steps."""

    min_operands: int = 2
    max_operands: int = 3
    max_operand: int = 49
    ops: str = "+-"
    slip_rate: float = 0.3
    slip_max: int = 2
    slip_step: str = choice(Literal["any", "last"], "any")
    test_size: int = 500
    test_share: float = 0.1
    instruction: str = ""
    worked_example: bool = False
    extractors: List[str] = field(default_factory=list)

    MAX_OPERANDS = 1000
    MAX_TEST_SIZE = 10**6

    @staticmethod
    def check(ar) -> None:
        need(ar.min_operands >= 2, "data.arith.min_operands", f"must be >= 2, got {ar.min_operands}")
        need(ar.max_operands >= ar.min_operands, "data.arith.max_operands",
             f"must be >= data.arith.min_operands={ar.min_operands}, got {ar.max_operands}")
        need(ar.max_operands <= ArithConfig.MAX_OPERANDS, "data.arith.max_operands",
             f"must be <= {ArithConfig.MAX_OPERANDS} (a sum of N operands is a prompt of ~4N tokens), got {ar.max_operands}")
        at_least(ar, "data.arith", ("max_operand", "slip_max", "test_size"), 1)
        need(ar.test_size <= ArithConfig.MAX_TEST_SIZE, "data.arith.test_size",
             f"must be <= {ArithConfig.MAX_TEST_SIZE:.0e} (each is drawn and held), got {ar.test_size}")
        need(0 <= ar.slip_rate <= 1, "data.arith.slip_rate", f"must be in [0, 1], got {ar.slip_rate}")
        need(set(ar.ops) <= set("+-") and ar.ops != "", "data.arith.ops", f"use a non-empty subset of '+-', got '{ar.ops}'")
        need(0 < ar.test_share < 1, "data.arith.test_share", f"must be in (0, 1), got {ar.test_share}")


@dataclass
class MathDataConfig:
    """Math problems from files or HF datasets (``data.task=math``)."""

    train_source: str = ""
    test_source: str = ""
    subset: Optional[str] = None
    revision: Optional[str] = None
    train_split: str = "train"
    test_split: str = "test"
    test_subset: Optional[str] = None
    dedupe: bool = False
    shuffle: bool = False
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str = "id"
    extractors: List[str] = field(default_factory=lambda: ["boxed", "answer_is"])
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    on_bad_row: str = choice(OnBadRow, "error")
    test_problem_field: Optional[str] = None
    test_answer_field: Optional[str] = None
    test_id_field: Optional[str] = None


@dataclass
class DataConfig:
    """Training/eval task (conf/data)."""

    task: str = MISSING
    seed: int = 0
    reward: Optional[str] = None
    reward_batched: bool = False
    max_prompt_length: Optional[int] = None
    prompt_overflow: str = choice(Literal["drop", "truncate"], "drop")
    rewards: List[str] = field(default_factory=list)
    reward_weights: Optional[List[float]] = None
    reward_errors: str = choice(Literal["raise", "zero"], "raise")
    arith: ArithConfig = field(default_factory=ArithConfig)
    math: MathDataConfig = field(default_factory=MathDataConfig)
    # a task's own settings outside the library, declared by its class (``params = MyParams``), as ``algo.params``
    params: Dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def check(d) -> None:
        at_least(d, "data", ("seed",), 0)
        rewards = len(d.rewards) or int(bool(d.reward))  # weighted: data.rewards, or data.reward alone
        need(d.reward_weights is None or len(d.reward_weights) == rewards, "data.reward_weights",
             f"{len(d.reward_weights or [])} weights for {rewards} rewards (data.rewards, or data.reward; the task's "
             "own reward takes none)")
        need(d.max_prompt_length is None or d.max_prompt_length >= 1, "data.max_prompt_length",
             f"must be null (no limit) or >= 1 tokens, got {d.max_prompt_length}")
