"""One RL step, the paper's Algorithm 1 (``bicc.method.reference.algorithm1_step``) in its phases: rollout and
reward -> partition and contexts -> the no-grad log-probs (``bicc.trainer.plan``) -> advantages -> loss and
optimizer steps (``bicc.trainer.update``) -> weight sync -> metrics, on the state ``bicc.trainer.state.build_rl_state``
builds. What the ranks share inside it is ``s.ranks`` (``bicc.machine.ranks``); what they share after it (every
shard's data position, the metrics' mean) is ``bicc.trainer.loop.step_on_every_rank``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from bicc.config import StepConfig, corrects
from bicc.kernels.compile import compiled_graphs
from bicc.kernels.rows import ContextRows, query_rows
from bicc.method.advantages import ADVANTAGES, advantage_metrics, advantage_name, inputs_of
from bicc.method.conditioning import build_contexts, positives
from bicc.method.diagnostics import conditioning_weights, delta_by_reward, gradient_variance, sequence_delta, shift_and_delta
from bicc.method.losses.tis import sampler_grid
from bicc.model.logprobs import make_token_batch
from bicc.rollout.agreement import agreement_at_version, agreement_checked, read_at, sampler_correction
from bicc.rollout.collect import collect_rollout, rollout_metrics, step_seed
from bicc.rollout.workers import check_staleness
from bicc.trainer.plan import StepPlan, diagnoses, step_logprobs
from bicc.trainer.samples import sample_rows
from bicc.trainer.state import RLState, sampler_logprobs
from bicc.trainer.update import loss_of_rows_fn, update_policy


def rl_step(s: RLState, cfg: StepConfig) -> tuple[dict, dict]:
    t0, graphs, device = time.perf_counter(), compiled_graphs(), next(s.model.parameters()).device
    seed, N = step_seed(cfg.seed, s.step), cfg.rollout.async_steps

    # ---- 1-2. rollout and reward: G samples per query, scored, drawn by the weights after step t - N (async_steps N;
    # 0: pi_old itself) on this process's prompt shards; none older than N reaches the loss
    with s.peaks.phase("generate"):
        if s.workers is not None:  # drawn by the rollout workers while the previous steps trained
            ro, async_metrics = s.workers.take(s.step)
        else:
            ro, async_metrics = collect_rollout(s.engine, s.tokenizer, s.task, s.collection, s.cursor, seed, s.shards,
                                                s.num_shards), {}
    async_metrics.update(check_staleness(ro, s.step, N))
    t_rollout, busy_start = time.perf_counter(), time.monotonic()
    s.engine.sleep()  # vLLM with rollout.sleep on GPU: free its memory until the sync

    # ---- 3. partition O+ / O- (algo.partition) and BiCC's contexts x+ = [q; O-], x- = [q; O+]
    positive = functools.partial(positives, ro, cfg.algo.partition, cfg.bicc.reward_threshold)  # O+ [N], one rule
    batch, rows, contexts, bicc_metrics = step_rows(s, cfg.bicc, cfg.train, ro, positive, device)

    # ---- 4. the no-grad log-probs the plan needs: pi_old (on q; x^c under bicc.old_on_context), pi_ref, delta's
    s.plan = s.plan or StepPlan.from_config(cfg, sampler_logprobs(cfg.rollout, s.engine))  # (a state built by hand)
    diagnose = diagnoses(cfg, s.step, s.sharded)  # the gradient-variance diagnostic's steps: delta before the update
    plan = StepPlan.from_config(cfg, ro.out.logprobs is not None, diagnostics=True) if diagnose else s.plan
    checked = agreement_checked(s, cfg.train, ro, plan, N)
    sampled = sampled_logprobs(ro, plan, batch, device)
    t_contexts = time.perf_counter()
    with s.peaks.phase("log-probs"):
        lp = step_logprobs(plan, {"model": s.model, "ref": s.ref_model}, rows, sampled, cfg, s.ranks)
    t_logprobs = time.perf_counter()
    old, ref = lp.get(("model", plan.old_context)), lp.get(("ref", plan.ref_context))
    # the sampler against the trainer on q: the tokens came from the sampler, weighted by pi_old / pi_sampler and
    # those far from it rejected (before the loss), or its gap read as a metric (after the update, from its forward)
    fresh = checked and ro.version == s.step  # drawn by these weights: pi_old on q is the trainer's side
    weighted = corrects(cfg.rollout) and ro.out.logprobs is not None and plan.old_source != "sampler"
    is_weight, sampler_metrics, kept = sampler_correction(ro, plan, lp.get(("model", "q")), batch, cfg.rollout, fresh,
                                                          s.ranks.sum) if weighted else (None, {}, None)
    trained = batch if kept is None else dataclasses.replace(batch, completion_mask=kept.to(batch.completion_mask.dtype))
    if checked and not fresh:  # drawn by older weights (rollout workers): scored at those, kept for it
        sampler_metrics.update(agreement_at_version(s, cfg, ro, rows["q"], batch))

    # ---- 5. advantages: the variant's own, or RCC's A_i = r_i - mean r - 2 Cov(r, delta), delta_i = log pi_theta_old(
    # o_i | x^c or q) - log pi_ref(o_i | q)
    delta = None if plan.delta is None else sequence_delta(lp[("model", plan.delta)], lp[("ref", "q")],
                                                           batch.completion_mask, cfg.rcc.delta).cpu()
    estimator = ADVANTAGES.get(advantage_name(cfg.algo, cfg.rcc))
    inputs = inputs_of(estimator, ro, trained.completion_mask.sum(-1).cpu(), s.ranks.sum, positive)  # what it reads
    adv, adv_metrics = estimator(ro.rewards, ro.group_ids, delta, cfg.algo, **inputs)
    adv = adv.to(device)
    numerator = rows[plan.update_context]  # the rows the update trains
    t_diagnostics = time.perf_counter()
    if diagnose:  # measured without changing the update: gradients are cleared before it
        adv_metrics.update(step_diagnostics(s, cfg, trained, numerator, ro, old, ref, adv, delta, is_weight, seed))
    diagnostics_s = time.perf_counter() - t_diagnostics

    # ---- 6. loss and optimizer step(s) on rho = pi_theta(o | x^c) / pi_old(o | q), normalised over the step
    with s.peaks.phase("update"):
        update_metrics, first = update_policy(s, trained, numerator, old, ref, adv, cfg, seed, is_weight)
    t_update = time.perf_counter()
    at_old = {**{("model", plan.update_context): first}, **lp}  # every log-prob at theta_old this step has
    if not weighted:
        sampler_metrics.update(sampler_correction(ro, plan, at_old.get(("model", "q")), batch, cfg.rollout, fresh)[1])
    on_q, on_xc = at_old.get(("model", "q")), at_old.get(("model", "xc"))
    if contexts is not None and on_q is not None and on_xc is not None:  # log w = log pi_old(o | x^c) - log pi_old(o | q)
        log_w = ((on_xc - on_q) * trained.completion_mask).sum(-1).cpu()
        bicc_metrics.update({**conditioning_weights(log_w, contexts.conditioned, ro.correct),
                             **shift_and_delta(log_w, delta, ro.rewards, ro.group_ids, contexts.conditioned)})
    if cfg.logger.samples_every and (s.step + 1) % cfg.logger.samples_every == 0:  # rows kept for reading
        s.samples = sample_rows(s.step + 1, ro, adv.cpu(), contexts, s.tokenizer, cfg.logger)

    # ---- 7. weight sync: the engine samples from the updated policy next step; under async_steps the workers get
    # the weights, version step + 1, and the batch of step + 1 + N is requested
    if s.workers is not None:
        s.workers.push(s.model, s.step + 1)
        if s.versions is not None and read_at(s.step + 1 + N, cfg.train.sampler_check_every, N):  # the step reading it
            s.versions.keep(s.model, s.step + 1)
        if s.versions is not None:  # the gate's host copies, at their most (docs/distributed.md)
            async_metrics["perf/gate_host_bytes"] = float(s.versions.bytes())
        s.workers.request(s.step + 1 + N)
        s.workers.mark_busy(busy_start, time.monotonic())
    else:
        s.engine.update_weights(s.model, s.step + 1)
    s.step += 1

    # ---- 8. metrics
    perf = {"perf/rollout_s": t_rollout - t0, "perf/generate_s": ro.generate_s, "perf/logprob_s": t_logprobs - t_contexts,
            "perf/no_grad_passes": len(plan.passes), "perf/diagnostics_s": diagnostics_s,
            "perf/update_s": t_update - t_logprobs, "perf/update_tokens": float(numerator.tokens),
            "perf/compiled_graphs": float(compiled_graphs() - graphs)}
    metrics = {**rollout_metrics(ro, batch, cfg.rollout.group_size), **async_metrics, **adv_metrics,
               **advantage_metrics(adv.cpu(), ro.rewards, ro.group_ids), **update_metrics, **bicc_metrics,
               **sampler_metrics, **perf}
    record = {"step": s.step, "delta": delta.tolist(), "correct": ro.correct.tolist(),
              "grad_var": adv_metrics["rcc/grad_var"]} if diagnose else {}  # for bicc.evaluation.plots
    return step_timing(metrics, batch, t0), record



def step_rows(s: RLState, bicc, train, ro, positive, device):
    """The rollout as a batch and as rows: (batch, {"q": the rows on q (``query_rows``), "xc": on x^c
    (``ContextRows``, the contexts partitioned by ``positive()``; q's with BiCC off)}, contexts or None, ``bicc/``
    metrics)."""
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, s.tokenizer.pad_token_id).to(device)
    plain = query_rows(batch, ro.out.prompt_ids, ro.out.completion_ids, train.share_prompts,
                       s.tokenizer.pad_token_id, device)
    if not bicc.enabled:
        return batch, {"q": plain, "xc": plain}, None, {}
    contexts = build_contexts(ro.prompts, ro.out.completion_ids, positive(), ro.group_ids, s.tokenizer, bicc,
                              bicc.max_tokens, ro.out.prompt_ids, s.end_ids, s.task.answer_anchors)
    on_xc = ContextRows(contexts, ro.out.completion_ids, batch.completion_len, train, s.tokenizer.pad_token_id, device)
    return batch, {"q": plain, "xc": on_xc}, contexts, {**contexts.metrics,
                                                        "bicc/extra_token_share": on_xc.tokens / plain.tokens - 1}


def sampled_logprobs(ro, plan, batch, device) -> torch.Tensor | None:
    """The engine's sampling log-probs on the batch's [N, L] grid, or None when it returned none."""
    if ro.out.logprobs is None:
        return None
    mask = batch.completion_mask.cpu()
    sampled, valid = sampler_grid(ro.out.logprobs, torch.zeros(mask.shape), mask)
    if plan.old_source == "sampler" and not bool(valid[mask.bool()].all()):
        raise ValueError("rollout.old_from_sampler: the engine returned no log-prob for some sampled tokens")
    return sampled.to(device)







def step_timing(metrics: dict, batch, t0: float) -> dict:
    """``metrics`` with ``perf/step_s`` and ``perf/tokens_per_s`` up to now. (No phase's seconds are synchronised
    on CUDA; ``perf/generate_s`` is part of ``perf/rollout_s``.)"""
    seconds = time.perf_counter() - t0
    return {**metrics, "perf/step_s": seconds, "perf/tokens_per_s": float(batch.attention_mask.sum()) / seconds}


def step_diagnostics(s: RLState, cfg: StepConfig, batch, numerator, ro, old, ref, adv, delta, is_weight, seed: int):
    """RCC's diagnostics on this step's batch (delta by reward, gradient variance over group splits; Cov(r, delta)
    when RCC is off), measured without changing the update: gradients are cleared before it."""
    metrics = {}
    if not cfg.rcc.enabled:
        _, rcc_metrics = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
        metrics.update({k: v for k, v in rcc_metrics.items() if k.startswith("rcc/")})
    loss_of_rows = loss_of_rows_fn(s.model, numerator, batch, old, ref, adv, cfg, is_weight)
    s.model.train()
    grad_var = gradient_variance(s.model, loss_of_rows, ro.group_ids.to(adv.device), cfg.diag.splits,
                                 torch.Generator().manual_seed(seed), cfg.train.micro_batch_size)
    return {**metrics, **delta_by_reward(delta, ro.correct), "rcc/grad_var": grad_var}
