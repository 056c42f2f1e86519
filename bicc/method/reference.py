"""One RL update, unoptimised: one sequence per forward, no packing, no KV reuse, no micro-batches, no step plan;
and the loop of updates on stale batches that ``rollout.async_steps`` runs (``stale_loop``).
Under ``bicc=on rcc=on`` it is the paper's Algorithm 1; every other switch the config offers reads as one plain
line below (the variant's own advantage without RCC, delta on q, pi_old and the KL's reference on x^c under
``bicc.old_on_context``, the released code's ratio pi_theta(o | q) / pi_old(o | x^c) under
``bicc.context_in=denominator``, truncated importance weights). No training path calls it; ``tests/test_reference.py``
holds ``bicc.trainer.step.rl_step`` equal to it. Every formula is the library's own function.
"""

from __future__ import annotations

import copy
import functools

import torch

from bicc.config import StepConfig, corrects, is_level
from bicc.method.advantages import ADVANTAGES, inputs_of, sequence_delta
from bicc.method.conditioning import build_contexts, positives
from bicc.method.correction import correct
from bicc.method.losses import LOSSES, StepTotals
from bicc.method.losses.tis import sampler_grid
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.model.lora import module_of


def algorithm1_step(model, ref_model, optimizer, scheduler, tokenizer, ro, cfg: StepConfig, anchors, end_ids) -> dict:
    """One update of ``model`` on the rollout ``ro`` (``bicc.rollout.collect.Rollout``: G outputs per query q
    sampled from pi_old = ``model`` as it is now, their rewards, and the sampler's log-probs when the engine gave
    them). Returns the step's loss, advantages, delta (None without RCC), each output's log conditioning weight
    log w = log pi_old(o | x^c) - log pi_old(o | q) and which outputs were conditioned (None with BiCC off)."""
    q, outputs, pad, temperature = ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id, cfg.rollout.temperature
    mask = make_token_batch(q, outputs, pad).completion_mask  # [N, L]

    def logp(policy, prompts):  # [N, L]: log policy(o_i | prompts[i]), one forward per sequence
        with module_of(policy) as module:  # pi_ref under model.lora: the policy with its adapters off
            rows = [batch_logprobs(module, make_token_batch([p], [o], pad), temperature)[0][0] for p, o in zip(prompts, outputs)]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    # partition O+ / O- per group (algo.partition: by the verdict, or the shaped reward > 0.5); x+ = [q; O-], x- = [q; O+]
    # (q itself where a group has one side only); BiCC off: q
    positive = functools.partial(positives, ro, cfg.algo.partition, cfg.bicc.reward_threshold)
    contexts = build_contexts(ro.prompts, outputs, positive(), ro.group_ids, tokenizer, cfg.bicc, cfg.bicc.max_tokens, q,
                              end_ids, anchors) if cfg.bicc.enabled else None
    xc = contexts.prompt_ids if contexts is not None else q
    old_on_xc = cfg.bicc.enabled and cfg.bicc.old_on_context  # the stabilised form (bicc=stable); the paper: on q
    released = cfg.bicc.enabled and cfg.bicc.context_in == "denominator"  # bicc=released: pi_old on x^c, pi_theta on q
    with torch.no_grad():
        # pi_old(o | q): the trainer's, or the sampler's own log-probs under rollout.old_from_sampler
        old_q = sampler_grid(ro.out.logprobs, mask.float(), mask)[0] if cfg.rollout.old_from_sampler else logp(model, q)
        old_xc = logp(model, xc) if cfg.bicc.enabled else old_q  # pi_old(o | x^c); x^c is q with BiCC off
        old = old_xc if old_on_xc or released else old_q  # the ratio's denominator
        ref = logp(ref_model, q)  # pi_ref(o | q)
        kl_ref = logp(ref_model, xc) if old_on_xc and cfg.algo.kl_coef > 0 else ref  # the KL's: like with like
    # the rollout correction: the tokens came from the sampler, so each is weighted by pi_old(o | q) / pi_sampler(o | q)
    # (truncated, or zeroed out of a band), and those far from the sampler leave the loss and its normalisers (the
    # mask the advantages, the loss and log w read from here on; delta reads every token)
    is_weight, c, full = None, cfg.rollout.correction, mask
    if corrects(cfg.rollout) and ro.out.logprobs is not None and not cfg.rollout.old_from_sampler:
        sampled, valid = sampler_grid(ro.out.logprobs, old_q, mask)
        is_weight, mask, _ = correct(torch.where(valid, old_q - sampled, torch.zeros_like(old_q)), mask,
                                     is_level(cfg.rollout), c.rollout_is_threshold, c.rollout_is_batch_normalize,
                                     c.rollout_rs, c.rollout_rs_threshold)
    log_w = ((old_xc - old_q) * mask).sum(-1)  # [N] BiCC's log conditioning weight at theta_old, over trained tokens
    if cfg.rcc.enabled:  # RCC: delta_i = log pi_theta(o_i | x^c or q) - log pi_ref(o_i | q), A_i = r_i - mean r - 2 Cov
        delta = sequence_delta(old_xc if cfg.rcc.delta_context == "xc" else old_q, ref, full, cfg.rcc.delta)
        adv, _ = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
        if cfg.rcc.scale == "std":  # rcc=std, a diagnostic form (not the paper's): over each group's reward std
            std = torch.stack([ro.rewards[ro.group_ids == g].double().std(unbiased=False) for g in ro.group_ids])
            adv = (adv.double() / (std + cfg.algo.adv_eps)).to(adv.dtype)
    else:
        delta = None
        estimator = ADVANTAGES.get(cfg.algo.advantage)  # with what it reads: each output's length, the step's sums
        adv, _ = estimator(ro.rewards, ro.group_ids, None, cfg.algo, **inputs_of(estimator, ro, mask.sum(-1), None, positive))
    # the registered loss on rho_i = pi_theta(o_i | x^c) / pi_old(o_i | q) (released: pi_theta(o_i | q) /
    # pi_old(o_i | x^c)), normalised over the whole step
    new = logp(model, q if released else xc)
    loss, _ = LOSSES.get(cfg.algo.loss)(new, old, kl_ref, adv, mask, cfg.algo, StepTotals.of(mask, cfg.rollout.max_new_tokens),
                                        is_weight=is_weight)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    optimizer.step()
    scheduler.step()
    return {"loss": loss.item(), "advantages": adv, "delta": delta, "log_w": log_w,
            "conditioned": None if contexts is None else contexts.conditioned}


def stale_loop(model, ref_model, optimizer, scheduler, tokenizer, sample, steps: int, async_steps: int, cfg: StepConfig, anchors,
               end_ids) -> list[dict]:
    """``steps`` updates of ``model`` under ``rollout.async_steps`` = N: batch t is ``sample(t, policy)``, drawn by
    ``policy`` = theta_{max(0, t - N)}, the weights after step t - N (theta_0 for the first N steps), with that
    sampler's log-probs (the behaviour policy). Each update is ``algorithm1_step`` on the current weights theta_t:
    pi_old is theta_t's own pass (the proximal policy), each token weighted by min(pi_old / pi_behaviour, C) under
    TIS; BiCC's ratio keeps pi_old(o | q) as its denominator and RCC's delta reads the same pi_old. N = 0 is the
    synchronous loop. Returns each step's ``algorithm1_step`` result."""
    snapshots = [copy.deepcopy(model)]  # theta_0, theta_1, ...
    results = []
    for t in range(steps):
        ro = sample(t, snapshots[max(0, t - async_steps)])
        results.append(algorithm1_step(model, ref_model, optimizer, scheduler, tokenizer, ro, cfg, anchors, end_ids))
        snapshots.append(copy.deepcopy(model))
    return results
