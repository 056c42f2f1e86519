"""Does reward-confidence correction lower the variance of the policy gradient? (paper: by 25-37%)

From one checkpoint (the embedded default's SFT warm start, a pretrained ``model.path``, or ``--ckpt``), for each
batch: sample one rollout batch (``rollout.prompts_per_step`` x G), build the run's contexts (BiCC as configured),
and measure the relative gradient variance (``bicc.method.diagnostics.gradient_variance``: K disjoint sets of groups,
mean squared distance of their gradients from the mean, over the mean's squared norm) of the same loss with

- the variant's own advantage (the baseline, GRPO's (r - mean) / std by default),
- RCC's advantage r - mean - 2 Cov(r, delta),
- the mean-centred advantage r - mean (RCC without its correction term, to separate the two effects),

on the very same samples and splits. RCC is measured with delta's policy term on x^c (Algorithm 1) and on q
(Section 4.2, Appendices B/C; ``rcc.delta_context``); pi_ref is the run's starting model (the warm start or
``model.path``), so at that model delta on q is exactly 0 and RCC(q) is the mean-centred advantage: the
correction term shows only at a checkpoint that has moved (``--ckpt``; ``bench/pretrained_compare.py`` measures
its runs' steps 10 and 20). Both the relative variance (scale-free) and the absolute one are reported: the paper
does not define its measure, and the absolute variance falls by the std that RCC drops (GRPO divides by sigma,
RCC does not) even when nothing else changes. Reports per-batch ratios and their mean with a 95% t-interval.
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
# name -> what each per-batch ratio divides (relative variance unless "_abs")
RATIOS = {"rcc_xc": "RCC (delta on x^c) / baseline, relative", "rcc_q": "RCC (delta on q) / baseline, relative",
          "rcc_xc_abs": "RCC (delta on x^c) / baseline, absolute", "rcc_q_abs": "RCC (delta on q) / baseline, absolute",
          "mc": "RCC (x^c) / mean-centred, relative (the correction term alone)",
          "mc_q": "RCC (q) / mean-centred, relative (the correction term alone)"}


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, half


class Setup:
    """The policy (loaded from ``ckpt`` or the run's starting model), the frozen reference (the starting model) and
    the rollout engine, built once; ``load(ckpt)`` moves the policy (and the engine's weights) to another
    checkpoint of the same model."""

    def __init__(self, cfg, ckpt: str | None = None):
        from bicc.data import build_task
        from bicc.model.gguf import resolve_model_path
        from bicc.model.load import end_token_ids, frozen_copy, load_pretrained
        from bicc.rollout import EngineOptions, build_engine
        from bicc.trainer.sft import warm_start

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.task = build_task(cfg.data)
        if cfg.model.tiny is not None:
            self.init_path = str(warm_start(cfg, self.task, self.device, progress=True))
        else:
            self.init_path = resolve_model_path(cfg.model.path, cfg.sft.cache_dir)
        self.ckpt = ckpt or self.init_path
        self.model, self.tokenizer = load_pretrained(self.ckpt, cfg.model, self.device)
        self.ref_model = frozen_copy(self.init_path, cfg.model, self.device)
        rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        options = EngineOptions(end_ids=tuple(end_token_ids(self.tokenizer, self.model)), dtype=cfg.model.dtype, rows=rows)
        self.engine = build_engine(cfg.rollout.engine, self.model, self.tokenizer, cfg.rollout, options)

    def load(self, ckpt: str) -> None:
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(other.state_dict())
        self.engine.update_weights(self.model, self.engine.version + 1)
        self.ckpt = ckpt


def measure(cfg, setup: Setup, batches: range, splits: int, log=print) -> list[dict]:
    """Per batch (``batches``: their indices, each a different draw of prompts and samples, the same for every
    estimator): {estimator: (relative, absolute) gradient variance} for baseline, rcc_xc, rcc_q, mean_centered,
    with the batch's mean |delta| on x^c and on q and its accuracy."""
    from bicc.kernels.batching import logprobs_no_grad
    from bicc.kernels.rows import ContextRows, QueryRows
    from bicc.method.advantages import ADVANTAGES
    from bicc.method.conditioning import build_contexts
    from bicc.method.diagnostics import gradient_variance, sequence_delta
    from bicc.model.logprobs import make_token_batch
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout
    from bicc.trainer.update import loss_of_rows_fn

    model, ref_model, tokenizer, device = setup.model, setup.ref_model, setup.tokenizer, setup.device
    T, mb = cfg.rollout.temperature, cfg.train.micro_batch_size
    estimators = {"baseline": cfg.algo.advantage, "rcc_xc": "rcc", "rcc_q": "rcc", "mean_centered": "mean_centered"}
    out = []
    for seed in batches:
        cursor = DataCursor(seed * cfg.rollout.prompts_per_step)  # different queries per batch, same for every estimator
        ro = collect_rollout(setup.engine, tokenizer, setup.task, Collection.from_config(cfg), cursor, seed)
        batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id).to(device)
        plain = numerator = QueryRows(batch)
        N = batch.input_ids.shape[0]
        if cfg.bicc.enabled:
            contexts = build_contexts(ro.prompts, ro.out.completion_ids, ro.correct, ro.group_ids, tokenizer, cfg.bicc,
                                      cfg.bicc.max_tokens, ro.out.prompt_ids)
            numerator = ContextRows(contexts, ro.out.completion_ids, batch.completion_len, cfg.train,
                                    tokenizer.pad_token_id, device)
        old = logprobs_no_grad(model, numerator if cfg.bicc.enabled and cfg.bicc.old_on_context else plain, N, mb, T)
        on_q = logprobs_no_grad(model, plain, N, mb, T)
        ref = logprobs_no_grad(ref_model, plain, N, mb, T)
        on_xc = on_q if numerator is plain else old if cfg.bicc.old_on_context else logprobs_no_grad(model, numerator, N, mb, T)
        deltas = {f"rcc_{context}": sequence_delta(policy, ref, batch.completion_mask, cfg.rcc.delta).cpu()
                  for context, policy in (("xc", on_xc), ("q", on_q))}  # log pi_theta_old(o | x^c) or (o | q)
        values = {}
        for name, estimator in estimators.items():
            adv, _ = ADVANTAGES.get(estimator)(ro.rewards, ro.group_ids, deltas.get(name), cfg.algo)
            loss = loss_of_rows_fn(model, numerator, batch, old, ref, adv.to(device), cfg)
            model.train()
            values[name] = gradient_variance(model, loss, ro.group_ids.to(device), splits,
                                             torch.Generator().manual_seed(seed), mb, absolute=True)
        values.update(delta_xc=deltas["rcc_xc"].abs().mean().item(), delta_q=deltas["rcc_q"].abs().mean().item(),
                      accuracy=ro.correct.float().mean().item())
        out.append(values)
        log(f"batch {seed:2d}: relative V baseline {values['baseline'][0]:.3f}  rcc(x^c) {values['rcc_xc'][0]:.3f}  "
            f"rcc(q) {values['rcc_q'][0]:.3f}  mean-centred {values['mean_centered'][0]:.3f}; |delta| x^c "
            f"{values['delta_xc']:.2f} q {values['delta_q']:.2f}; accuracy {values['accuracy']:.2f}")
    return out


def ratios(values: list[dict]) -> dict[str, list[float]]:
    """Per-batch ratios (``RATIOS``) of the variances ``measure`` returns."""
    out = {name: [] for name in RATIOS}
    for v in values:
        for context in ("xc", "q"):
            out[f"rcc_{context}"].append(v[f"rcc_{context}"][0] / v["baseline"][0])
            out[f"rcc_{context}_abs"].append(v[f"rcc_{context}"][1] / v["baseline"][1])
        out["mc"].append(v["rcc_xc"][0] / v["mean_centered"][0])
        out["mc_q"].append(v["rcc_q"][0] / v["mean_centered"][0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="rollout batches measured")
    parser.add_argument("--splits", type=int, default=4, help="disjoint sets of groups per estimate")
    parser.add_argument("--ckpt", default=None, help="HF-format checkpoint dir (default: the run's starting model)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml")
    args = parser.parse_args()

    from bench.common import compose_cfg

    cfg = compose_cfg(args.overrides)
    torch.manual_seed(cfg.seed)
    setup = Setup(cfg, args.ckpt)
    print(f"checkpoint {setup.ckpt}; algo={cfg.algo.name} bicc={cfg.bicc.enabled} (old_on_context="
          f"{cfg.bicc.old_on_context}) delta={cfg.rcc.delta}; {args.seeds} batches x {args.splits} splits", flush=True)
    start = time.perf_counter()
    per_batch = ratios(measure(cfg, setup, range(args.seeds), args.splits, log=lambda s: print(s, flush=True)))
    print(f"{time.perf_counter() - start:.0f}s")
    for key, label in RATIOS.items():
        mean, half = t_interval(per_batch[key])
        print(f"{label}: {mean:.3f} ± {half:.3f} (95% CI over {len(per_batch[key])} batches)")
    for key in ("rcc_xc", "rcc_q", "rcc_xc_abs", "rcc_q_abs"):
        print(f"RESULT {key}_grad_var_ratio={t_interval(per_batch[key])[0]:.3f} target<1.0")
    print(f"RESULT rcc_vs_mean_centered_ratio={t_interval(per_batch['mc'])[0]:.3f} target<1.0")


if __name__ == "__main__":
    main()
