"""The embedded task: integer expressions with worked steps, generated from a seed.

A problem is ``Compute 12+34-5.``; its demonstration evaluates left to right, one step a line,
and ends with the boxed answer::

    12+34=46
    46-5=41
    \\boxed{41}

For a pretrained model the prompt can carry an instruction (``instruction``, after the question) and a
worked example (``worked_example``: one fixed training expression solved in the demonstration's format,
before the question); both default off, and neither changes the problems or the split.

A share of demonstrations (``slip_rate``) carries a deliberate slip: one step is off by 1..slip_max
and the error is carried to the end. A model fine-tuned on them is an imperfect baseline that RL can
improve, which is the point of the warm start.

Train and test are disjoint by construction: an expression belongs to the test split iff a stable
hash of its text falls below ``test_share``; training draws skip those expressions.
"""

from __future__ import annotations

import random
import re
import zlib
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

from bicc.config.fields import need
from bicc.data import TASKS, Problem
from bicc.data.answers import EXTRACTORS, answer_anchors, extract, normalize_answer
from bicc.data.rewards import exact_match_reward


def _stable_unit(text: str) -> float:
    """A hash of ``text`` mapped to [0, 1), identical across processes and Python versions."""
    return zlib.crc32(text.encode()) / 2**32


def _rng(seed: int, stream: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{stream}:{index}")


@TASKS.register("arith")
class ArithTask:
    # what exact_match_reward extracts, which BiCC truncation keeps
    answer_anchors = answer_anchors(("boxed", "answer_number"))

    @staticmethod
    def check(data_cfg, eval_cfg) -> None:
        """Evaluation on the task's test split draws no more problems than it holds."""
        if any(b.source == "task" for b in eval_cfg.benchmarks):
            need(eval_cfg.num_problems <= data_cfg.arith.test_size, "eval.num_problems",
                 f"must be <= data.arith.test_size={data_cfg.arith.test_size} (the task's test split), got "
                 f"{eval_cfg.num_problems}")

    @staticmethod
    def describe(data_cfg) -> str:
        """The warm start's slips, for the start-up line (a tiny model's demonstrations)."""
        return f"arith slips {data_cfg.arith.slip_rate:g} at {data_cfg.arith.slip_step} step"

    def __init__(self, data_cfg):
        # plain values: drawing the test split reads them some 10^4 times, which through OmegaConf took 0.8 s a process
        arith = data_cfg.arith
        self.cfg = SimpleNamespace(**OmegaConf.to_container(arith, resolve=True)) if isinstance(arith, DictConfig) else arith
        self.seed = data_cfg.seed
        self._test_cache: list[Problem] = []
        self._example: str | None = None
        self.extractors = tuple(self.cfg.extractors)
        for name in self.extractors:
            if name not in EXTRACTORS:
                raise ValueError(f"config field 'data.arith.extractors': unknown extractor '{name}'; "
                                 f"registered: {sorted(EXTRACTORS.names())}")
        if self.extractors:
            self.answer_anchors = answer_anchors(self.extractors)

    # ---- sampling ---------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> tuple[list[int], list[str]]:
        n = rng.randint(self.cfg.min_operands, self.cfg.max_operands)
        operands = [rng.randint(1, self.cfg.max_operand) for _ in range(n)]
        ops = [rng.choice(self.cfg.ops) for _ in range(n - 1)]
        return operands, ops

    @staticmethod
    def _expression(operands: list[int], ops: list[str]) -> str:
        parts = [str(operands[0])]
        for op, x in zip(ops, operands[1:]):
            parts += [op, str(x)]
        return "".join(parts)

    def _is_test(self, expression: str) -> bool:
        return _stable_unit(f"{self.seed}:{expression}") < self.cfg.test_share

    def _problem(self, pid: str, operands: list[int], ops: list[str]) -> Problem:
        expression = self._expression(operands, ops)
        value = operands[0]
        for op, x in zip(ops, operands[1:]):
            value = value + x if op == "+" else value - x
        return Problem(id=pid, prompt=self._prompt(expression), answer=str(value))

    def _prompt(self, expression: str) -> str:
        text = f"Compute {expression}."
        if self.cfg.worked_example:
            text = f"{self.worked_example()}\n\n{text}"
        if self.cfg.instruction:
            text = f"{text}\n{self.cfg.instruction}"
        return text

    def worked_example(self) -> str:
        """One training expression (the first of its own stream), solved step by step without a slip."""
        if self._example is None:
            rng = _rng(self.seed, "example", 0)
            operands, ops = self._draw(rng)
            while self._is_test(self._expression(operands, ops)):
                operands, ops = self._draw(rng)
            expression = self._expression(operands, ops)
            self._example = f"Example:\nCompute {expression}.\n{self._solution(operands, ops, slip_step=-1, rng=rng)}"
        return self._example

    def train_problem(self, index: int) -> Problem:
        rng = _rng(self.seed, "train", index)
        while True:
            operands, ops = self._draw(rng)
            if not self._is_test(self._expression(operands, ops)):
                return self._problem(f"arith-train-{index}", operands, ops)

    def test_problems(self, n: int) -> list[Problem]:
        if n > self.cfg.test_size:
            raise ValueError(f"asked for {n} test problems but data.arith.test_size is {self.cfg.test_size}")
        if not self._test_cache:
            rng = _rng(self.seed, "test", 0)
            seen: set[str] = set()
            draws, max_draws = 0, 1000 * self.cfg.test_size
            while len(self._test_cache) < self.cfg.test_size:
                draws += 1
                if draws > max_draws:  # the space of expressions is too small for the split asked for
                    raise ValueError(
                        f"config field 'data.arith.test_size': only {len(self._test_cache)} distinct test problems found "
                        f"in {max_draws} draws (max_operand={self.cfg.max_operand}, operands {self.cfg.min_operands}.."
                        f"{self.cfg.max_operands}, test_share={self.cfg.test_share}); lower test_size or widen the task")
                operands, ops = self._draw(rng)
                expression = self._expression(operands, ops)
                if expression in seen or not self._is_test(expression):
                    continue
                seen.add(expression)
                self._test_cache.append(self._problem(f"arith-test-{len(self._test_cache)}", operands, ops))
        return self._test_cache[:n]

    def reward(self, completion: str, problem: Problem) -> float:
        if not self.extractors:
            return exact_match_reward(completion, problem.answer)
        found = extract(completion, self.extractors)
        return float(found is not None and normalize_answer(found) == normalize_answer(problem.answer))

    # ---- demonstrations ---------------------------------------------------------------------
    def demonstration(self, problem: Problem, rng: random.Random, slip: bool | None = None) -> str:
        """Worked steps for ``problem``; one step is off and carried with probability slip_rate, or as
        ``slip`` says (True: a slipped demonstration, False: a correct one)."""
        operands, ops = _parse(_COMPUTE.findall(problem.prompt)[-1])
        if slip is None:
            slip = rng.random() < self.cfg.slip_rate
        slip_step = -1
        if slip:
            slip_step = rng.randrange(len(ops)) if self.cfg.slip_step == "any" else len(ops) - 1
        return self._solution(operands, ops, slip_step, rng)

    def _solution(self, operands: list[int], ops: list[str], slip_step: int, rng: random.Random) -> str:
        lines = []
        value = operands[0]
        for step, (op, x) in enumerate(zip(ops, operands[1:])):
            result = value + x if op == "+" else value - x
            if step == slip_step:
                result += rng.choice([-1, 1]) * rng.randint(1, self.cfg.slip_max)
            lines.append(f"{value}{op}{x}={result}")
            value = result
        lines.append(f"\\boxed{{{value}}}")
        return "\n".join(lines)


_COMPUTE = re.compile(r"Compute ([0-9+-]+)\.")  # the question; a worked example's comes before it


def _parse(expression: str) -> tuple[list[int], list[str]]:
    """Split a left-to-right expression like '12+34-5' into operands and operators."""
    operands, ops, digits = [], [], ""
    for ch in expression:
        if ch.isdigit():
            digits += ch
        else:
            operands.append(int(digits))
            ops.append(ch)
            digits = ""
    operands.append(int(digits))
    return operands, ops
