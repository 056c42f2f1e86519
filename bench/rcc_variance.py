"""Does reward-confidence correction lower the variance of the policy gradient? (paper: by 25-37%)

From one checkpoint (the embedded default's SFT warm start, or ``--ckpt``), for each seed: sample one
rollout batch (the default 16 prompts x 8), build the run's contexts (BiCC as configured), and measure
the relative gradient variance (``bicc.diagnostics.gradient_variance``: K disjoint sets of groups, mean
squared distance of their gradients from the mean, over the mean's squared norm) of the same loss with

- the variant's own advantage (the baseline, GRPO's (r - mean) / std by default),
- RCC's advantage r - mean - 2 Cov(r, delta),
- the mean-centred advantage r - mean (RCC without its correction term, to separate the two effects),

on the very same samples and splits. Reports per-seed ratios and their mean with a 95% t-interval.
Hydra overrides go after the flags: ``.venv/bin/python bench/rcc_variance.py --seeds 12 algo=dapo``.
Ends with ``RESULT rcc_grad_var_ratio=<RCC/baseline> target<1.0``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--splits", type=int, default=4, help="disjoint sets of groups per estimate")
    parser.add_argument("--ckpt", default=None, help="HF-format checkpoint dir (default: the SFT warm start)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from bicc.advantages import ADVANTAGES
    from bicc.conditioning import build_contexts
    from bicc.config import register_configs, validate
    from bicc.data import build_task
    from bicc.diagnostics import gradient_variance, sequence_delta
    from bicc.logprobs import make_token_batch
    from bicc.models import frozen_copy, load_pretrained
    from bicc.numerator import ConditionedNumerator, PlainNumerator
    from bicc.rollout import build_engine
    from bicc.sft import warm_start
    from bicc.trainer import (RLState, collect_rollout, conditioned_logprobs_no_grad, logprobs_no_grad,
                              loss_of_rows_fn)

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"sft.cache_dir={ROOT / '.cache' / 'bicc'}", *args.overrides])
    validate(cfg)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = build_task(cfg.data)
    init_path = str(warm_start(cfg, task, device, progress=True)) if cfg.model.tiny is not None else cfg.model.path
    model, tokenizer = load_pretrained(args.ckpt or init_path, cfg.model, device)
    ref_model = frozen_copy(init_path, cfg.model, device)
    engine = build_engine(cfg.rollout.engine, model, tokenizer, cfg.rollout)
    state = RLState(model, ref_model, tokenizer, engine, None, None, task, init_path)
    T, mb = cfg.rollout.temperature, cfg.train.micro_batch_size
    estimators = {"baseline": cfg.algo.advantage, "rcc": "rcc", "mean_centered": "mean_centered"}
    print(f"checkpoint {args.ckpt or init_path}; algo={cfg.algo.name} bicc={cfg.bicc.enabled} "
          f"(old_on_context={cfg.bicc.old_on_context}) delta={cfg.rcc.delta}; {args.seeds} seeds x {args.splits} splits")

    ratios, ratios_mc, rows = [], [], []
    start = time.perf_counter()
    for seed in range(args.seeds):
        state.data_pos = seed * cfg.rollout.prompts_per_step  # different queries per seed, same for every estimator
        ro = collect_rollout(state, cfg, seed)
        batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id).to(device)
        plain = numerator = PlainNumerator(batch)
        N = batch.input_ids.shape[0]
        if cfg.bicc.enabled:
            contexts = build_contexts(ro.prompts, ro.out.completion_ids, ro.correct, ro.group_ids, tokenizer, cfg.bicc,
                                      cfg.bicc.max_tokens, ro.out.prompt_ids)
            numerator = ConditionedNumerator(contexts, ro.out.completion_ids, batch.completion_len, cfg.bicc,
                                             tokenizer.pad_token_id, device)
        old = logprobs_no_grad(model, numerator if cfg.bicc.enabled and cfg.bicc.old_on_context else plain, N, mb, T)
        ref = logprobs_no_grad(ref_model, plain, N, mb, T)
        delta = sequence_delta(conditioned_logprobs_no_grad(model, numerator, plain, old, cfg, N, mb), ref,
                               batch.completion_mask, cfg.rcc.delta).cpu()
        values = {}
        for name, estimator in estimators.items():
            adv, _ = ADVANTAGES.get(estimator)(ro.rewards, ro.group_ids, delta, cfg.algo)
            loss = loss_of_rows_fn(model, numerator, batch, old, ref, adv.to(device), cfg)
            model.train()
            values[name] = gradient_variance(model, loss, ro.group_ids.to(device), args.splits,
                                             torch.Generator().manual_seed(seed), mb)
        ratios.append(values["rcc"] / values["baseline"])
        ratios_mc.append(values["rcc"] / values["mean_centered"])
        rows.append(values)
        print(f"seed {seed:2d}: V baseline {values['baseline']:.3f}  rcc {values['rcc']:.3f}  "
              f"mean-centred {values['mean_centered']:.3f}  rcc/baseline {ratios[-1]:.3f}  "
              f"|delta| mean {delta.abs().mean():.2f}  accuracy {ro.correct.mean():.2f}", flush=True)

    mean, half = t_interval(ratios)
    mean_mc, half_mc = t_interval(ratios_mc)
    print(f"{time.perf_counter() - start:.0f}s")
    print(f"RCC / baseline ({cfg.algo.advantage}): {mean:.3f} ± {half:.3f} (95% CI over {len(ratios)} seeds)")
    print(f"RCC / mean-centred (the correction term alone): {mean_mc:.3f} ± {half_mc:.3f}")
    print(f"RESULT rcc_grad_var_ratio={mean:.3f} target<1.0")
    print(f"RESULT rcc_grad_var_ratio_ci95={half:.3f}")
    print(f"RESULT rcc_vs_mean_centered_ratio={mean_mc:.3f} target<1.0")


if __name__ == "__main__":
    main()
