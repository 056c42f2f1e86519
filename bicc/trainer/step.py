"""One RL step, the paper's Algorithm 1 in marked phases: rollout -> reward -> partition/contexts ->
log-probs (``bicc.trainer.plan``) -> advantages -> loss and optimizer step (``bicc.trainer.update``) -> weight sync -> metrics, on
the state ``bicc.trainer.state.build_rl_state`` builds. This process's step: what the ranks share after it (every
shard's data position, the metrics' mean) is ``bicc.trainer.loop.step_on_every_rank``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from bicc.config import StepConfig, is_level
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import ContextRows, query_rows
from bicc.machine.distributed import summed_over_ranks
from bicc.method.advantages import ADVANTAGES, Advantages, advantage_metrics, advantage_name, inputs_of
from bicc.method.conditioning import build_contexts, positives
from bicc.method.correction import correct
from bicc.method.diagnostics import (
    conditioning_weights,
    delta_by_reward,
    gradient_variance,
    sequence_delta,
    shift_and_delta,
)
from bicc.method.losses.tis import sampler_grid, sampler_logprob_diff
from bicc.model.logprobs import make_token_batch
from bicc.rollout.agreement import WeightVersions, check_every, token_prob_ratio
from bicc.rollout.collect import collect_rollout, step_seed
from bicc.rollout.workers import check_staleness
from bicc.trainer.plan import StepPlan, step_logprobs
from bicc.trainer.samples import sample_rows
from bicc.trainer.state import RLState, sampler_logprobs
from bicc.trainer.update import loss_of_rows_fn, update_policy


def rl_step(s: RLState, cfg: StepConfig) -> tuple[dict, dict]:
    t0, graphs = time.perf_counter(), compiled_graphs()
    device = next(s.model.parameters()).device
    seed, N = step_seed(cfg.seed, s.step), cfg.rollout.async_steps

    # ---- 1-2. rollout and reward: G samples per query, scored (binary, plus shaping), drawn by the weights
    # after step t-N (async_steps N; 0: pi_old itself). Each process takes its own prompt shards; groups never
    # span processes. The batch's weight version is checked: none older than N reaches the loss.
    with s.peaks.phase("generate"):
        if s.workers is not None:  # drawn by the rollout workers while the previous steps trained
            ro, async_metrics = s.workers.take(s.step)
        elif s.collection is None:
            raise ValueError("RLState.collection is None: build the state with build_rl_state, or set collection="
                             "bicc.rollout.collect.Collection.of(algo, rollout, data)")
        else:
            ro, async_metrics = collect_rollout(s.engine, s.tokenizer, s.task, s.collection, s.cursor, seed, s.shards,
                                                s.num_shards), {}
    async_metrics.update(check_staleness(ro, s.step, N))
    t_rollout, busy_start = time.perf_counter(), time.monotonic()
    s.engine.sleep()  # vLLM with rollout.sleep on GPU: free its memory until the sync

    # ---- 3. partition and contexts: BiCC conditions the trainable numerator on x^c (the released code's form:
    # pi_old, the denominator) ----------------------------------------------------------------------------------
    positive = functools.partial(positives, ro, cfg.algo.partition, cfg.bicc.reward_threshold)  # O+ [N], one rule
    batch, plain, on_xc, contexts, bicc_metrics = step_inputs(s, cfg.bicc, cfg.train, ro, positive, device)

    # ---- 4. the plan's log-probs: pi_old (on q; x^c under bicc.old_on_context), pi_ref, delta's ----
    if s.plan is None:  # a state built by hand (build_rl_state resolves it)
        s.plan = StepPlan.from_config(cfg, sampler_logprobs(cfg.rollout, s.engine))
    plan = s.plan.at_step(cfg, s.step, ro.out.logprobs is not None, s.sharded)
    numerator = on_xc if plan.update_context == "xc" else plain  # the rows the update trains
    checked = agreement_checked(s, cfg.train, ro, plan, cfg.rollout.async_steps)
    sampled = sampled_logprobs(ro, plan, batch, device)
    t_contexts = time.perf_counter()
    with s.peaks.phase("log-probs"):
        lp = step_logprobs(plan, s.model, s.ref_model, plain, on_xc, sampled, cfg, batch.completion_mask, s.dist)
    t_logprobs = time.perf_counter()
    fresh = checked and ro.version == s.step  # drawn by these weights: pi_old on q is the trainer's side
    step_sum = summed_over_ranks(s.dist)
    correct_sampler = lambda on_q: sampler_correction(ro, plan, on_q, batch, cfg.rollout, device, fresh,  # noqa: E731
                                                      step_sum)
    is_weight, sampler_metrics, kept = (None, {}, None) if plan.sampler_from_update else correct_sampler(lp.on_q)
    trained = batch if kept is None else dataclasses.replace(batch, completion_mask=kept.to(batch.completion_mask.dtype))
    if checked and not fresh:  # drawn by older weights (rollout workers): scored at those, kept for it
        sampler_metrics.update(agreement_at_version(s, cfg, ro, plain, batch))

    # ---- 5. advantages; RCC corrects them by Cov(r, delta) and replaces the variant's own ----------
    estimator = ADVANTAGES.get(advantage_name(cfg.algo, cfg.rcc))
    inputs = inputs_of(estimator, ro, trained.completion_mask.sum(-1).cpu(), step_sum, positive)  # what it reads

    def advantages(delta_logp) -> Advantages:
        """The step's advantages from delta's log pi_theta_old(o | x^c or q) [N, L] (None: no delta this step):
        delta_i = log pi_theta(o_i | x^c or q) - log pi_ref(o_i | q), theta = theta_old here."""
        delta = None if delta_logp is None else sequence_delta(delta_logp, lp.ref, batch.completion_mask, cfg.rcc.delta).cpu()
        values, metrics = estimator(ro.rewards, ro.group_ids, delta, cfg.algo, **inputs)
        return Advantages(values.to(device), delta, metrics)

    diag_record, diag_metrics = {}, {}
    t_diagnostics = time.perf_counter()
    if plan.diagnostics:  # never with delta_from_update: lp.delta is delta's log-probs
        diag_metrics, diag_record = step_diagnostics(s, cfg, trained, numerator, ro, lp, advantages(lp.delta), is_weight,
                                                     seed)
    diagnostics_s = time.perf_counter() - t_diagnostics

    # ---- 6. loss and optimizer step(s); the advantages are computed inside, on lp.delta or (under
    # plan.delta_from_update) on the update's own first forward -----------------------------------
    sampler_fn = correct_sampler if plan.sampler_from_update else None
    with s.peaks.phase("update"):
        update_metrics, first_pass_log_ratio, adv = update_policy(s, trained, numerator, lp.old, lp.kl_ref, advantages,
                                                                  cfg, seed, is_weight, delta_logp=lp.delta,
                                                                  delta_from_update=plan.delta_from_update,
                                                                  sampler_fn=sampler_fn)
    adv_metrics = {**adv.metrics, **diag_metrics, **advantage_metrics(adv.values.cpu(), ro.rewards, ro.group_ids)}
    t_update = time.perf_counter()
    if contexts is not None:  # log w: pi_old on x^c vs on q, or (pi_old on q) the update's first pass; over the
        # tokens the update trains (a rejection's leave it, as they leave the first pass)
        log_w = first_pass_log_ratio if plan.old_context == "q" else lp.log_w
        if log_w is not None and kept is not None and plan.old_context != "q":
            log_w = ((lp.old - lp.on_q) * trained.completion_mask).sum(-1).cpu()
        if log_w is not None:
            bicc_metrics.update(conditioning_weights(log_w, contexts.conditioned, ro.correct))
            bicc_metrics.update(shift_and_delta(log_w, adv.delta, ro.rewards, ro.group_ids, contexts.conditioned))

    if cfg.logger.samples_every and (s.step + 1) % cfg.logger.samples_every == 0:  # rows kept for reading
        s.samples = sample_rows(s.step + 1, ro, adv.values.cpu(), contexts, s.tokenizer, cfg.logger)

    # ---- 7. weight sync: the rollout engine samples from the updated policy next step; under async_steps the
    # workers get the weights, version step + 1, and the batch of step + 1 + N is requested (drawn by them) ------
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

    # ---- 8. metrics ----------------------------------------------------------------------------
    perf = {"perf/rollout_s": t_rollout - t0, "perf/generate_s": ro.generate_s, "perf/logprob_s": t_logprobs - t_contexts,
            "perf/no_grad_passes": plan.no_grad_passes(), "perf/diagnostics_s": diagnostics_s,
            "perf/update_s": t_update - t_logprobs, "perf/update_tokens": float(numerator.tokens),
            "perf/compiled_graphs": float(compiled_graphs() - graphs)}
    metrics = {**rollout_metrics(ro, batch, cfg.rollout.group_size), **async_metrics, **adv_metrics, **update_metrics,
               **bicc_metrics, **sampler_metrics, **perf}
    return step_timing(metrics, batch, t0), diag_record


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (``model.compile``): one that turns up mid-run is a step
    that paid for its compilation."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def step_inputs(s: RLState, bicc, train, ro, positive, device):
    """The rollout as rows on q (``query_rows``) and, under BiCC, on x^c (``ContextRows``, the contexts partitioned
    by ``positive()``, O+ [N]): (batch, plain, on_xc, contexts or None, ``bicc/`` metrics); on_xc is plain with BiCC
    off."""
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, s.tokenizer.pad_token_id).to(device)
    plain = query_rows(batch, ro.out.prompt_ids, ro.out.completion_ids, train.share_prompts,
                       s.tokenizer.pad_token_id, device)
    if not bicc.enabled:
        return batch, plain, plain, None, {}
    contexts = build_contexts(ro.prompts, ro.out.completion_ids, positive(), ro.group_ids, s.tokenizer, bicc,
                              bicc.max_tokens, ro.out.prompt_ids, s.end_ids, s.task.answer_anchors)
    on_xc = ContextRows(contexts, ro.out.completion_ids, batch.completion_len, train, s.tokenizer.pad_token_id, device)
    return batch, plain, on_xc, contexts, {**contexts.metrics, "bicc/extra_token_share": on_xc.tokens / plain.tokens - 1}


def sampled_logprobs(ro, plan, batch, device) -> torch.Tensor | None:
    """The engine's sampling log-probs on the batch's [N, L] grid, or None when it returned none."""
    if ro.out.logprobs is None:
        return None
    mask = batch.completion_mask.cpu()
    sampled, valid = sampler_grid(ro.out.logprobs, torch.zeros(mask.shape), mask)
    if plan.old_source == "sampler" and not bool(valid[mask.bool()].all()):
        raise ValueError("rollout.old_from_sampler: the engine returned no log-prob for some sampled tokens")
    return sampled.to(device)


def sampler_correction(ro, plan, on_q, batch, rollout, device, fresh: bool = False, step_sum=None):
    """The sampler against the trainer, both on q (``on_q`` [N, L]: pi_old on q): ``rollout/logprob_diff``,
    ``rollout/token_prob_ratio`` where ``fresh`` (these weights drew the batch) and, under ``rollout.correction``, the
    importance weights pi_old / pi_sampler and the rejection of tokens far from the sampler (tokens were drawn from
    pi_sampler, not pi_old: bicc/method/correction.py). Returns (weights [N, L] or None, metrics, the mask the update
    trains [N, L] or None: the batch's); nothing when the engine gave no log-probs or they stand for pi_old."""
    if ro.out.logprobs is None or plan.old_source == "sampler":
        return None, {}, None
    mask, q = batch.completion_mask.cpu(), on_q.cpu()
    metrics = {"rollout/logprob_diff": sampler_logprob_diff(ro.out.logprobs, q, mask)}
    ratio = token_prob_ratio(ro.out.logprobs, q, mask) if fresh else None
    if ratio is not None:
        metrics["rollout/token_prob_ratio"] = ratio
    if not plan.tis:
        return None, metrics, None
    sampled, valid = sampler_grid(ro.out.logprobs, q, mask)
    c = rollout.correction
    weight, kept, corr_metrics = correct(torch.where(valid, q - sampled, torch.zeros_like(q)), mask, is_level(rollout),
                                         c.rollout_is_threshold, c.rollout_is_batch_normalize, c.rollout_rs,
                                         c.rollout_rs_threshold, step_sum)
    metrics.update(corr_metrics)
    return (None if weight is None else weight.to(device)), metrics, (kept.to(device) if c.rollout_rs else None)


def read_at(step: int, every: int | None, async_steps: int) -> bool:
    """Whether ``step`` measures ``rollout/token_prob_ratio`` (``train.sampler_check_every``, null resolved)."""
    every = check_every(every, async_steps)
    return bool(every) and step % every == 0


def agreement_checked(s: RLState, train, ro, plan, async_steps: int = 0) -> bool:
    """Whether this step measures ``rollout/token_prob_ratio`` (``bicc.rollout.agreement``); under rollout workers,
    the first step keeps the weights the workers started from where a later step reads them (its own batch is drawn
    by the weights it trains: measured at no cost)."""
    if s.workers is not None and s.versions is None:
        s.versions = WeightVersions()
        if any(read_at(t, train.sampler_check_every, async_steps) for t in range(s.step + 1, s.step + async_steps + 1)):
            s.versions.keep(s.model, s.step)
    return read_at(s.step, train.sampler_check_every, async_steps) and ro.out.logprobs is not None \
        and plan.old_source != "sampler"


def agreement_at_version(s: RLState, cfg: StepConfig, ro, plain, batch) -> dict:
    """``rollout/token_prob_ratio`` of a batch drawn by an older weight version, scored by the trainer at that
    version's kept parameters (one no-grad pass on q); {} for a version not kept (drawn before a resume)."""
    if s.versions is None or ro.version not in s.versions.kept:
        return {}
    with s.versions.at(s.model, ro.version):
        then = logprobs_no_grad(s.model, plain, len(ro.out.completion_ids), cfg.train.micro_batch_size,
                                cfg.rollout.temperature, s.dist, cfg.train.micro_batch_tokens)
    N = cfg.rollout.async_steps  # the version the workers started from is read by the N steps after this one too
    s.versions.forget(ro.version, any(read_at(t, cfg.train.sampler_check_every, N)
                                      for t in range(s.step + 1, ro.version + N + 1)))
    ratio = token_prob_ratio(ro.out.logprobs, then, batch.completion_mask)
    return {} if ratio is None else {"rollout/token_prob_ratio": ratio}


def rollout_metrics(ro, batch, group_size: int) -> dict:
    lengths = batch.completion_mask.sum(-1).float()
    return {"reward/accuracy": ro.correct.mean().item(), "reward/mean": ro.rewards.mean().item(),
            "rollout/response_len": lengths.mean().item(),
            "rollout/truncated_share": 1 - sum(ro.out.finished) / len(ro.out.finished),
            "rollout/prompts_drawn": ro.prompts_drawn, "rollout/generate_rounds": ro.rounds,
            "rollout/prompts_over_length": float(ro.prompts_over_length),
            "rollout/groups": len(ro.correct) // group_size,
            **{f"reward/{name}": float(v.sum() if name == "scoring_errors" else v.mean())
               for name, v in ro.reward_parts.items()}}


def step_timing(metrics: dict, batch, t0: float) -> dict:
    """``metrics`` with ``perf/step_s`` and ``perf/tokens_per_s`` up to now. (No phase's seconds are synchronised
    on CUDA; ``perf/generate_s`` is part of ``perf/rollout_s``.)"""
    seconds = time.perf_counter() - t0
    return {**metrics, "perf/step_s": seconds, "perf/tokens_per_s": float(batch.attention_mask.sum()) / seconds}


def step_diagnostics(s: RLState, cfg: StepConfig, batch, numerator, ro, lp, adv: Advantages, is_weight, step_seed: int):
    """RCC's diagnostics on this step's batch (delta by reward, gradient variance over group splits),
    measured without changing the update: gradients are cleared before it. Returns (metrics, the raw
    per-sample record for bicc.evaluation.plots)."""
    metrics, delta = {}, adv.delta
    if not cfg.rcc.enabled:
        _, rcc_metrics = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
        metrics.update({k: v for k, v in rcc_metrics.items() if k.startswith("rcc/")})
    loss_of_rows = loss_of_rows_fn(s.model, numerator, batch, lp.old, lp.kl_ref, adv.values, cfg, is_weight)
    s.model.train()
    grad_var = gradient_variance(s.model, loss_of_rows, ro.group_ids.to(adv.values.device), cfg.diag.splits,
                                 torch.Generator().manual_seed(step_seed), cfg.train.micro_batch_size)
    metrics.update({**delta_by_reward(delta, ro.correct), "rcc/grad_var": grad_var})
    return metrics, {"step": s.step + 1, "delta": delta.tolist(), "correct": ro.correct.tolist(), "grad_var": grad_var}
