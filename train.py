"""Train a policy with a GRPO-family algorithm: ``python train.py algo=grpo``.

Stages: SFT warm start (tiny models; cached) -> RL -> final evaluation. Each RL step follows the
paper's Algorithm 1 in marked phases: rollout -> reward -> partition/contexts -> log-probs ->
advantages -> loss and optimizer step -> weight sync -> log.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from transformers.utils import logging as hf_logging

from bicc.advantages import ADVANTAGES
from bicc import distributed
from bicc.checkpoint import (CorruptCheckpoint, incomplete_checkpoints, list_checkpoints, load_trainer_state,
                             save_checkpoint, set_rng_state, tmp_dir, verify_checkpoint)
from bicc.conditioning import build_contexts, warm_up
from bicc.config import register_configs, validate, validate_lengths
from bicc.data import build_task
from bicc.diagnostics import conditioning_weights, delta_by_reward, gradient_variance, sequence_delta
from bicc.evaluation import evaluate, format_eval
from bicc.logprobs import make_token_batch
from bicc.models import (DTYPES, compute_copy, end_token_ids, frozen_copy, load_policy, num_parameters,
                         tokenizer_and_positions)
from bicc.numerator import ConditionedNumerator, PlainNumerator
from bicc.optim import build_optimizer, warmup_cosine
from bicc.progress import progress
from bicc.rollout import EngineOptions, build_engine
from bicc.sft import config_hash, warm_start
from bicc.tracking import Tracker, rewind_jsonl
from bicc.trainer import (RLState, collect_rollout, loss_of_rows_fn, needs_reference, old_logprobs,
                          rcc_policy_logprobs, reference_logprobs, sampler_importance_weights, sampler_logprob_diff,
                          update_policy)

register_configs()
hf_logging.disable_progress_bar()


def rl_step(s: RLState, cfg) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    device = next(s.model.parameters()).device
    step_seed = cfg.seed * 1_000_003 + s.step

    # ---- 1-2. rollout and reward: G samples per query from pi_old, scored (binary, plus shaping) --
    # (each process samples its own prompt shards; groups never span processes)
    ro = collect_rollout(s, cfg, step_seed, distributed.local_shards(cfg.rollout, s.dist),
                         distributed.num_shards(cfg.rollout, s.dist))
    t_rollout = time.perf_counter()
    if hasattr(s.engine, "sleep"):  # vLLM with rollout.sleep on GPU: free its memory until the sync
        s.engine.sleep()

    # ---- 3. partition and contexts: BiCC conditions the trainable numerator on x^c ----------------
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, s.tokenizer.pad_token_id).to(device)
    plain = PlainNumerator(batch)
    numerator, bicc_metrics = plain, {}
    if cfg.bicc.enabled:
        contexts = build_contexts(ro.prompts, ro.out.completion_ids, ro.correct, ro.group_ids, s.tokenizer, cfg.bicc,
                                  cfg.bicc.max_tokens, ro.out.prompt_ids, s.end_ids, s.task.answer_anchors)
        contexts = warm_up(contexts, ro.group_ids, ro.out.prompt_ids, s.step, cfg.bicc.warmup_steps)
        numerator = ConditionedNumerator(contexts, ro.out.completion_ids, batch.completion_len, cfg.bicc,
                                         s.tokenizer.pad_token_id, device)
        bicc_metrics = {**contexts.metrics, "bicc/extra_token_share": numerator.tokens / plain.tokens - 1}

    # ---- 4. log-probs of pi_old and pi_ref: on q (pi_old on x^c only with bicc.old_on_context) -----
    N, mb = batch.input_ids.shape[0], cfg.train.micro_batch_size
    # (not under FSDP2: its sharded gradients are averaged over processes inside backward)
    diag = cfg.rcc.diag_every > 0 and s.step % cfg.rcc.diag_every == 0 and not distributed.is_sharded(s.model)
    tis = ro.out.logprobs is not None and cfg.rollout.tis_cap > 0
    # pi_old on x^c under bicc.old_on_context; then on q too where something needs it (diagnostics, TIS)
    delta_on_q = (cfg.rcc.enabled or diag) and cfg.rcc.delta_context == "q"
    old_logp, q_logp = old_logprobs(s.model, plain, numerator, cfg, N, mb, need_q=diag or tis or delta_on_q,
                                    d=s.dist)  # [N, L]
    # log_w: log conditioning weight per sequence; None = measured in the update's first pass (old on q)
    log_w = None
    if q_logp is not None and q_logp is not old_logp:
        log_w = ((old_logp - q_logp) * batch.completion_mask).sum(-1).cpu()
    # pi_ref on q (RCC's delta); the KL term's reference, on x^c under bicc.old_on_context
    ref_logp, kl_ref_logp = reference_logprobs(s.ref_model, plain, numerator, cfg, N, mb)
    t_logprobs = time.perf_counter()
    sampler_metrics, is_weight = {}, None
    if ro.out.logprobs is not None and q_logp is not None:  # the sampler against the trainer, both on q
        q_cpu, mask_cpu = q_logp.cpu(), batch.completion_mask.cpu()
        sampler_metrics["rollout/logprob_diff"] = sampler_logprob_diff(ro.out.logprobs, q_cpu, mask_cpu)
        if tis:  # tokens were drawn from pi_sampler, not pi_old: weight each by min(pi_old / pi_sampler, C)
            is_weight, tis_metrics = sampler_importance_weights(ro.out.logprobs, q_cpu, mask_cpu, cfg.rollout.tis_cap)
            is_weight = is_weight.to(device)
            sampler_metrics.update(tis_metrics)

    # ---- 5. advantages; RCC corrects them by Cov(r, delta) and replaces the variant's own ----------
    delta, diag_record = None, {}
    if cfg.rcc.enabled or diag:  # delta_i = log pi_theta(o_i | x^c or q) - log pi_ref(o_i | q), theta = theta_old here
        policy_logp = rcc_policy_logprobs(s.model, numerator, plain, old_logp, q_logp, cfg, N, mb, s.dist)
        delta = sequence_delta(policy_logp, ref_logp, batch.completion_mask, cfg.rcc.delta).cpu()
    adv_name = "rcc" if cfg.rcc.enabled else cfg.algo.advantage
    adv, adv_metrics = ADVANTAGES.get(adv_name)(ro.rewards, ro.group_ids, delta, cfg.algo)  # [N]
    adv = adv.to(device)
    if diag:  # measured without changing the update: gradients are cleared before it
        if not cfg.rcc.enabled:
            _, rcc_metrics = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
            adv_metrics.update({k: v for k, v in rcc_metrics.items() if k.startswith("rcc/")})
        loss_of_rows = loss_of_rows_fn(s.model, numerator, batch, old_logp, kl_ref_logp, adv, cfg, is_weight)
        s.model.train()
        grad_var = gradient_variance(s.model, loss_of_rows, ro.group_ids.to(device), cfg.rcc.diag_splits,
                                     torch.Generator().manual_seed(step_seed), mb)
        adv_metrics.update({**delta_by_reward(delta, ro.correct), "rcc/grad_var": grad_var})
        diag_record = {"step": s.step + 1, "delta": delta.tolist(), "correct": ro.correct.tolist(),
                       "grad_var": grad_var}

    # ---- 6. loss and optimizer step(s) ---------------------------------------------------------
    update_metrics, first_pass_log_ratio = update_policy(s, batch, numerator, old_logp, kl_ref_logp, adv, cfg,
                                                         step_seed, is_weight)
    t_update = time.perf_counter()

    if cfg.bicc.enabled:
        if not cfg.bicc.old_on_context:
            log_w = first_pass_log_ratio
        if log_w is not None:
            bicc_metrics.update(conditioning_weights(log_w, contexts.conditioned, ro.correct))

    # ---- 7. weight sync: the rollout engine samples from the updated policy next step ----------
    s.engine.update_weights(s.model)
    s.step += 1
    if s.shard_pos and s.dist.enabled:  # every process learns every shard's data position (checkpoints)
        s.shard_pos = distributed.merge_shard_positions(s.shard_pos, cfg.rollout, s.dist)

    # ---- 8. metrics ----------------------------------------------------------------------------
    lengths = batch.completion_mask.sum(-1).float()
    return distributed.mean_metrics({
        "reward/accuracy": ro.correct.mean().item(),
        "reward/mean": ro.rewards.mean().item(),
        "rollout/response_len": lengths.mean().item(),
        "rollout/truncated_share": 1 - sum(ro.out.finished) / len(ro.out.finished),
        "rollout/prompts_drawn": ro.prompts_drawn,
        "rollout/generate_rounds": ro.rounds,
        "rollout/groups": len(ro.correct) // cfg.rollout.group_size,
        **adv_metrics, **update_metrics, **bicc_metrics, **sampler_metrics,
        "perf/rollout_s": t_rollout - t0, "perf/logprob_s": t_logprobs - t_rollout,
        "perf/update_s": t_update - t_logprobs, "perf/step_s": time.perf_counter() - t0,
        "perf/tokens_per_s": float(batch.attention_mask.sum()) / (time.perf_counter() - t0),
    }, s.dist), diag_record


NAMED_FORMS = {("bicc", "stable"): "stabilised BiCC, not the paper's", ("rcc", "mean"): "RCC with per-token mean delta, not the paper's"}


def describe_choices(choices, cfg) -> str:
    """What this run trains, by config group, with the forms that are not the paper's named as such."""
    parts = []
    for group in ("algo", "bicc", "rcc", "model", "data", "rollout", "eval", "experiment"):
        choice = choices.get(group)
        if choice is not None:
            note = NAMED_FORMS.get((group, choice))
            parts.append(f"{group}={choice}" + (f" ({note})" if note else ""))
    r = cfg.rollout
    text = (" ".join(parts) + f"; lr {peak_lr(cfg):g}, {cfg.train.steps} steps of {r.prompts_per_step} prompts x "
            f"G={r.group_size}, max {r.max_new_tokens} tokens")
    if cfg.algo.kl_coef > 0:
        text += f", KL {cfg.algo.kl_coef:g} ({cfg.algo.kl_estimator})"
    if cfg.bicc.enabled:
        text += f", context budget {int(cfg.bicc.context_ratio * cfg.bicc.max_tokens)} tokens"
    if cfg.model.tiny is not None and cfg.data.task == "arith":
        text += f", arith slips {cfg.data.arith.slip_rate:g} at {cfg.data.arith.slip_step} step"
    if cfg.model.tiny is not None and cfg.sft.context_share > 0:
        text += f", warm start shows {cfg.sft.context_attempts} attempts on {cfg.sft.context_share:g} of its prompts"
    return text


def peak_lr(cfg) -> float:
    """optim.lr, times bicc.lr_scale while BiCC is on (the conditioned gradient is noisier for the
    policy on q; see README, "BiCC: the default and the paper's equation")."""
    return cfg.optim.lr * (cfg.bicc.lr_scale if cfg.bicc.enabled else 1.0)


def build_rl_state(cfg, policy_path: str, init_path: str, device: torch.device,
                   d: distributed.Dist = distributed.Dist(), max_model_len: int | None = None) -> RLState:
    """Policy from ``policy_path`` (the initial policy, or a checkpoint when resuming) in fp32 master
    weights computing in ``model.dtype``; the frozen reference is always the initial policy at ``init_path``
    (a full copy in the compute dtype on every process). Under FSDP2 the HF rollout engine gets its own
    full copy of the policy in the compute dtype; otherwise it samples from the policy itself."""
    model, tokenizer = load_policy(policy_path, cfg.model, device, cfg.train.logprob_chunk_tokens)
    ref_model = frozen_copy(init_path, cfg.model, device) if needs_reference(cfg) else None
    sharded_hf = d.enabled and d.strategy == "fsdp2" and cfg.rollout.engine == "hf"
    sampler = compute_copy(model, cfg.model) if sharded_hf else model
    end_ids = tuple(end_token_ids(tokenizer, model))
    model = distributed.wrap(model, cfg.dist, d, DTYPES[cfg.model.dtype])
    optimizer = build_optimizer(model, peak_lr(cfg), cfg.optim.betas, cfg.optim.weight_decay)
    total = cfg.train.steps * cfg.train.epochs_per_rollout * cfg.train.minibatches_per_rollout
    scheduler = warmup_cosine(optimizer, cfg.optim.warmup_steps, total, cfg.optim.min_lr_ratio)
    options = EngineOptions(end_ids=end_ids, dist=d, max_model_len=max_model_len, dtype=cfg.model.dtype)
    engine = build_engine(cfg.rollout.engine, sampler, tokenizer, cfg.rollout, options)
    return RLState(model, ref_model, tokenizer, engine, optimizer, scheduler, build_task(cfg.data), init_path, dist=d,
                   end_ids=end_ids)


def eval_engine(s: RLState, cfg):
    """vLLM evaluates with the rollout engine itself; HF with an engine over the sampling module (a full
    copy under FSDP2) batched by eval.batch_size."""
    if getattr(s.engine, "model", None) is None:
        return s.engine
    return build_engine("hf", s.engine.model, s.tokenizer, cfg.eval, EngineOptions(end_ids=s.end_ids))


def save_rl_checkpoint(s: RLState, cfg, ckpt_dir: Path) -> None:
    """Atomic checkpoint (bicc.checkpoint); every process calls this. HF-format weights in the compute
    dtype (``model.dtype``, what vLLM and evaluation load), gathered to a full state dict under FSDP2 and
    written by rank 0 with the trainer state; under FSDP2 each rank also writes its optimizer shard (DCP),
    and when the master weights are kept in a wider dtype they are written too (DCP, sharded under FSDP2),
    so that a resume is exact. Rank 0 marks the checkpoint complete last."""
    d = s.dist
    sharded = distributed.is_sharded(s.model)
    mixed = DTYPES[cfg.model.master_dtype] != DTYPES[cfg.model.dtype]
    weights = None  # one process or DDP in the master dtype: rank 0 writes the model as is
    if sharded or (mixed and d.is_main):
        weights = distributed.full_state_dict(s.model, DTYPES[cfg.model.dtype])
        if s.model.config.tie_word_embeddings:  # gathered copies are no longer shared: keep the HF layout
            weights.pop("lm_head.weight", None)
    tmp = tmp_dir(ckpt_dir)
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier(d)
    state = s.trainer_state()
    if sharded:
        distributed.save_sharded_optimizer(s.model, s.optimizer, tmp)
        del state["optimizer"]
    if mixed:
        distributed.save_master_weights(s.model, tmp)
    distributed.barrier(d)
    if d.is_main:
        save_checkpoint(ckpt_dir, s.model, s.tokenizer, state, cfg.train.keep_last, state_dict=weights, keep_tmp=True)
    distributed.barrier(d)


def resume_dir(resume: str, run_dir: Path) -> Path | None:
    """``auto``: the latest checkpoint of this run dir that reads back completely, skipping (with a
    warning) incomplete or corrupt ones; a run dir: its latest, which must be sound; else the dir itself."""
    root = run_dir if resume == "auto" else Path(resume)
    for bad in incomplete_checkpoints(root / "checkpoints"):
        print(f"[rl] warning: skipping incomplete checkpoint {bad} (interrupted write)")
    found = list_checkpoints(root / "checkpoints")
    if resume != "auto":
        ckpt = found[-1] if found else root
        verify_checkpoint(ckpt)  # an explicitly named checkpoint must be sound: the error names it
        return ckpt
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CorruptCheckpoint as err:
            print(f"[rl] warning: skipping {err}")
    return None


def start_or_resume(cfg, init_path: str, device: torch.device, run_dir: Path,
                    d: distributed.Dist = distributed.Dist(), max_model_len: int | None = None) -> RLState:
    ckpt = resume_dir(cfg.resume, run_dir) if cfg.resume else None
    ckpt = distributed.broadcast_object(ckpt, d)  # rank 0's choice (nodes may not share a file system view)
    if ckpt is None:
        return build_rl_state(cfg, init_path, init_path, device, d, max_model_len)
    state = load_trainer_state(ckpt)
    s = build_rl_state(cfg, str(ckpt), state["init_path"], device, d, max_model_len)
    distributed.load_master_weights(s.model, ckpt)  # the fp32 master behind the checkpoint's bf16 weights
    s.load_trainer_state(state)
    if "optimizer" not in state:  # written sharded by an FSDP2 run (any number of processes)
        distributed.load_sharded_optimizer(s.model, s.optimizer, ckpt)
        s.apply_schedule()
    set_rng_state(state["rng"])
    print(f"[rl] resumed from {ckpt} at step {s.step}")
    return s


def run_rl(s: RLState, cfg, run_dir: Path, tracker: Tracker) -> RLState:
    if s.dist.is_main:
        print(f"[rl] {cfg.algo.name}: {num_parameters(s.model) / 1e6:.2f}M parameters, {cfg.train.steps} steps of "
              f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples on {s.dist.world} process(es)")
    start = time.perf_counter()
    bar = progress(cfg.train.steps, "rl", cfg.logger.progress and s.dist.is_main, initial=s.step)
    while s.step < cfg.train.steps:
        metrics, diag_record = rl_step(s, cfg)
        if diag_record and s.dist.is_main:  # raw per-sample values for the delta histograms (bicc.plots)
            with open(run_dir / "diagnostics.jsonl", "a") as f:
                f.write(json.dumps(diag_record) + "\n")
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", loss=f"{metrics['train/loss']:.3f}")
        share = metrics.get("bicc/samples_conditioned_share")
        if share is not None and share < 0.5 and s.dist.is_main and (s.step == 1 or s.step % 50 == 0):
            print(f"[bicc] warning: step {s.step}: only {100 * share:.0f}% of samples see an opposite attempt "
                  f"({metrics['bicc/attempts_shown']:.1f} shown on average, "
                  f"{100 * metrics['bicc/dropped_share']:.0f}% of attempts dropped by the budget "
                  f"bicc.context_ratio x bicc.max_tokens = {int(cfg.bicc.context_ratio * cfg.bicc.max_tokens)} tokens)")
        if s.step % cfg.train.log_every == 0:
            tracker.log(metrics, step=s.step)
        out_of_time = cfg.train.time_budget_s and time.perf_counter() - start > cfg.train.time_budget_s
        out_of_time = bool(distributed.all_reduce_sum(float(bool(out_of_time)), s.dist))  # all stop together
        diverged = s.nonfinite_streak >= cfg.train.max_nonfinite_steps
        if ((cfg.train.save_every and s.step % cfg.train.save_every == 0) or s.step == cfg.train.steps or out_of_time
                or diverged):
            save_rl_checkpoint(s, cfg, run_dir / "checkpoints" / f"step_{s.step}")
        if diverged:
            raise RuntimeError(f"[rl] {s.nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient "
                               f"norm (up to step {s.step}); stopped with a checkpoint at "
                               f"{run_dir / 'checkpoints' / f'step_{s.step}'}. Lower optim.lr or check the data.")
        if out_of_time:
            print(f"[rl] time budget {cfg.train.time_budget_s}s reached at step {s.step}")
            break
    bar.close()
    return s


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> dict:
    validate(cfg)
    d = distributed.init(cfg.dist)
    try:
        return run(cfg, d)
    finally:
        distributed.shutdown(d)


def run(cfg, d: distributed.Dist) -> dict:
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // d.world))
    cuda = f"cuda:{d.local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(cuda if cfg.device == "auto" else cfg.device)
    torch.manual_seed(cfg.seed)
    if d.enabled:
        print(f"[dist] rank {d.rank}/{d.world} (local rank {d.local_rank}) on {device}, collectives on {d.device}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if d.is_main:
        print(f"[run] {describe_choices(HydraConfig.get().runtime.choices, cfg)}")
    task = build_task(cfg.data)
    max_model_len = validate_lengths(cfg, task, *tokenizer_and_positions(cfg.model))

    # ---- warm start: tiny models are fine-tuned first (cached by settings; rank 0 builds it) --------
    init_path = cfg.model.path
    if cfg.model.tiny is not None:
        if d.is_main:
            init_path = str(warm_start(cfg, task, device, cfg.logger.progress))
        distributed.barrier(d)
        if not d.is_main:
            init_path = str(warm_start(cfg, task, device, False))  # the cached one
    if cfg.stage == "sft":
        print(f"[sft] warm start at {init_path}")
        return {"init_path": init_path}

    tracker = Tracker(run_dir, cfg.run_name, OmegaConf.to_container(cfg, resolve=True), cfg.logger.wandb_mode,
                      cfg.logger.wandb_project, enabled=d.is_main)
    s = start_or_resume(cfg, init_path, device, run_dir, d, max_model_len)
    if s.step > 0 and d.is_main:  # rows of steps after the checkpoint are recomputed, identically: drop the old ones
        for name in ("metrics.jsonl", "diagnostics.jsonl"):
            rewind_jsonl(run_dir / name, s.step)
    baseline = None
    if s.step == 0:  # score the initial policy with the model RL will train (no second load), on every rank
        # The warm start's own dir caches its score: every run from one SFT checkpoint shares it.
        cache = Path(init_path) / f"eval-{config_hash(cfg.eval, cfg.seed, cfg.rollout.engine)}.json" if cfg.model.tiny else None
        baseline = distributed.broadcast_object(
            json.loads(cache.read_text()) if d.is_main and cache is not None and cache.exists() else None, d)
        if baseline is None:
            baseline = evaluate(eval_engine(s, cfg), s.tokenizer, task, cfg.eval, cfg.seed, d=s.dist)
            if cache is not None and d.is_main:
                cache.write_text(json.dumps(baseline))
        if d.is_main:
            print(f"[eval] initial policy: {format_eval(baseline)}")

    s = run_rl(s, cfg, run_dir, tracker)
    final = evaluate(eval_engine(s, cfg), s.tokenizer, task, cfg.eval, cfg.seed, out_dir=run_dir / "eval",
                     progress=cfg.logger.progress, d=s.dist)
    if hasattr(s.engine, "close"):
        s.engine.close()
    if not d.is_main:
        return {"steps": s.step, "init_path": init_path}
    tracker.log(final, step=s.step)
    tracker.finish()
    results = {"initial": baseline, "final": final, "steps": s.step, "init_path": init_path}
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"[eval] final policy:   {format_eval(final)}")
    print(f"[done] outputs in {run_dir}")
    return results


if __name__ == "__main__":
    main()
