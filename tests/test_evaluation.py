"""The embedded evaluation reports pass@1 at the paper's sampling (T 0.6, top-p 0.95) as its headline, the
training temperature beside it (eval.also_temperatures) and greedy accuracy."""

import pytest

from bicc.data import build_task, encode_prompt
from bicc.evaluation import evaluate, format_eval, markdown_table
from bicc.rollout import RolloutOutput
from bicc.tokenizer import build_char_tokenizer


class TemperatureEngine:
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
    no sampling log-probs; the eval config alone lacks what a vLLM engine reads (``sleep``)."""
    from omegaconf.errors import ConfigAttributeError

    from bicc.rollout import EngineOptions, eval_engine_config
    from bicc.rollout.vllm import engine_args
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["rollout=vllm", "rollout.sleep=true", "rollout.old_from_sampler=true", "eval.batch_size=7"])
    engine_cfg = eval_engine_config(cfg.rollout, cfg.eval)
    assert engine_cfg.batch_size == 7 and engine_cfg.sleep is False and engine_cfg.old_from_sampler is False
    assert engine_cfg.gpu_memory_utilization == cfg.rollout.gpu_memory_utilization
    assert engine_args("m", "bfloat16", engine_cfg, EngineOptions(), cuda=True)["enable_sleep_mode"] is False
    with pytest.raises(ConfigAttributeError):
        engine_args("m", "bfloat16", cfg.eval, EngineOptions(), cuda=True)
