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

from bicc.config import StepConfig, corrects
from bicc.kernels.compile import compiled_graphs
from bicc.kernels.rows import step_rows
from bicc.method.advantages import ADVANTAGES, advantage_metrics, advantage_name, inputs_of, sequence_delta
from bicc.method.conditioning import build_contexts, positives
from bicc.method.diagnostics import conditioning_weights, gradient_diagnostics, shift_and_delta
from bicc.model.logprobs import make_token_batch
from bicc.rollout.agreement import agreement_at_version, agreement_checked, read_at, sampler_correction
from bicc.rollout.collect import collect_rollout, rollout_metrics, step_seed
from bicc.rollout.workers import check_staleness
from bicc.trainer.plan import StepPlan, diagnoses, step_logprobs
from bicc.trainer.state import RLState
from bicc.trainer.update import update_policy


def rl_step(s: RLState, cfg: StepConfig) -> tuple[dict, dict]:
    t0, graphs, device = time.perf_counter(), compiled_graphs(), next(s.model.parameters()).device
    seed, N = step_seed(cfg.seed, s.step), cfg.rollout.async_steps

    # ---- 1-2. rollout and reward: G samples per query, scored, drawn by the weights after step t - N (async_steps N;
    # 0: pi_old itself) on this process's prompt shards; none older than N reaches the loss
    with s.peaks.phase("generate"):
        if s.workers is not None:  # drawn by the rollout workers while the previous steps trained
            ro, metrics = s.workers.take(s.step)
        else:
            ro, metrics = collect_rollout(s.engine, s.tokenizer, s.task, s.collection, s.cursor, seed, s.shards,
                                          s.num_shards), {}
    metrics.update({**rollout_metrics(ro, cfg.rollout.group_size), **check_staleness(ro, s.step, N)})
    t_rollout, busy_start = time.perf_counter(), time.monotonic()
    s.engine.sleep()  # vLLM with rollout.vllm.sleep on GPU: free its memory until the sync

    # ---- 3. partition O+ / O- (algo.partition) and BiCC's contexts x+ = [q; O-], x- = [q; O+]
    positive = functools.partial(positives, ro, cfg.algo.partition, cfg.bicc.reward_threshold)  # O+ [N], one rule
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, s.tokenizer.pad_token_id).to(device)
    contexts = build_contexts(ro.prompts, ro.out.completion_ids, positive(), ro.group_ids, s.tokenizer, cfg.bicc,
                              cfg.bicc.max_tokens, ro.out.prompt_ids, s.end_ids, s.task.answer_anchors) \
        if cfg.bicc.enabled else None
    rows = step_rows(batch, ro.out, contexts, cfg.train, s.tokenizer.pad_token_id)  # on q and on x^c
    if contexts is not None:
        metrics.update({**contexts.metrics, "bicc/extra_token_share": rows["xc"].tokens / rows["q"].tokens - 1})

    # ---- 4. the no-grad log-probs the plan needs: pi_old (on q; x^c under bicc.old_on_context), pi_ref, delta's
    s.plan = s.plan or StepPlan.from_config(cfg, ro.out.logprobs is not None)  # (a state built by hand)
    diagnose = diagnoses(cfg, s.step, s.sharded)  # the gradient-variance diagnostic's steps: delta before the update
    plan = StepPlan.from_config(cfg, ro.out.logprobs is not None, diagnostics=True) if diagnose else s.plan
    t_contexts = time.perf_counter()
    with s.peaks.phase("log-probs"):
        lp = step_logprobs(plan, {"model": s.model, "ref": s.ref_model}, rows, ro.out.logprobs, batch.completion_mask,
                           cfg, s.ranks)
    t_logprobs = time.perf_counter()
    old, ref = lp.get(("model", plan.old_context)), lp.get(("ref", plan.ref_context))
    # the sampler against the trainer on q: the tokens came from the sampler, weighted by pi_old / pi_sampler and
    # those far from it rejected (before the loss), or its gap read as a metric (after the update, from its forward)
    checked = agreement_checked(s, cfg.train, ro, plan, N)
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
    metrics.update({**adv_metrics, **advantage_metrics(adv, ro.rewards, ro.group_ids)})
    adv_host, adv, numerator = adv, adv.to(device), rows[plan.update_context]  # the rows the update trains
    t_diagnostics = time.perf_counter()
    if diagnose:  # measured without changing the update: gradients are cleared before it
        metrics.update(gradient_diagnostics(s.model, numerator, trained, old, ref, adv, is_weight, cfg, ro, delta, seed))
    diagnostics_s = time.perf_counter() - t_diagnostics

    # ---- 6. loss and optimizer step(s) on rho = pi_theta(o | x^c) / pi_old(o | q), normalised over the step
    with s.peaks.phase("update"):
        update_metrics, first = update_policy(s, trained, numerator, old, ref, adv, cfg, seed, is_weight)
    t_update = time.perf_counter()
    at_old = {("model", plan.update_context): first, **lp}  # every log-prob at theta_old the step has
    on_q, on_xc = at_old.get(("model", "q")), at_old.get(("model", "xc"))
    if contexts is not None and on_q is not None and on_xc is not None:  # log w = log pi_old(o | x^c) - log pi_old(o | q)
        log_w = ((on_xc - on_q) * trained.completion_mask).sum(-1).cpu()
        metrics.update({**conditioning_weights(log_w, contexts.conditioned, ro.correct),
                        **shift_and_delta(log_w, delta, ro.rewards, ro.group_ids, contexts.conditioned)})
    if not weighted:
        sampler_metrics.update(sampler_correction(ro, plan, on_q, batch, cfg.rollout, fresh)[1])

    # ---- 7. weight sync: the engine samples from the updated policy next step; under async_steps the workers get
    # the weights, version step + 1, and the batch of step + 1 + N is requested
    if s.workers is not None:
        s.workers.push(s.model, s.step + 1)
        if s.versions is not None and read_at(s.step + 1 + N, cfg.train.sampler_check_every, N):  # the step reading it
            s.versions.keep(s.model, s.step + 1)
        if s.versions is not None:  # the gate's host copies, at their most (docs/distributed.md)
            metrics["perf/gate_host_bytes"] = float(s.versions.bytes())
        s.workers.request(s.step + 1 + N)
        s.workers.mark_busy(busy_start, time.monotonic())
    else:
        s.engine.update_weights(s.model, s.step + 1)
    s.samples = ro, adv_host, contexts  # the loop keeps rows of them for reading (logger.samples_every)
    s.step += 1

    # ---- 8. metrics (no phase's seconds are synchronised on CUDA; perf/generate_s is part of perf/rollout_s)
    seconds = time.perf_counter() - t0
    metrics.update({**update_metrics, **sampler_metrics, "perf/rollout_s": t_rollout - t0, "perf/generate_s": ro.generate_s,
                    "perf/logprob_s": t_logprobs - t_contexts, "perf/no_grad_passes": len(plan.passes),
                    "perf/diagnostics_s": diagnostics_s, "perf/update_s": t_update - t_logprobs,
                    "perf/update_tokens": float(numerator.tokens), "perf/compiled_graphs": float(compiled_graphs() - graphs),
                    "perf/step_s": seconds, "perf/tokens_per_s": float(batch.attention_mask.sum()) / seconds})
    record = {"step": s.step, "delta": delta.tolist(), "correct": ro.correct.tolist(),
              "grad_var": metrics["rcc/grad_var"]} if diagnose else {}  # for bicc.evaluation.plots
    return metrics, record
