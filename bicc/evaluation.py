"""Held-out scoring: pass@1 from sampled completions (mean over samples, then over problems) with a
normal-approximation 95% CI over problems, and greedy accuracy."""

from __future__ import annotations

import math

import torch

from bicc.data import encode_prompt
from bicc.rollout import SamplingParams


def score_completions(task, problems, texts: list[str], n: int) -> torch.Tensor:
    """Rewards as a [num_problems, n] tensor; rows follow ``problems``."""
    rewards = [task.reward(text, problems[i // n]) for i, text in enumerate(texts)]
    return torch.tensor(rewards, dtype=torch.float64).view(len(problems), n)


def evaluate(engine, tokenizer, task, eval_cfg, seed: int) -> dict[str, float]:
    problems = task.test_problems(eval_cfg.num_problems)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    n = eval_cfg.samples_per_problem
    sampled = engine.generate(prompts, SamplingParams(n=n, temperature=eval_cfg.temperature, top_p=eval_cfg.top_p,
                                                      max_new_tokens=eval_cfg.max_new_tokens, seed=seed))
    per_problem = score_completions(task, problems, sampled.texts, n).mean(dim=1)  # [num_problems]
    half_width = 1.96 * per_problem.std(unbiased=True).item() / math.sqrt(len(problems)) if len(problems) > 1 else float("nan")
    metrics = {
        "eval/pass@1": per_problem.mean().item(),
        "eval/pass@1_ci95": half_width,
        "eval/num_problems": len(problems),
        "eval/samples_per_problem": n,
        "eval/response_len": sum(map(len, sampled.completion_ids)) / len(sampled.completion_ids),
    }
    if eval_cfg.greedy:
        greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0,
                                                         max_new_tokens=eval_cfg.max_new_tokens, seed=seed))
        metrics["eval/greedy_acc"] = score_completions(task, problems, greedy.texts, 1).mean().item()
    return metrics


def format_eval(metrics: dict[str, float]) -> str:
    text = (f"pass@1 {100 * metrics['eval/pass@1']:.1f}% ± {100 * metrics['eval/pass@1_ci95']:.1f} "
            f"({metrics['eval/num_problems']} problems × {metrics['eval/samples_per_problem']} samples)")
    if "eval/greedy_acc" in metrics:
        text += f", greedy {100 * metrics['eval/greedy_acc']:.1f}%"
    return text
