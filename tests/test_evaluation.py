"""The embedded evaluation reports pass@1 at the paper's sampling (T 0.6, top-p 0.95) as its headline, the
training temperature beside it (eval.also_temperatures) and greedy accuracy."""

import pytest

from bicc.config import BenchmarkConfig
from bicc.data import build_task, encode_prompt
from bicc.evaluation.evaluate import evaluate, format_eval, markdown_table
from bicc.machine.distributed import Dist
from bicc.model.tokenizer import build_char_tokenizer
from bicc.rollout import Engine, RolloutOutput


class TemperatureEngine(Engine):
    """Answers every problem right at T <= 0.6 (greedy included) and right on every other sample at T = 1."""

    def __init__(self, answers: dict[tuple, str]):
        self.answers, self.calls = answers, []

    def generate(self, prompts, sampling):
        self.calls.append((sampling.temperature, sampling.top_p, sampling.n))
        texts = []
        for p in prompts:
            for i in range(sampling.n):
                right = sampling.temperature <= 0.6 or i % 2 == 0
                texts.append(f"\\boxed{{{self.answers[tuple(p)] if right else 'x'}}}")
        rows = len(texts)
        return RolloutOutput([list(p) for p in prompts for _ in range(sampling.n)], [[1, 2]] * rows, texts, [True] * rows)


def test_headline_is_the_paper_sampling_with_training_temperature_and_greedy_beside(cfg):
    assert (cfg.eval.temperature, cfg.eval.top_p, list(cfg.eval.also_temperatures)) == (0.6, 0.95, [1.0])
    cfg.eval.num_problems, cfg.eval.bootstrap_samples = 10, 50
    task, tokenizer = build_task(cfg.data), build_char_tokenizer()
    problems = task.test_problems(10)
    engine = TemperatureEngine({tuple(encode_prompt(tokenizer, p.prompt)): p.answer for p in problems})
    metrics = evaluate(engine, tokenizer, task, cfg.eval, seed=0)
    assert {c[:2] for c in engine.calls} == {(0.6, 0.95), (1.0, 1.0), (0.0, 1.0)}
    assert metrics["eval/pass@1"] == 1.0 and metrics["eval/arith/pass@1"] == 1.0
    assert metrics["eval/pass@1_T1"] == 0.5  # samples 0 and 2 of 4 right
    assert metrics["eval/greedy_acc"] == 1.0
    assert (metrics["eval/temperature"], metrics["eval/top_p"]) == (0.6, 0.95)
    line = format_eval(metrics)
    assert "pass@1 100.0%" in line and "T=0.6, top-p 0.95" in line and "T=1 pass@1 50.0%" in line
    table = markdown_table(metrics)
    assert "pass@1 T=1" in table.splitlines()[0] and "| 50.0 |" in table.splitlines()[2]


def test_eval_engine_config_is_an_engine_config():
    """Evaluation's engine gets the run's rollout engine settings, evaluation's batch size, no sleep mode and
    no sampling log-probs; the eval config alone lacks what a vLLM engine reads (``vllm.sleep``)."""
    from omegaconf.errors import ConfigAttributeError

    from bicc.rollout import EngineOptions, eval_engine_config
    from bicc.rollout.engines.vllm import engine_args
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["rollout=vllm", "rollout.vllm.sleep=true", "rollout.old_from_sampler=true", "eval.batch_size=7"])
    engine_cfg = eval_engine_config(cfg.rollout, cfg.eval)
    assert engine_cfg.batch_size == 7 and engine_cfg.vllm.sleep is False and engine_cfg.old_from_sampler is False
    assert engine_cfg.vllm.gpu_memory_utilization == cfg.rollout.vllm.gpu_memory_utilization
    assert engine_args("m", "bfloat16", engine_cfg, EngineOptions(), cuda=True)["enable_sleep_mode"] is False
    with pytest.raises(ConfigAttributeError):
        engine_args("m", "bfloat16", cfg.eval, EngineOptions(), cuda=True)


class ScriptedEngine(Engine):
    """Decodes each prompt and answers by its text: the embedded task's sums always right; file problem
    "half" right in all 4 samples (as a fraction the checker must match to 0.5), "four" in sample 0 only."""

    def __init__(self, tokenizer, task_answers: dict[str, str]):
        self.tokenizer, self.task_answers, self.prompts = tokenizer, task_answers, []

    def answer(self, text: str, i: int) -> str:
        if "half" in text:
            return "\\frac{1}{2}"
        if "four" in text:
            return "4" if i == 0 else "5"
        return next(a for q, a in self.task_answers.items() if q in text)

    def generate(self, prompts, sampling):
        texts = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            self.prompts.append(text)
            texts += [f"so \\boxed{{{self.answer(text, i)}}}" for i in range(sampling.n)]
        rows = len(texts)
        return RolloutOutput([list(p) for p in prompts for _ in range(sampling.n)], [[1, 2, 3]] * rows, texts,
                             [True] * rows)


@pytest.mark.launch
def test_a_task_and_a_file_benchmark_with_hand_computed_pass_at_k(cfg, tmp_path):
    """Two benchmarks in one evaluation. The file's problems get the instruction, the task's do not; the file's
    answers go through the math checker (\\frac{1}{2} = 0.5); pass@k by hand for n = 4: problem "half" 4/4 right,
    "four" 1/4, so pass@1 = (1 + 1/4)/2 = 0.625, pass@2 = (1 + (1 - C(3,2)/C(4,2)))/2 = (1 + 1/2)/2 = 0.75,
    pass@4 = 1. The first benchmark also appears under the short names; per-problem rows are written."""
    import json

    path = tmp_path / "mini.jsonl"
    path.write_text(json.dumps({"id": "h", "problem": "What is a half?", "answer": "0.5"}) + "\n"
                    + json.dumps({"id": "f", "problem": "What is two and two? (four)", "answer": "4"}) + "\n")
    cfg.eval.benchmarks = [BenchmarkConfig(name="arith", source="task"), BenchmarkConfig(name="mini", source=str(path))]
    cfg.eval.num_problems, cfg.eval.samples_per_problem, cfg.eval.ks = 3, 4, [1, 2, 4]
    cfg.eval.also_temperatures, cfg.eval.greedy, cfg.eval.bootstrap_samples, cfg.eval.checker_workers = [], False, 50, 1
    task, tokenizer = build_task(cfg.data), build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, {p.prompt: p.answer for p in task.test_problems(3)})
    metrics = evaluate(engine, tokenizer, task, cfg.eval, seed=0, out_dir=tmp_path / "out")

    assert metrics["eval/arith/pass@1"] == 1.0 and metrics["eval/arith/num_problems"] == 3
    assert metrics["eval/mini/pass@1"] == pytest.approx(0.625) and metrics["eval/mini/num_problems"] == 2
    assert metrics["eval/mini/pass@2"] == pytest.approx(0.75) and metrics["eval/mini/pass@4"] == pytest.approx(1.0)
    assert 0.25 <= metrics["eval/mini/pass@1_ci_low"] <= 0.625 <= metrics["eval/mini/pass@1_ci_high"] <= 1.0
    assert metrics["eval/pass@1"] == metrics["eval/arith/pass@1"] and metrics["eval/num_problems"] == 3
    assert "eval/mini/greedy_acc" not in metrics and not any("_T" in k for k in metrics)
    instructed = [p for p in engine.prompts if cfg.eval.instruction in p]
    assert len(engine.prompts) == 5 and len(instructed) == 2 and all("?" in p for p in instructed)
    rows = [json.loads(line) for line in (tmp_path / "out" / "mini" / "per_problem.jsonl").read_text().splitlines()]
    assert [(r["id"], r["correct"], r["accuracy"]) for r in rows] == [("h", 4, 1.0), ("f", 1, 0.25)]
    assert rows[1]["sample"] == "so \\boxed{4}"  # the first sample's text
    table = markdown_table(metrics, ks=(1, 2, 4, 8))
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| arith", "| mini"]
    assert "| 75.0 | 100.0 | — |" in table.splitlines()[3]  # pass@2, pass@4; no greedy


def test_a_benchmark_without_problems_is_named(cfg, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    cfg.eval.benchmarks = [BenchmarkConfig(name="empty", source=str(path))]
    task, tokenizer = build_task(cfg.data), build_char_tokenizer()
    with pytest.raises(ValueError, match="empty"):
        evaluate(ScriptedEngine(tokenizer, {}), tokenizer, task, cfg.eval, seed=0)


def test_split_problems_are_placed_by_problem_and_sample():
    """4 samples of 3 problems over 2 shards in calls of at most 3 rows: problem 1 is split by the shards' edge and
    every problem by the call size. The engine answers right on the first row of each call for a problem, so the
    right samples are the first sample of each call, wherever plan_calls puts it."""
    from bicc.evaluation.evaluate import _sampled_rewards, plan_calls
    from bicc.rollout import SamplingParams

    class FirstRowEngine(Engine):
        def generate(self, prompts, sampling):
            texts = ["right" if j == 0 else "wrong" for _ in prompts for j in range(sampling.n)]
            rows = len(texts)
            return RolloutOutput([[1]] * rows, [[2]] * rows, texts, [True] * rows)

    class Source:
        def score_many(self, texts, owners):
            return [float(t == "right") for t in texts]

    n, problems = 4, ["p0", "p1", "p2"]
    rewards, lengths, first = _sampled_rewards(FirstRowEngine(), [[i] for i in range(3)], problems, Source(),
                                               SamplingParams(n, 0.6, 0.95, 8, 0), 3, "test", False, Dist(), shards=2)
    expected = [[0.0] * n for _ in problems]
    for calls in plan_calls(3, n, 3, 2):
        for call in calls:
            for p in range(call.first, call.first + call.problems):
                expected[p][call.sample] = 1.0
    assert rewards.tolist() == expected
    assert expected != [[1.0, 0.0, 0.0, 0.0]] * 3  # some calls start past sample 0: placement by sample is exercised
    assert first == ["right"] * 3 and lengths == [1] * 12
