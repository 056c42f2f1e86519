"""Held-out evaluation on one or more benchmarks (``eval.benchmarks``).

Per benchmark: n samples per problem; per-problem correct counts; pass@1 = mean over samples, then
over problems; unbiased pass@k for every configured k <= n; a 95% bootstrap CI over problems for each;
greedy accuracy when asked. A benchmark's problems come from the training task's test split
(``source: task``, scored by the task's own reward) or from a file / HF dataset (scored by
``bicc.checking.MathChecker`` with the benchmark's extractors).

Metric names: ``eval/<benchmark>/<metric>``; the first benchmark's metrics are also given without the
benchmark name (``eval/pass@1`` ...), which is what training logs and run tables read.

Several processes (``dist``): problems are cut into the same chunks as in one process, each seeded by its
position, and chunk c is generated and scored by rank c mod W; the scores are gathered, so every rank
returns the metrics one process would compute (same engine numerics), and no rank idles in a collective
while another evaluates alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bicc.checking import MathChecker
from bicc.data import Problem, encode_prompt
from bicc.data.benchmarks import FieldNames, is_absent_file, load_problems
from bicc.distributed import Dist, all_gather_objects
from bicc.progress import progress as progress_bar
from bicc.rollout import SamplingParams
from bicc.stats import bootstrap_ci, pass_at_k_table


class TaskBenchmark:
    """``source: task``: the task's own test problems and prompts, scored by the task's reward."""

    def __init__(self, bench, task, eval_cfg):
        self.task, self.limit = task, eval_cfg.limit or eval_cfg.num_problems

    def problems(self) -> list[Problem]:
        return self.task.test_problems(self.limit)

    def prompt(self, tokenizer, problem: Problem) -> list[int]:
        return encode_prompt(tokenizer, problem.prompt)

    def score_many(self, texts: list[str], problems: list[Problem]) -> list[float]:
        if hasattr(self.task, "reward_many"):
            return self.task.reward_many(texts, problems)
        return [self.task.reward(t, p) for t, p in zip(texts, problems)]

    def close(self) -> None:
        pass


class FileBenchmark:
    """A benchmark file or HF dataset: the problem plus the instruction, in the model's chat template when it has
    one, scored by the math checker with the benchmark's extractors (its worker pool started on first use)."""

    def __init__(self, bench, task, eval_cfg):
        self.bench, self.eval_cfg = bench, eval_cfg
        self.checker = None

    def problems(self) -> list[Problem]:
        """From ``source``; from the benchmark's HF fallback (``hub.id``, its own fields) when that file is absent."""
        b = self.bench
        source, fields, split = b.source, FieldNames(b.problem_field, b.answer_field, b.id_field), b.split
        if b.hub.id and is_absent_file(b.source):
            print(f"[data] {b.name}: {b.source} is absent; loading the HF dataset {b.hub.id}[{b.hub.split}] instead")
            source, fields, split = b.hub.id, FieldNames(b.hub.problem_field, b.hub.answer_field, b.hub.id_field), b.hub.split
        return load_problems(source, fields, split, self.eval_cfg.on_bad_row, self.eval_cfg.limit)[0]

    def prompt(self, tokenizer, problem: Problem) -> list[int]:
        instruction = self.eval_cfg.instruction
        text = f"{problem.prompt}\n\n{instruction}" if instruction else problem.prompt
        if getattr(tokenizer, "chat_template", None):
            return encode_prompt(tokenizer, text)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def score_many(self, texts: list[str], problems: list[Problem]) -> list[float]:
        if self.checker is None:
            self.checker = MathChecker(extractors=tuple(self.bench.extractors), workers=self.eval_cfg.checker_workers,
                                       deadline_s=self.eval_cfg.checker_deadline_s)
        return self.checker.score_many(texts, [p.answer for p in problems])

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()


def benchmark_source(bench, task, eval_cfg):
    """Where a benchmark's problems, prompts and scores come from (``bench.source``), resolved once."""
    return (TaskBenchmark if bench.source == "task" else FileBenchmark)(bench, task, eval_cfg)


def _generate(engine, prompts, sampling: SamplingParams, chunk: int, desc: str, progress: bool, d: Dist = Dist()):
    """Generate in chunks of prompts (progress bar; each chunk seeded from the call's seed and its
    position, so the result does not depend on how chunks are shared out). Returns this rank's chunks as
    {chunk start: (texts, lengths)}: chunk k goes to rank k mod W."""
    starts = list(range(0, len(prompts), chunk))[d.rank :: d.world]
    done = {}
    bar = progress_bar(len(starts), desc, progress, leave=False)
    for start in starts:
        part = SamplingParams(sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                              sampling.seed * 1_000_003 + start)
        out = engine.generate(prompts[start : start + chunk], part)
        done[start] = (out.texts, [len(c) for c in out.completion_ids])
        bar.update(1)
    bar.close()
    return done


def _score(source, problems, texts, n) -> np.ndarray:
    """Rewards as a [num_problems, n] array; rows follow ``problems``."""
    scores = source.score_many(texts, [problems[i // n] for i in range(len(texts))])
    return np.asarray(scores, dtype=float).reshape(len(problems), n)


def _sampled_rewards(engine, prompts, problems, source, sampling: SamplingParams, chunk: int, desc: str,
                     progress: bool, d: Dist):
    """One sampled pass over every problem, scored where generated and gathered: rewards [P, n], the
    completion lengths and the first sample's text of each problem (the same on every rank)."""
    n = sampling.n
    mine = {start: (_score(source, problems[start : start + chunk], texts, n).tolist(), lengths, texts[::n])
            for start, (texts, lengths) in _generate(engine, prompts, sampling, chunk, desc, progress, d).items()}
    parts = {}
    for theirs in all_gather_objects(mine, d):  # every chunk's scores, on every rank
        parts.update(theirs)
    order = sorted(parts)
    rewards = np.concatenate([np.asarray(parts[k][0], dtype=float).reshape(-1, n) for k in order])
    return rewards, [x for k in order for x in parts[k][1]], [t for k in order for t in parts[k][2]]


def temperature_key(temperature: float) -> str:
    """Metric suffix of an extra sampled pass (top-p 1): ``pass@1_T1``."""
    return f"pass@1_T{temperature:g}"


def evaluate_benchmark(engine, tokenizer, task, bench, eval_cfg, seed: int, progress: bool = False, d: Dist = Dist()):
    """Metrics of one benchmark and its per-problem records (the same on every rank)."""
    start = time.perf_counter()
    source = benchmark_source(bench, task, eval_cfg)  # one per rank: it scores that rank's answers
    problems = source.problems()
    if not problems:
        raise ValueError(f"benchmark {bench.name}: no problems loaded from {bench.source}")
    prompts = [source.prompt(tokenizer, p) for p in problems]
    n = eval_cfg.samples_per_problem
    chunk = max(1, eval_cfg.batch_size // n)
    try:
        score = lambda sampling, size, desc: _sampled_rewards(  # noqa: E731
            engine, prompts, problems, source, sampling, size, desc, progress, d)
        rewards, lengths, first_texts = score(
            SamplingParams(n, eval_cfg.temperature, eval_cfg.top_p, eval_cfg.max_new_tokens, seed), chunk,
            f"eval {bench.name}")
        extra = {t: score(SamplingParams(n, t, 1.0, eval_cfg.max_new_tokens, seed), chunk, f"eval {bench.name} T={t:g}")[0]
                 for t in eval_cfg.also_temperatures}
        greedy_rewards = None
        if eval_cfg.greedy:
            greedy_rewards = score(SamplingParams(1, 0.0, 1.0, eval_cfg.max_new_tokens, seed), chunk * n,
                                   f"greedy {bench.name}")[0][:, 0]
    finally:
        source.close()
    correct = (rewards > 0.5).sum(axis=1).astype(int)
    per_problem = rewards.mean(axis=1)
    lo, hi = bootstrap_ci(per_problem, eval_cfg.bootstrap_samples, seed=seed)
    prefix = f"eval/{bench.name}/"
    metrics = {
        prefix + "pass@1": float(per_problem.mean()),
        prefix + "pass@1_ci95": (hi - lo) / 2 if len(problems) > 1 else float("nan"),
        prefix + "pass@1_ci_low": lo,
        prefix + "pass@1_ci_high": hi,
        prefix + "num_problems": len(problems),
        prefix + "samples_per_problem": n,
        prefix + "temperature": float(eval_cfg.temperature),
        prefix + "top_p": float(eval_cfg.top_p),
        prefix + "response_len": float(np.mean(lengths)),
    }
    table = pass_at_k_table(n, correct.tolist(), eval_cfg.ks)
    for k, values in table.items():
        if k == 1:
            continue
        k_lo, k_hi = bootstrap_ci(values, eval_cfg.bootstrap_samples, seed=seed)
        metrics[prefix + f"pass@{k}"] = float(values.mean())
        metrics[prefix + f"pass@{k}_ci_low"], metrics[prefix + f"pass@{k}_ci_high"] = k_lo, k_hi
    for t, r in extra.items():
        metrics[prefix + temperature_key(t)] = float(r.mean())
    if greedy_rewards is not None:
        metrics[prefix + "greedy_acc"] = float(greedy_rewards.mean())
    metrics[prefix + "seconds"] = time.perf_counter() - start
    records = [{"id": p.id, "answer": p.answer, "n": n, "correct": int(c), "accuracy": float(a),
                **({"greedy": float(greedy_rewards[i])} if greedy_rewards is not None else {}),
                **{temperature_key(t): float(r[i].mean()) for t, r in extra.items()},
                "sample": first_texts[i][:2000]}
               for i, (p, c, a) in enumerate(zip(problems, correct, per_problem))]
    return metrics, records


def evaluate(engine, tokenizer, task, eval_cfg, seed: int, out_dir: Path | None = None,
             progress: bool = False, d: Dist = Dist()) -> dict[str, float]:
    """Every benchmark of ``eval_cfg`` (shared out over the ranks of ``d``, each of which must call this);
    per-problem JSONL under ``out_dir/<benchmark>/`` when given, written by rank 0."""
    metrics: dict[str, float] = {}
    for i, bench in enumerate(eval_cfg.benchmarks):
        m, records = evaluate_benchmark(engine, tokenizer, task, bench, eval_cfg, seed, progress and d.is_main, d)
        metrics.update(m)
        if i == 0:  # the headline benchmark, under short names
            metrics.update({"eval/" + k.split("/", 2)[2]: v for k, v in m.items()})
        if out_dir is not None and d.is_main:
            (out_dir / bench.name).mkdir(parents=True, exist_ok=True)
            with open(out_dir / bench.name / "per_problem.jsonl", "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
    return metrics


def benchmark_names(metrics: dict) -> list[str]:
    names = []
    for key in metrics:
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "pass@1" and parts[1] not in names:
            names.append(parts[1])
    return names


def markdown_table(metrics: dict, ks=(1, 2, 4, 8, 16, 32)) -> str:
    """One row per benchmark: pass@1 with its bootstrap CI (and its sampling), pass@k, pass@1 of the extra
    temperatures, greedy accuracy."""
    names = benchmark_names(metrics)
    shown = [k for k in ks if k > 1 and any(f"eval/{b}/pass@{k}" in metrics for b in names)]
    extras = sorted({k.split("/")[2] for k in metrics if k.count("/") == 2 and k.split("/")[2].startswith("pass@1_T")})
    head = ["benchmark", "problems", "n", "pass@1 (95% CI)", *[f"pass@{k}" for k in shown],
            *[e.replace("pass@1_T", "pass@1 T=") for e in extras], "greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for b in names:
        p = f"eval/{b}/"
        cells = [b, str(metrics[p + "num_problems"]), str(metrics[p + "samples_per_problem"]),
                 f"{100 * metrics[p + 'pass@1']:.1f} [{100 * metrics[p + 'pass@1_ci_low']:.1f}, "
                 f"{100 * metrics[p + 'pass@1_ci_high']:.1f}]"]
        cells += [f"{100 * metrics[p + f'pass@{k}']:.1f}" if p + f"pass@{k}" in metrics else "—" for k in shown]
        cells += [f"{100 * metrics[p + e]:.1f}" if p + e in metrics else "—" for e in extras]
        cells.append(f"{100 * metrics[p + 'greedy_acc']:.1f}" if p + "greedy_acc" in metrics else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_eval(metrics: dict[str, float]) -> str:
    """One line: the headline pass@1 with its sampling, then the extra temperatures and greedy accuracy."""
    sampling = ""
    if "eval/temperature" in metrics:
        sampling = f"T={metrics['eval/temperature']:g}, top-p {metrics['eval/top_p']:g}; "
    text = (f"pass@1 {100 * metrics['eval/pass@1']:.1f}% ± {100 * metrics['eval/pass@1_ci95']:.1f} "
            f"({sampling}{metrics['eval/num_problems']} problems × {metrics['eval/samples_per_problem']} samples)")
    for key in sorted(k for k in metrics if k.startswith("eval/pass@1_T")):
        text += f", T={key.removeprefix('eval/pass@1_T')} pass@1 {100 * metrics[key]:.1f}%"
    if "eval/greedy_acc" in metrics:
        text += f", greedy {100 * metrics['eval/greedy_acc']:.1f}%"
    return text
