"""Held-out evaluation on one or more benchmarks (``eval.benchmarks``).

Per benchmark: n samples per problem; per-problem correct counts; pass@1 = mean over samples, then
over problems; unbiased pass@k for every configured k <= n; a 95% bootstrap CI over problems for each;
greedy accuracy when asked. A benchmark's problems come from the training task's test split
(``source: task``, scored by the task's own reward) or from a file / HF dataset (scored by
``bicc.data.checking.MathChecker`` with the benchmark's extractors).

Metric names: ``eval/<benchmark>/<metric>``; the first benchmark's metrics are also given without the
benchmark name (``eval/pass@1`` ...), which is what training logs and run tables read.

Several processes (``dist``): the (problem, sample) rows are cut into ``eval.shards`` runs of equal size (one
per process by default), each generated and scored by its rank in calls seeded by their place in the grid, then
gathered over the CPU group, so ranks finish together and one process with ``eval.shards=W`` computes what W
processes compute. A call holds at most ``eval.batch_size`` rows and, under ``eval.batch_tokens``, at most
that many tokens of prompt plus new tokens (what HF generate's KV cache grows to).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bicc.data import Problem, encode_prompt, task_rewards
from bicc.data.benchmarks import FieldNames, is_absent_file, load_problems
from bicc.data.checking import MathChecker
from bicc.evaluation.stats import bootstrap_ci, pass_at_k_table
from bicc.machine import distributed
from bicc.machine.distributed import Dist
from bicc.machine.progress import progress as progress_bar
from bicc.rollout import SamplingParams


class TaskBenchmark:
    """``source: task``: the task's own test problems and prompts, scored by the task's reward."""

    def __init__(self, bench, task, eval_cfg):
        self.task, self.limit = task, eval_cfg.limit or eval_cfg.num_problems

    def problems(self) -> list[Problem]:
        return self.task.test_problems(self.limit)

    def prompt(self, tokenizer, problem: Problem) -> list[int]:
        return encode_prompt(tokenizer, problem.prompt)

    def score_many(self, texts: list[str], problems: list[Problem]) -> list[float]:
        return task_rewards(self.task, texts, problems)

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
        return load_problems(source, fields, split, self.eval_cfg.on_bad_row, self.eval_cfg.limit, subset=b.subset,
                             revision=b.revision)[0]

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


@dataclass(frozen=True)
class EvalCall:
    """One generate call: problems ``first .. first + problems - 1``, samples ``sample .. sample + n - 1`` of each."""

    first: int
    problems: int
    sample: int
    n: int

    def seed(self, seed: int) -> int:
        """A function of the call's place in the (problem, sample) grid, never of the rank that makes it."""
        return seed * 1_000_003 + self.first + 1_000_033 * self.sample


def plan_calls(num_problems: int, n: int, rows_per_call: int, shards: int) -> list[list[EvalCall]]:
    """The generate calls of each of ``shards`` shards. The num_problems x n (problem, sample) rows, problem-major,
    are cut into ``shards`` runs whose sizes differ by at most one row; each run into calls of at most
    ``rows_per_call`` rows, whole problems where they fit (a problem split by a shard's edge, or with more
    samples than a call holds, goes in calls of its own)."""
    total, plan = num_problems * n, []
    for s in range(shards):
        row, end, calls = s * total // shards, (s + 1) * total // shards, []
        while row < end:
            p, j = divmod(row, n)
            if j == 0 and n <= rows_per_call and end - row >= n:
                k = min((end - row) // n, rows_per_call // n)
                calls.append(EvalCall(p, k, 0, n))
                row += k * n
            else:
                count = min(n - j, end - row, rows_per_call)
                calls.append(EvalCall(p, 1, j, count))
                row += count
        plan.append(calls)
    return plan


def rows_per_call(eval_cfg, longest_prompt: int, paged: bool = False) -> int:
    """eval.batch_size rows, fewer when eval.batch_tokens caps rows x (longest prompt + eval.max_new_tokens);
    ``paged`` (vLLM, which sizes its own KV cache): the rows alone."""
    rows = eval_cfg.batch_size
    if eval_cfg.batch_tokens and not paged:
        rows = min(rows, eval_cfg.batch_tokens // (longest_prompt + eval_cfg.max_new_tokens))
    return max(1, rows)


def _sampled_rewards(engine, prompts, problems, source, sampling: SamplingParams, rows: int, desc: str,
                     progress: bool, d: Dist, shards: int | None = None):
    """One sampled pass over every problem: this rank's shards of (problem, sample) rows generated and scored
    here, then gathered. Returns rewards [P, n], the completion lengths (problem-major) and the first sample's
    text of each problem, the same on every rank."""
    n, P = sampling.n, len(problems)
    shards = shards or d.world
    plan = plan_calls(P, n, rows, shards)
    mine_calls = [c for s in distributed.shards_of_rank(shards, d) for c in plan[s]]
    bar = progress_bar(len(mine_calls), desc, progress, leave=False)
    mine = []
    for call in mine_calls:
        part = SamplingParams(call.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens, call.seed(sampling.seed))
        out = engine.generate(prompts[call.first : call.first + call.problems], part)
        owners = [problems[call.first + i // call.n] for i in range(len(out.texts))]
        mine.append((call, source.score_many(out.texts, owners), [len(c) for c in out.completion_ids], out.texts))
        bar.update(1)
    bar.close()
    rewards, lengths = np.full((P, n), np.nan), np.zeros((P, n), dtype=int)
    first_texts = [""] * P
    for theirs in distributed.all_gather_objects(mine, d):  # every rank's calls, placed by (problem, sample)
        for call, scores, lens, texts in theirs:
            for i, (score, length, text) in enumerate(zip(scores, lens, texts)):
                p, j = call.first + i // call.n, call.sample + i % call.n
                rewards[p, j], lengths[p, j] = score, length
                if j == 0:
                    first_texts[p] = text
    if np.isnan(rewards).any():
        raise RuntimeError(f"{desc}: {int(np.isnan(rewards).sum())} (problem, sample) rows were not evaluated")
    return rewards, lengths.flatten().tolist(), first_texts


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
    rows = rows_per_call(eval_cfg, max(len(p) for p in prompts), paged=engine.model is None)
    try:
        score = lambda sampling, desc: _sampled_rewards(  # noqa: E731
            engine, prompts, problems, source, sampling, rows, desc, progress, d, eval_cfg.shards)
        rewards, lengths, first_texts = score(
            SamplingParams(n, eval_cfg.temperature, eval_cfg.top_p, eval_cfg.max_new_tokens, seed), f"eval {bench.name}")
        extra = {t: score(SamplingParams(n, t, 1.0, eval_cfg.max_new_tokens, seed), f"eval {bench.name} T={t:g}")[0]
                 for t in eval_cfg.also_temperatures}
        greedy_rewards = None
        if eval_cfg.greedy:
            greedy_rewards = score(SamplingParams(1, 0.0, 1.0, eval_cfg.max_new_tokens, seed), f"greedy {bench.name}")[0][:, 0]
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
            with open(out_dir / bench.name / "per_problem.jsonl", "w", encoding="utf-8") as f:
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
