"""Algorithm 1 of the paper (BiCC + RCC) for one rollout, unoptimised: one sequence per forward, no packing, no
KV reuse, no micro-batches, no step plan. No training path calls it; ``tests/test_reference.py`` holds
``bicc.step.rl_step`` equal to it. Every formula is the library's own function.
"""

from __future__ import annotations

import torch

from bicc.advantages import ADVANTAGES
from bicc.conditioning import build_contexts
from bicc.diagnostics import sequence_delta
from bicc.logprobs import batch_logprobs, make_token_batch
from bicc.losses import LOSSES, StepTotals


def algorithm1_step(model, ref_model, optimizer, scheduler, tokenizer, ro, cfg, anchors, end_ids) -> dict:
    """One update of ``model`` on the rollout ``ro`` (``bicc.rollout.collect.Rollout``: G outputs per query q
    sampled from pi_old = ``model`` as it is now, their rewards). Returns the step's loss, advantages and delta."""
    q, outputs, pad, temperature = ro.out.prompt_ids, ro.out.completion_ids, tokenizer.pad_token_id, cfg.rollout.temperature
    mask = make_token_batch(q, outputs, pad).completion_mask  # [N, L]

    def logp(policy, prompts):  # [N, L]: log policy(o_i | prompts[i]), one forward per sequence
        rows = [batch_logprobs(policy, make_token_batch([p], [o], pad), temperature)[0][0] for p, o in zip(prompts, outputs)]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    # partition O+ / O- per group; x+ = [q; O-], x- = [q; O+] (q itself where a group has one side only)
    xc = build_contexts(ro.prompts, outputs, ro.correct, ro.group_ids, tokenizer, cfg.bicc, cfg.bicc.max_tokens,
                        q, end_ids, anchors).prompt_ids
    with torch.no_grad():
        old = logp(model, q)  # pi_old(o | q): the ratio's denominator
        ref = logp(ref_model, q)  # pi_ref(o | q)
        on_delta_context = logp(model, xc if cfg.rcc.delta_context == "xc" else q)
    # RCC: delta_i = log pi_theta(o_i | x^c) - log pi_ref(o_i | q), A_i = r_i - mean r - 2 Cov(r, delta)
    delta = sequence_delta(on_delta_context, ref, mask, cfg.rcc.delta)
    adv, _ = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
    # the registered loss on rho_i = pi_theta(o_i | x^c) / pi_old(o_i | q), normalised over the whole step
    new = logp(model, xc)
    loss, _ = LOSSES.get(cfg.algo.loss)(new, old, ref, adv, mask, cfg.algo, StepTotals.of(mask, cfg.rollout.max_new_tokens))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
    optimizer.step()
    scheduler.step()
    return {"loss": loss.item(), "advantages": adv, "delta": delta}
