"""BiCC's contexts as ``rl_step`` builds them, read back as text: every sample's x^c is its own problem followed by
attempts of the opposite partition only, each cut around the middle with the task's own answer line kept.
A scripted engine writes long attempts that end in an 'Answer:' line (an anchor the default anchors do not know),
right on even samples and wrong on odd ones, so every group is mixed and every attempt is cut."""

import re

import pytest
import torch

from bicc.config import StepConfig
from bicc.model.load import build_tiny
from bicc.rollout import Engine, RolloutOutput
from bicc.trainer import step as step_module
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import ARCH

G = 4


class AnswerLineTask:
    """The embedded task, answered on an 'Answer: <n>' line."""

    answer_anchors = ("Answer:",)

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward(self, completion: str, problem) -> float:
        return float(completion.rstrip().endswith(f"Answer: {problem.answer}"))


class LongAttemptEngine(Engine):
    """Sample j of a prompt: 'Work on <expression>:' and 30 + 4j filler characters, then its answer line, right
    (the sum) when j is even and one off when j is odd."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling):
        out = RolloutOutput([], [], [], [])
        for ids in prompts:
            expression = re.search(r"Compute ([0-9+\-]+)\.", self.tokenizer.decode(ids)).group(1)
            value = sum(int(term) for term in re.findall(r"[+-]?\d+", expression))
            for j in range(sampling.n):
                text = f"Work on {expression}: " + "abcdefghij"[j] * (30 + 4 * j) + f" Answer: {value + j % 2}"
                out.prompt_ids.append(list(ids))
                out.completion_ids.append(self.tokenizer(text, add_special_tokens=False)["input_ids"]
                                          + [self.tokenizer.eos_token_id])
                out.texts.append(text)
                out.finished.append(True)
        return out

    def update_weights(self, model, version):
        self.version = version


@pytest.fixture
def step_contexts(tmp_path, monkeypatch):
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    # 100-token outputs: a 40-token budget, 20 per attempt, above the 5-token elision + 'Answer: n' line
    cfg = compose_cfg(["bicc=on", "rcc=on", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=3",
                       f"rollout.group_size={G}", "rollout.max_new_tokens=100", "diag.every=0"])
    s = build_rl_state(cfg, str(tmp_path / "init"), str(tmp_path / "init"), torch.device("cpu"))
    s.task, s.engine = AnswerLineTask(s.task), LongAttemptEngine(tok)
    built = []

    def recording(*args, **kwargs):
        built.append((args, kwargs, build_contexts(*args, **kwargs)))
        return built[-1][2]

    build_contexts = step_module.build_contexts
    monkeypatch.setattr(step_module, "build_contexts", recording)
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    (args, _, contexts), = built
    return s, cfg, tok, args, contexts, metrics


def test_every_context_is_its_own_problem_and_the_opposite_attempts_cut_to_their_answer_line(step_contexts):
    s, cfg, tok, args, contexts, metrics = step_contexts
    prompts, completions, correct = args[0], args[1], args[2]
    texts = [tok.decode(c[:-1]) for c in completions]
    assert metrics["bicc/samples_conditioned_share"] == 1.0 and metrics["bicc/truncated_share"] == 1.0
    assert correct.tolist() == [float(j % 2 == 0) for j in range(G)] * 3
    for i, ids in enumerate(contexts.prompt_ids):
        problem = s.task.train_problem(i // G)
        assert prompts[i] == problem.prompt  # each row's query is its own group's problem
        text = tok.decode(ids)
        head, attempts = text.split(cfg.bicc.preamble)
        assert problem.prompt in head
        opposite = [texts[k] for k in range(i // G * G, i // G * G + G) if correct[k] != correct[i]]
        sections = re.split(r"\nAttempt \d+:\n", attempts)[1:]
        assert len(sections) == len(opposite) == 2
        for section, attempt in zip(sections, opposite):
            kept_head, tail = section.split(cfg.bicc.elision)
            answer_line = attempt[attempt.index(" Answer:"):]
            assert attempt.startswith(kept_head) and len(kept_head) > 0
            assert tail.startswith(answer_line.lstrip())  # the cut keeps the task's own answer line
