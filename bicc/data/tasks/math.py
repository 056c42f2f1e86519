"""Math word problems from files (``data.task=math``): MATH train / GSM8K train for RL, scored by the
same checker as evaluation (``bicc.data.checking.MathChecker``: extraction, exact path, math-verify under a
deadline). The prompt is the problem plus ``data.math.instruction``; the chat template is applied by
the caller (``encode_prompt``)."""

from __future__ import annotations

from bicc.config.fields import need
from bicc.data import TASKS, Problem
from bicc.data.answers import answer_anchors
from bicc.data.benchmarks import FieldNames, load_problems
from bicc.data.checking import MathChecker


@TASKS.register("math")
class MathTask:
    @staticmethod
    def check(data_cfg, eval_cfg) -> None:
        """Both sources are set (``data=jsonl`` leaves them empty for the user to fill)."""
        for split in ("train_source", "test_source"):
            need(bool(data_cfg.math[split]), f"data.math.{split}", "is empty: set a .jsonl/.parquet path or an HF dataset id")

    def __init__(self, data_cfg):
        cfg = data_cfg.math
        fields = FieldNames(cfg.problem_field, cfg.answer_field, cfg.id_field)
        self.train, _ = load_problems(cfg.train_source, fields, cfg.train_split, cfg.on_bad_row, dedupe=cfg.dedupe,
                                      subset=cfg.subset, revision=cfg.revision)
        self.shuffle, self._orders = bool(cfg.shuffle), {}
        self.seed = data_cfg.seed if self.shuffle else 0
        self.test_source, self.cfg = cfg.test_source, cfg
        # the held-out file may be laid out differently (e.g. DAPO-Math-17k for training, MATH-500 for tests)
        self.test_fields = FieldNames(cfg.test_problem_field or cfg.problem_field,
                                      cfg.test_answer_field or cfg.answer_field, cfg.test_id_field or cfg.id_field)
        self._test: list[Problem] | None = None
        self.checker = MathChecker(extractors=tuple(cfg.extractors))
        self.answer_anchors = answer_anchors(cfg.extractors)  # where a final answer starts (BiCC truncation)
        if not self.train:
            raise ValueError(f"data.math.train_source={cfg.train_source}: no problems")

    def _with_instruction(self, p: Problem) -> Problem:
        return Problem(p.id, f"{p.prompt}\n\n{self.cfg.instruction}" if self.cfg.instruction else p.prompt, p.answer)

    def train_problem(self, index: int) -> Problem:
        """Deterministic in ``index`` alone (what a resume relies on): epoch ``index // rows`` walks the deduplicated
        rows in an order of its own under ``data.math.shuffle`` (drawn from ``data.seed`` and the epoch; a file in
        curriculum or source order would otherwise be read in that order every epoch), else in the file's order."""
        epoch, at = divmod(index, len(self.train))
        return self._with_instruction(self.train[self.epoch_order(epoch)[at]] if self.shuffle else self.train[at])

    def epoch_order(self, epoch: int) -> list[int]:
        """Row order of ``epoch``: epoch 0 by ``data.seed`` itself, each later one by a seed of its own."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # shards read two epochs at most at once, about the wrap
                self._orders.pop(min(self._orders))
            import torch  # here, not at the top: math-verify's workers import this package (bicc.data.verify_worker)

            seed = self.seed if epoch == 0 else self.seed * 1_000_003 + epoch
            self._orders[epoch] = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(seed)).tolist()
        return self._orders[epoch]

    def test_problems(self, n: int) -> list[Problem]:
        if self._test is None:
            problems, _ = load_problems(self.test_source, self.test_fields, self.cfg.test_split, self.cfg.on_bad_row,
                                        subset=self.cfg.test_subset or self.cfg.subset, revision=self.cfg.revision)
            self._test = [self._with_instruction(p) for p in problems]
        return self._test[:n]

    def reward(self, completion: str, problem: Problem) -> float:
        return self.checker.score(completion, problem.answer)

    def reward_many(self, completions: list[str], problems: list[Problem]) -> list[float]:
        return self.checker.score_many(completions, [p.answer for p in problems])
