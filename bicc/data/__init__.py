"""Tasks: where prompts, ground-truth answers and (for warm starts) demonstrations come from.

A task is built by name from the ``data`` config (``TASKS.get(cfg.data.task)(cfg.data)``) and offers:
``train_problem(index)`` (deterministic in the index, so the data position is one integer that a
checkpoint can store), ``test_problems(n)``, ``reward(completion, problem)``, ``answer_anchors`` and, when it
supports supervised warm starts, ``demonstration(problem, rng)``. What the trainer reads of a task's class before one is
built, never testing its name: ``params`` (the dataclass of its own settings, ``data.params``, for a task outside the
library; the library's have groups of their own, ``data.arith`` and ``data.math``), ``check(data_cfg, eval_cfg)``
(its checks across groups, before any model loads) and ``describe(data_cfg)`` (words for the start-up line).

Modules: ``tasks/`` (one module per task, found on disk: ``arith``, the embedded sums; ``math``, math problems from
JSONL, parquet or HF datasets), ``answers`` (answer extractors, and the anchors BiCC's truncation keeps),
``checking`` (the math checker: exact match, then math-verify in processes of its own, each a ``verify_worker``),
``rewards`` (a user's reward functions, TRL's signature included), ``benchmarks`` (evaluation's datasets).
"""

from dataclasses import dataclass

from bicc.registry import TASKS


@dataclass(frozen=True)
class Problem:
    """One query: the user-turn text and the ground-truth final answer."""

    id: str
    prompt: str
    answer: str


def build_task(data_cfg):
    """The task ``data.task`` names; its reward replaced by ``data.reward`` (a dotted path) when that is set."""
    task = TASKS.get(data_cfg.task)(data_cfg)
    if getattr(data_cfg, "reward", None) or getattr(data_cfg, "rewards", None):
        from bicc.data.rewards import CustomReward

        task = CustomReward(task, data_cfg)
    return task



def task_rewards(task, completions: list[str], problems: list[Problem]) -> list[float]:
    """The task's reward of each completion: in one call where the task scores lists (``reward_many``)."""
    return scored(task, completions, problems)[0]


def scored(task, completions: list[str], problems: list[Problem]) -> tuple[list[float], dict[str, list[float]]]:
    """(each completion's reward, each named reward function's values: ``data.rewards``, else none)."""
    from bicc.data.rewards import CustomReward

    if isinstance(task, CustomReward):
        return task.score(completions, problems)
    if hasattr(task, "reward_many"):
        return task.reward_many(completions, problems), {}
    return [task.reward(c, p) for c, p in zip(completions, problems)], {}


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the chat-formatted user turn, with the assistant turn opened."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True, return_dict=False
    )


import bicc.data.tasks  # noqa: E402,F401  (each module of tasks/ registers its task)
