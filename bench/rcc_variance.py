"""Does reward-confidence correction lower the variance of the policy gradient? (paper: by 25-37%)

From one checkpoint (the embedded default's SFT warm start, or ``--ckpt``), for each seed: sample one
rollout batch (the default 16 prompts x 8), build the run's contexts (BiCC as configured), and measure
the relative gradient variance (``bicc.diagnostics.gradient_variance``: K disjoint sets of groups, mean
squared distance of their gradients from the mean, over the mean's squared norm) of the same loss with

- the variant's own advantage (the baseline, GRPO's (r - mean) / std by default),
- RCC's advantage r - mean - 2 Cov(r, delta),
- the mean-centred advantage r - mean (RCC without its correction term, to separate the two effects),

on the very same samples and splits. RCC is measured with delta's policy term on x^c (Algorithm 1) and on q
(Section 4.2, Appendices B/C;
``rcc.delta_context``). Both the relative variance (scale-free) and the absolute one are reported: the paper
does not define its measure, and the absolute variance falls by the std that RCC drops (GRPO divides by
sigma, RCC does not) even when nothing else changes. Reports per-seed ratios and their mean with a 95%
t-interval.
Hydra overrides go after the flags: ``.venv/bin/python -m bench.rcc_variance --seeds 12 algo=dapo``.
Ends with ``RESULT rcc_grad_var_ratio=<RCC/baseline> target<1.0``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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
    from bicc.batching import logprobs_no_grad
    from bicc.conditioning import build_contexts
    from bicc.config import register_configs
    from bicc.data import build_task
    from bicc.diagnostics import gradient_variance, sequence_delta
    from bicc.logprobs import make_token_batch
    from bicc.models import frozen_copy, load_pretrained
    from bicc.rollout import build_engine
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout
    from bicc.rows import ContextRows, QueryRows
    from bicc.sft import warm_start
    from bicc.update import loss_of_rows_fn
    from bicc.validation import validate

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
    T, mb = cfg.rollout.temperature, cfg.train.micro_batch_size
    estimators = {"baseline": cfg.algo.advantage, "rcc_xc": "rcc", "rcc_q": "rcc", "mean_centered": "mean_centered"}
    print(f"checkpoint {args.ckpt or init_path}; algo={cfg.algo.name} bicc={cfg.bicc.enabled} "
          f"(old_on_context={cfg.bicc.old_on_context}) delta={cfg.rcc.delta}; {args.seeds} seeds x {args.splits} splits")

    ratios = {name: [] for name in ("rcc_xc", "rcc_q", "rcc_xc_abs", "rcc_q_abs", "mc")}
    start = time.perf_counter()
    for seed in range(args.seeds):
        cursor = DataCursor(seed * cfg.rollout.prompts_per_step)  # different queries per seed, same for every estimator
        ro = collect_rollout(engine, tokenizer, task, Collection.from_config(cfg), cursor, seed)
        batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id).to(device)
        plain = numerator = QueryRows(batch)
        N = batch.input_ids.shape[0]
        if cfg.bicc.enabled:
            contexts = build_contexts(ro.prompts, ro.out.completion_ids, ro.correct, ro.group_ids, tokenizer, cfg.bicc,
                                      cfg.bicc.max_tokens, ro.out.prompt_ids)
            numerator = ContextRows(contexts, ro.out.completion_ids, batch.completion_len, cfg.bicc,
                                    tokenizer.pad_token_id, device)
        old = logprobs_no_grad(model, numerator if cfg.bicc.enabled and cfg.bicc.old_on_context else plain, N, mb, T)
        on_q = logprobs_no_grad(model, plain, N, mb, T)
        ref = logprobs_no_grad(ref_model, plain, N, mb, T)
        deltas = {}
        on_xc = old if numerator is plain or cfg.bicc.old_on_context else logprobs_no_grad(model, numerator, N, mb, T)
        for context, policy in (("xc", on_xc), ("q", on_q)):  # log pi_theta_old(o | x^c) or (o | q)
            deltas[f"rcc_{context}"] = sequence_delta(policy, ref, batch.completion_mask, cfg.rcc.delta).cpu()
        values = {}
        for name, estimator in estimators.items():
            adv, _ = ADVANTAGES.get(estimator)(ro.rewards, ro.group_ids, deltas.get(name), cfg.algo)
            loss = loss_of_rows_fn(model, numerator, batch, old, ref, adv.to(device), cfg)
            model.train()
            values[name] = gradient_variance(model, loss, ro.group_ids.to(device), args.splits,
                                             torch.Generator().manual_seed(seed), mb, absolute=True)
        base_rel, base_abs = values["baseline"]
        for context in ("xc", "q"):
            ratios[f"rcc_{context}"].append(values[f"rcc_{context}"][0] / base_rel)
            ratios[f"rcc_{context}_abs"].append(values[f"rcc_{context}"][1] / base_abs)
        ratios["mc"].append(values["rcc_xc"][0] / values["mean_centered"][0])
        print(f"seed {seed:2d}: relative V baseline {base_rel:.3f}  rcc(x^c) {values['rcc_xc'][0]:.3f}  "
              f"rcc(q) {values['rcc_q'][0]:.3f}  mean-centred {values['mean_centered'][0]:.3f}; absolute rcc/baseline "
              f"x^c {ratios['rcc_xc_abs'][-1]:.3f} q {ratios['rcc_q_abs'][-1]:.3f}; |delta| x^c "
              f"{deltas['rcc_xc'].abs().mean():.2f} q {deltas['rcc_q'].abs().mean():.2f}; accuracy {ro.correct.mean():.2f}",
              flush=True)

    print(f"{time.perf_counter() - start:.0f}s")
    for key, label in (("rcc_xc", "RCC (delta on x^c) / baseline, relative"), ("rcc_q", "RCC (delta on q) / baseline, relative"),
                       ("rcc_xc_abs", "RCC (delta on x^c) / baseline, absolute"),
                       ("rcc_q_abs", "RCC (delta on q) / baseline, absolute"),
                       ("mc", "RCC (x^c) / mean-centred, relative (the correction term alone)")):
        mean, half = t_interval(ratios[key])
        print(f"{label}: {mean:.3f} ± {half:.3f} (95% CI over {len(ratios[key])} seeds)")
    for key in ("rcc_xc", "rcc_q", "rcc_xc_abs", "rcc_q_abs"):
        print(f"RESULT {key}_grad_var_ratio={t_interval(ratios[key])[0]:.3f} target<1.0")
    print(f"RESULT rcc_vs_mean_centered_ratio={t_interval(ratios['mc'])[0]:.3f} target<1.0")


if __name__ == "__main__":
    main()
