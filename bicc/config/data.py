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

    # Fewest operands per expression.
    min_operands: int = 2
    # Most operands per expression.
    max_operands: int = 3
    # Operands are drawn from 1..max_operand.
    max_operand: int = 49
    # Operators to use (a subset of "+-").
    ops: str = "+-"
    # Share of SFT demonstrations with one step off (carried to the answer).
    slip_rate: float = 0.3
    # Size of a slip: off by 1..slip_max.
    slip_max: int = 2
    # Which step slips: any (uniformly; later steps then carry the error) | last (only the final result).
    slip_step: str = choice(Literal["any", "last"], "any")
    # Number of held-out test problems generated.
    test_size: int = 500
    # Share of the expression space reserved for test (by a stable hash of the text).
    test_share: float = 0.1
    # Line after the question (for a pretrained model, e.g. "Put your final answer within \\boxed{}."); "" = none.
    instruction: str = ""
    # Show one fixed training expression solved step by step before the question (for a pretrained model).
    worked_example: bool = False
    # How the reward reads the answer: [] = the task's own (the last \\boxed{}, else "The answer is N"); else extractors
    # of bicc/data/answers.py in order, e.g. [boxed, last_number] for a model that ends on "= N".
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

    # Training problems (required; empty is an error naming this field before anything is read).
    train_source: str = ""
    # Held-out problems for the in-training evaluation (required).
    test_source: str = ""
    # For an HF dataset id (or a dataset repo dir): its subset (config name, e.g. "main" for openai/gsm8k).
    subset: Optional[str] = None
    # ... and the revision to read (a commit or tag; null = the default branch).
    revision: Optional[str] = None
    # The split trained on, from a dataset (HF id, repo dir, or a dir written by datasets' save_to_disk).
    train_split: str = "train"
    # The held-out split.
    test_split: str = "test"
    # The held-out dataset's own subset (null = subset).
    test_subset: Optional[str] = None
    dedupe: bool = False
    shuffle: bool = False
    # Field holding the problem text (a dotted path reaches nested fields: reward_model.ground_truth).
    problem_field: str = "problem"
    # Field holding the ground-truth final answer.
    answer_field: str = "answer"
    # Field holding a unique id.
    id_field: str = "id"
    # Answer extractors, tried in order (bicc.data.checking.EXTRACTORS).
    extractors: List[str] = field(default_factory=lambda: ["boxed", "answer_is"])
    # Appended to every problem.
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    # A bad data row: error (naming file and line) | skip (counted and summarised).
    on_bad_row: str = choice(OnBadRow, "error")
    test_problem_field: Optional[str] = None
    test_answer_field: Optional[str] = None
    test_id_field: Optional[str] = None


@dataclass
class DataConfig:
    """Training/eval task (conf/data)."""

    task: str = MISSING
    # Seed of the generated problems (train stream and test split).
    seed: int = 0
    # The reward, named by dotted path (package.module:function) instead of the task's own; null = the task's. It takes
    # (completion, problem) and returns a number (docs/extending.md).
    reward: Optional[str] = None
    # Call data.reward once per rollout with lists (completions, problems) in row order, G rows per problem.
    reward_batched: bool = False
    # Longest training prompt in tokens (chat template included), as TRL's and verl's max_prompt_length; null = none.
    max_prompt_length: Optional[int] = None
    # A longer prompt: drop (the next problem is drawn instead) | truncate (its last max_prompt_length tokens); counted
    # in rollout/prompts_over_length.
    prompt_overflow: str = choice(Literal["drop", "truncate"], "drop")
    # Several rewards instead (package.module:function each: ours, or TRL's form with **kwargs), summed with
    # reward_weights (null = 1 each); each is logged as reward/<function name>. Set data.reward or this, not both.
    rewards: List[str] = field(default_factory=list)
    # Their weights, in order (TRL's reward_weights).
    reward_weights: Optional[List[float]] = None
    # A reward that raises or returns a bad value: raise (an error naming it and the sample) | zero (scored 0, counted).
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
