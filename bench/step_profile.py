"""Where an RL step's time goes, and what length-aware batching and the step plan save.

Run: ``.venv/bin/python -m bench.step_profile [--lengths task|realistic] [hydra overrides...]``.

``--lengths task`` (default): the embedded default (tiny model, its cached warm start, real rollouts). Times
``--steps`` calls of ``bicc.trainer.step.rl_step`` after ``--warmup`` and splits them with the step's own timers
(``perf/``): generate, the plan's no-grad passes, the update's forward, backward and optimizer step, the
diagnostics (``diag.every``: their own forwards and backwards); the rest is loop overhead (tokenising, rewards,
batching, contexts, advantages, metrics). Ends with
``RESULT loop_overhead_share=<share> target<=0.05`` and ``RESULT passes_per_step=<no-grad passes + 1 update>``.

``--lengths realistic``: a random-init Qwen3 of >= 10M parameters, 8 queries x G = 8, outputs up to 256
tokens whose lengths follow the labelled completions' (``../shared/data/labelled_completions.jsonl``, scaled
so that the 99th percentile is ``rollout.max_new_tokens``). The rollout decodes every token for real (EOS held back
until the row's drawn length, so generation costs what such outputs cost) and half of each group is scored
correct, so every BiCC group is conditioned. Three measurements:
- the training part of one fixed rollout (no-grad passes + update), as before this batching (every row padded
  to the step's longest, pi_old by its own pass, fixed micro-batches of ``--micro`` rows) and as now
  (length-aware micro-batches under ``rows x longest <= --micro x longest row``, pi_old from the update's own
  forward), alternating: ``RESULT padding_share=<padded tokens computed / real tokens - 1> target<=0.10``
  and ``RESULT step_speedup_vs_padded=<before / now> target>=1.4``, with the weights after each update
  compared (same rows, same gradient);
- full steps (rollout included) of GRPO, of the paper's BiCC + RCC and of BiCC + RCC with pi_old on q from
  the sampler (one no-grad pass fewer), alternating:
  ``RESULT full_step_ratio_bicc_rcc=<BiCC+RCC step / GRPO step> target<=1.15``, beside the ratio that
  the model FLOPs of the two steps' passes and updates allow (``bench.flops``, ``full_step_at_equal_flop_cost``);
- ``RESULT passes_per_step_bicc_rcc=<n>`` for ``bicc=on rcc=on`` (and with ``rollout.old_from_sampler``).

Timings are only meaningful on a quiet machine (nothing else running on its cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from bicc.config import TinyArchConfig, register_configs
from bicc.data import build_task
from bicc.kernels.batching import trim_rows
from bicc.kernels.rows import QueryRows
from bicc.machine.host import torch_threads
from bicc.method.advantages import Advantages
from bicc.model.load import build_tiny, num_parameters
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.rollout.collect import Collection, DataCursor, collect_rollout
from bicc.rollout.hf import HFEngine
from bicc.trainer.plan import StepPlan, step_logprobs
from bicc.trainer.sft import warm_start
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from bicc.trainer.update import update_policy
from bicc.trainer.validation import validate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "labelled_completions.jsonl"
LARGE = dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1152, num_attention_heads=6,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
REALISTIC = ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=256",
             "rollout.batch_size=64", "train.micro_batch_size=64", "optim.lr=1e-5", "diag.every=0"]
PAPER = ["bicc=on", "rcc=on"]
LEAN = ["rollout.old_from_sampler=true"]  # the paper's method, pi_old on q from the sampler: one pass fewer


def compose_cfg(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"sft.cache_dir={ROOT / '.cache' / 'bicc'}", *overrides])
    validate(cfg)
    return cfg


def phase_split(records: list[dict]) -> dict[str, float]:
    """Seconds per phase summed over steps, from the step's ``perf/`` metrics."""
    keys = {"generate": "perf/generate_s", "no-grad passes": "perf/logprob_s", "update forward": "perf/update_forward_s",
            "update backward": "perf/update_backward_s", "optimizer": "perf/update_optimizer_s",
            "diagnostics": "perf/diagnostics_s"}
    out = {name: sum(r.get(key, 0.0) for r in records) for name, key in keys.items()}
    out["step"] = sum(r["perf/step_s"] for r in records)
    out["overhead"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def report(split: dict[str, float], steps: int) -> None:
    total = split["step"]
    print(f"{steps} steps, {total:.1f}s (median-free sum); " + ", ".join(
        f"{name} {value:.2f}s ({value / total:.0%})" for name, value in split.items() if name != "step"))


def task_profile(overrides: list[str], warmup: int, steps: int) -> None:
    cfg = compose_cfg(overrides)
    torch.set_num_threads(torch_threads(cfg.threads))
    device = torch.device("cpu")
    init_path = str(warm_start(cfg, build_task(cfg.data), device, progress=False))
    state = build_rl_state(cfg, init_path, init_path, device)
    print(f"passes per step: {' -> '.join(state.plan.passes())}")
    for _ in range(warmup):
        rl_step(state, cfg)
    records = [rl_step(state, cfg)[0] for _ in range(steps)]
    split = phase_split(records)
    report(split, steps)
    print(f"median step {statistics.median(r['perf/step_s'] for r in records):.3f}s")
    print(f"RESULT loop_overhead_share={split['overhead'] / split['step']:.3f} target<=0.05")
    print(f"RESULT passes_per_step={len(state.plan.passes())}")


# ---- realistic lengths -------------------------------------------------------------------------------


def drawn_lengths(max_tokens: int, tokenizer) -> torch.Tensor:
    """Token lengths of the labelled completions under ``tokenizer``, scaled so that the 99th percentile is
    ``max_tokens`` (the longest is 5 x that percentile: scaling by it would squeeze the rest to a few
    tokens); the 1% above are truncated there, as a run truncates them."""
    texts = [json.loads(line)["completion"] for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    lengths = torch.tensor([len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts], dtype=torch.float)
    return (lengths * max_tokens / lengths.quantile(0.99)).round().clamp(2, max_tokens).long()


class DrawnLengthEngine(HFEngine):
    """HF sampling whose outputs end at lengths drawn from ``lengths``: EOS is held back (no token ends an
    output) and each row is cut at its drawn length, its last token replaced by EOS. Every token is decoded
    for real, so the rollout costs what outputs of those lengths cost."""

    def __init__(self, model, tokenizer, rollout_cfg, lengths: torch.Tensor):
        super().__init__(model, tokenizer, rollout_cfg)
        self.lengths = lengths
        self.end_ids = [len(tokenizer) + 1]  # no sampled id: generation runs to max_new_tokens

    def generate(self, prompts, sampling):
        gen = torch.Generator().manual_seed(sampling.seed)
        n = len(prompts) * sampling.n
        drawn = self.lengths[torch.randint(len(self.lengths), (n,), generator=gen)].clamp(max=sampling.max_new_tokens)
        out = super().generate(prompts, replace(sampling, max_new_tokens=int(drawn.max())))
        eos = self.tokenizer.eos_token_id
        out.completion_ids = [ids[: int(k) - 1] + [eos] for ids, k in zip(out.completion_ids, drawn)]
        if out.logprobs is not None:  # (the EOS put in last keeps the replaced token's log-prob: timing only)
            out.logprobs = [lp[: int(k)] for lp, k in zip(out.logprobs, drawn)]
        out.finished = [True] * n
        out.texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return out


class HalfCorrect:
    """The task, with every other sample of a group scored correct (random outputs are never right)."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_many(self, texts, golds):
        return [float(i % 2 == 0) for i in range(len(texts))]


class PaddedNumerator(QueryRows):
    """The numerator before length-aware batching: every micro-batch is computed on the step's full width."""

    def logprobs(self, model, rows, temperature: float, with_entropy: bool = False):
        return batch_logprobs(model, self.batch.rows(rows), temperature, with_entropy)


def realistic_state(cfg, init_path: str, lengths: torch.Tensor):
    state = build_rl_state(cfg, init_path, init_path, torch.device("cpu"))
    state.engine = DrawnLengthEngine(state.model, state.tokenizer, cfg.rollout, lengths)
    state.task = HalfCorrect(state.task)
    return state


def computed_tokens(numerator, plan_rows: list[torch.Tensor], trimmed: bool) -> int:
    """Tokens the forwards over ``plan_rows`` compute (rows x the micro-batch's width)."""
    total = 0
    for rows in plan_rows:
        part = numerator.batch.rows(rows)
        total += (trim_rows(part) if trimmed else part).input_ids.numel()
    return total


def training_part(state, cfg, batch, adv, padded: bool, micro: int, seed: int):
    """The no-grad passes and the update on one rollout batch: before (padded) or now; returns seconds."""
    from bicc.kernels.batching import micro_batches

    numerator = PaddedNumerator(batch) if padded else QueryRows(batch)
    run_cfg = copy.deepcopy(cfg)
    run_cfg.train.micro_batch_size = micro if padded else cfg.train.micro_batch_size
    run_cfg.train.micro_batch_tokens = 0 if padded else cfg.train.micro_batch_tokens
    plan = StepPlan.from_config(run_cfg, False)
    if padded:
        plan = plan.with_old_source("forward")
    start = time.perf_counter()
    lp = step_logprobs(plan, state.model, None, numerator, numerator, None, run_cfg, batch.completion_mask)
    update_policy(state, batch, numerator, lp.old, None, Advantages.given(adv), run_cfg, seed)
    seconds = time.perf_counter() - start
    rows = micro_batches(torch.arange(len(adv)), numerator, run_cfg.train.micro_batch_size,
                         run_cfg.train.micro_batch_tokens, state.model, state.dist)
    passes = len(plan.passes())  # the no-grad passes and the update's forward
    return seconds, computed_tokens(numerator, rows, trimmed=not padded) * passes


def full_step_at_equal_flop_cost(states, cfgs, ro, grpo_split: dict[str, float]) -> float:
    """The full-step ratio BiCC+RCC / GRPO if every FLOP cost the same: GRPO's measured step with the time of
    its update's forward and backward scaled by the model FLOPs of BiCC+RCC's passes and update over
    GRPO's (``bench.flops``), on the rows of rollout ``ro``; generation and everything else as GRPO's."""
    from bench.flops import plan_flops
    from bicc.trainer.step import step_inputs

    flops = {}
    for name in ("grpo", "bicc_rcc"):
        s = states[name]
        _, plain, numerator, _, _ = step_inputs(s, cfgs[name], ro, torch.device("cpu"))
        flops[name] = plan_flops(s.plan, s.model, plain, numerator)
    update = grpo_split["update forward"] + grpo_split["update backward"]
    return (grpo_split["step"] + update * (flops["bicc_rcc"] / flops["grpo"] - 1)) / grpo_split["step"]


def realistic_profile(overrides: list[str], micro: int, repeats: int, steps: int) -> None:
    base = compose_cfg([*REALISTIC, "bicc=off", "rcc=off", *overrides])
    torch.set_num_threads(torch_threads(base.threads))
    model, tokenizer = build_tiny(TinyArchConfig(**LARGE), seed=0)
    lengths = drawn_lengths(base.rollout.max_new_tokens, tokenizer)
    print(f"model {num_parameters(model) / 1e6:.1f}M parameters; output lengths: median {int(lengths.median())}, "
          f"max {int(lengths.max())} of {base.rollout.max_new_tokens} ({len(lengths)} labelled completions)")
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        width = max(len(p) for p in [tokenizer(build_task(base.data).train_problem(i).prompt)["input_ids"] for i in range(64)])
        budget = micro * (base.rollout.max_new_tokens + width + 16)  # today's micro-batch size in tokens, chat template included
        cfg = compose_cfg([*REALISTIC, "bicc=off", "rcc=off", f"train.micro_batch_tokens={budget}", *overrides])

        # -- 1. one rollout's training part, before and now --------------------------------------------
        state = realistic_state(cfg, tmp, lengths)
        ro = collect_rollout(state.engine, state.tokenizer, state.task, Collection.from_config(cfg), DataCursor(), seed=0)
        batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id)
        adv = torch.linspace(-1, 1, len(ro.correct))
        real = int(batch.attention_mask.sum())
        start = copy.deepcopy(state.model.state_dict())
        optimizer_state = copy.deepcopy(state.optimizer.state_dict())
        times, tokens, weights = {True: [], False: []}, {}, {}
        for r in range(repeats + 1):  # the first round warms up
            for padded in (True, False):
                state.model.load_state_dict(start)
                state.optimizer.load_state_dict(optimizer_state)
                seconds, tokens[padded] = training_part(state, cfg, batch, adv, padded, micro, seed=1)
                if r:
                    times[padded].append(seconds)
                weights[padded] = {k: v.clone() for k, v in state.model.state_dict().items()}
        diff = max((weights[True][k] - weights[False][k]).abs().max().item() for k in weights[True])
        before, now = statistics.median(times[True]), statistics.median(times[False])
        print(f"training part of one rollout ({len(adv)} rows, {real} real tokens): before {before:.2f}s "
              f"({tokens[True] / real:.2f} x real tokens computed), now {now:.2f}s ({tokens[False] / real:.2f} x); "
              f"weights after the update differ by at most {diff:.1e}")
        passes_now = len(StepPlan.from_config(cfg, False).passes())
        print(f"RESULT padding_share={tokens[False] / (real * passes_now) - 1:.3f} target<=0.10")
        print(f"RESULT step_speedup_vs_padded={before / now:.2f} target>=1.4")

        # -- 2. full steps: GRPO and the paper's BiCC + RCC, alternating -----------------------------
        cfgs = {"grpo": cfg, "bicc_rcc": compose_cfg([*REALISTIC, *PAPER, f"train.micro_batch_tokens={budget}", *overrides]),
                "bicc_rcc_lean": compose_cfg([*REALISTIC, *PAPER, *LEAN, f"train.micro_batch_tokens={budget}", *overrides])}
        states = {name: realistic_state(c, tmp, lengths) for name, c in cfgs.items()}
        records = {name: [] for name in states}
        for k in range(steps + 1):
            for name in states:
                metrics, _ = rl_step(states[name], cfgs[name])
                if k:  # the first step warms up
                    records[name].append(metrics)
        for name in states:
            print(f"{name}: passes {' -> '.join(states[name].plan.passes())}")
            report(phase_split(records[name]), steps)
        median = {name: statistics.median(r["perf/step_s"] for r in records[name]) for name in states}
        print(f"median full step: GRPO {median['grpo']:.2f}s, BiCC+RCC {median['bicc_rcc']:.2f}s, BiCC+RCC with "
              f"{' '.join(LEAN)} {median['bicc_rcc_lean']:.2f}s ({median['bicc_rcc_lean'] / median['grpo']:.3f} x GRPO)")
        equal = full_step_at_equal_flop_cost(states, cfgs, ro, phase_split(records["grpo"]))
        print(f"full-step ratio at equal cost per FLOP: {equal:.3f} "
              "(GRPO's step with its update's forward and backward scaled by BiCC+RCC's model FLOPs over GRPO's)")
        print(f"RESULT full_step_ratio_bicc_rcc={median['bicc_rcc'] / median['grpo']:.3f} target<=1.15")
    sampler = StepPlan.from_config(compose_cfg([*PAPER, "rollout.old_from_sampler=true"]), True)
    print(f"with rollout.old_from_sampler: {len(sampler.passes())} passes ({' -> '.join(sampler.passes())})")
    print(f"RESULT passes_per_step_bicc_rcc={len(states['bicc_rcc'].plan.passes())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", choices=["task", "realistic"], default="task")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (realistic: full steps per config)")
    parser.add_argument("--micro", type=int, default=8, help="realistic: rows per micro-batch before (the presets')")
    parser.add_argument("--repeats", type=int, default=3, help="realistic: timed rounds of the training part")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.lengths == "task":
        task_profile(args.overrides, args.warmup, args.steps)
    else:
        realistic_profile(args.overrides, args.micro, args.repeats, min(args.steps, 5))


if __name__ == "__main__":
    main()
