"""The policy update of one RL step (``bicc.trainer.step.rl_step``'s phase 6): the loss of a set of rows, and the
optimizer steps over minibatches and micro-batches, each normalised by its minibatch's global ``StepTotals``.
"""

from __future__ import annotations

import math
import time

import torch

from bicc.config import StepConfig
from bicc.kernels.batching import micro_batches
from bicc.kernels.compiled_loss import loss_function
from bicc.machine.distributed import all_reduce_sum, full_tensor, global_totals, loss_scale, sync_gradients
from bicc.method.advantages import AdvantageFn, Advantages
from bicc.method.losses import LOSSES, StepTotals, masked_mean
from bicc.model.logprobs import TokenBatch, on_device
from bicc.trainer.state import RLState


def rows_loss(logp, rows, mask, old_logp, ref_logp, adv, algo, totals, is_weight=None, loss_fn=None):
    """The update's loss on ``rows`` (one micro-batch; ``mask`` [n, L] their completion mask) from their
    log-probs ``logp`` [n, L] (with their graph), normalised by ``totals``: (differentiable loss, the loss's
    metrics, ``logp`` detached, pi_old [n, L]). ``old_logp`` None: pi_old is
    this forward (``bicc.trainer.plan.StepPlan`` old_source "update"), detached. ``loss_fn``: the registered
    ``algo.loss`` or its compiled form (``bicc.kernels.compiled_loss.loss_function``); None: the registered one.
    ``rows`` may live on the GPU (``on_device``): each tensor is indexed on its own device."""
    pick = lambda x: None if x is None else x[rows if rows.device == x.device else rows.to(x.device)]  # noqa: E731
    old = logp.detach() if old_logp is None else pick(old_logp)
    loss_fn = loss_fn or LOSSES.get(algo.loss)
    loss, metrics = loss_fn(logp, old, pick(ref_logp), pick(adv), mask, algo, totals, is_weight=pick(is_weight))
    return loss, metrics, logp.detach(), old


def loss_of_rows_fn(model, numerator, batch: TokenBatch, old_logp, ref_logp, adv, cfg: StepConfig, is_weight=None):
    """``loss(rows, norm_rows)``: the update's loss on ``rows`` normalised over ``norm_rows`` (a whole
    minibatch or a diagnostic split), as a differentiable scalar."""

    def loss(rows, norm_rows):
        totals = StepTotals.of(batch.completion_mask[norm_rows], cfg.rollout.max_new_tokens)
        logp, _ = numerator.logprobs(model, rows, cfg.rollout.temperature)
        return rows_loss(logp, rows, batch.completion_mask[rows], old_logp, ref_logp, adv, cfg.algo, totals, is_weight)[0]

    return loss


def update_policy(state: RLState, batch: TokenBatch, numerator, old_logp, ref_logp, advantages: AdvantageFn, cfg: StepConfig,
                  step_seed: int, is_weight: torch.Tensor | None = None, *, delta_logp: torch.Tensor | None = None,
                  delta_from_update: bool = False, sampler_fn=None) -> tuple[dict, torch.Tensor, Advantages]:
    """Epochs x minibatches optimizer steps over one rollout batch; gradients accumulate over
    micro-batches, each normalised by its minibatch's global ``StepTotals``. ``numerator`` gives the
    trainable log-probs (plain or BiCC-conditioned); ``batch`` the completion masks. Returns (metrics,
    ``first_pass_log_ratio`` [N]): each sequence's summed log pi_theta - log pi_old before any update
    (under BiCC: the log conditioning weight log w_i). ``is_weight`` [N, L]: the sampler correction
    (``bicc.method.correction``), or None. ``old_logp`` None: pi_old is the policy this update's first
    forward runs (one update per rollout, ``bicc.trainer.plan.StepPlan``), taken from that forward, detached.

    ``advantages`` maps delta's log-probs [N, L] to the step's ``Advantages`` and is called once: on
    ``delta_logp`` before the first forward, or, under ``delta_from_update`` (RCC's delta read from the update,
    ``StepPlan.delta_from_update``; one update per rollout only), on the update's own first-forward log-probs
    (detached, zeros past each output): then every micro-batch runs its forward, the advantages are computed,
    and only then the losses and backwards, the graphs held in between. ``sampler_fn`` (``StepPlan.sampler_from_update``)
    maps pi_old on q [N, L], the same first-forward log-probs, to the sampler's correction (TIS's weights or None,
    metrics), computed there too; it replaces ``is_weight``. Returns (metrics, first-pass log ratios, the
    ``Advantages`` used)."""
    deferred = delta_from_update or sampler_fn is not None
    sampler_metrics = {}
    if deferred and (cfg.train.epochs_per_rollout > 1 or cfg.train.minibatches_per_rollout > 1):
        raise ValueError("advantages from the update's own forward need one update per rollout "
                         "(train.epochs_per_rollout = train.minibatches_per_rollout = 1); set train.delta_from_update=false")
    model = state.model
    n = batch.input_ids.shape[0]
    generator = torch.Generator().manual_seed(step_seed)
    # metrics summed as they come (0-d tensors on the model's device: no host sync per micro-batch, one add each,
    # in fp32 at least), read once
    sums: dict[str, torch.Tensor | float] = {}
    counts: dict[str, int] = {}

    def add(name: str, value: torch.Tensor | float) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach() if value.dtype in (torch.float32, torch.float64) else value.detach().float()
        sums[name] = sums[name] + value if name in sums else value
        counts[name] = counts.get(name, 0) + 1

    device = batch.completion_mask.device
    first_pass = torch.zeros(n, device=device)  # written in the first epoch, where each row comes once
    timers = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # seconds, for perf/ (not synchronised on CUDA)
    scale = loss_scale(state.dist)
    loss_fn = loss_function(model, cfg.algo.loss)  # compiled where the layers are (model.compile)
    hooks = state.backward_hooks  # FSDP2's, before each backward: is it the minibatch's last?
    prefix_backward = numerator.kv  # which is then the contexts' own, on leaving them
    adv = None if deferred else advantages(delta_logp)

    def finish(rows, logp, entropy, totals, first: bool):
        """Loss and backward of one micro-batch's forward; its loss, detached (0 for a no-op forward, ``rows``
        None). ``first``: the first epoch's, whose log ratios are the first pass's."""
        start = time.perf_counter()
        if rows is None:  # no rows here, but the other ranks' forward/backward are collectives
            (logp.sum() * 0.0).backward()
            timers["backward"] += time.perf_counter() - start
            return 0.0
        at = on_device(rows, device)  # sent once, without a sync: indexing with the host's rows syncs every time
        mask = batch.completion_mask[at]
        loss, metrics, raw, old = rows_loss(logp, at, mask, old_logp, ref_logp, adv.values, cfg.algo, totals, is_weight,
                                            loss_fn)
        if first:
            first_pass[at] = ((raw - old) * mask).sum(-1).float()
        timers["forward"] += time.perf_counter() - start
        start = time.perf_counter()
        (loss * scale).backward()
        timers["backward"] += time.perf_counter() - start
        for name, value in metrics.items():
            add(name, value)
        add("train/entropy", masked_mean(entropy, mask))
        return loss.detach().double()

    model.train()
    for epoch in range(cfg.train.epochs_per_rollout):
        order = torch.randperm(n, generator=generator) if cfg.train.minibatches_per_rollout > 1 else torch.arange(n)
        for mb_rows in order.tensor_split(cfg.train.minibatches_per_rollout):
            # normalised by the whole step's counts (all micro-batches, all ranks); gradients summed over ranks
            totals = global_totals(StepTotals.of(batch.completion_mask[mb_rows], cfg.rollout.max_new_tokens), state.dist)
            state.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            start = time.perf_counter()
            with numerator.contexts_once(model, mb_rows):  # shared contexts or prompts: once per minibatch (KV reuse)
                timers["forward"] += time.perf_counter() - start
                held = []  # (rows or None, log-probs with their graph, entropies) awaiting loss and backward
                plan = micro_batches(mb_rows, numerator, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens, model,
                                     state.dist)
                for i, rows in enumerate(plan):
                    start = time.perf_counter()
                    if len(rows) == 0:
                        held.append((None, numerator.logprobs(model, mb_rows[:1] if len(mb_rows) else torch.arange(0, 1),
                                                              cfg.rollout.temperature)[0], None))
                    else:
                        held.append((rows, *numerator.logprobs(model, rows, cfg.rollout.temperature, with_entropy=True)))
                    timers["forward"] += time.perf_counter() - start
                    if not deferred:
                        hooks.before(model, i == len(plan) - 1 and not prefix_backward)
                        step_loss += finish(*held.pop(), totals, epoch == 0)
                if deferred:  # every row's first-forward log-probs are known: the advantages, then the backwards
                    dtype = next((logp.dtype for rows, logp, _ in held if rows is not None), torch.float32)
                    grid = batch.completion_mask.new_zeros(batch.completion_mask.shape, dtype=dtype)
                    # no name outlives the loop bound to a log-prob with its graph: the autograd nodes would keep
                    # tensors they hold past their backward, through the optimizer step
                    for rows, first in [(rows, logp.detach()) for rows, logp, _ in held if rows is not None]:
                        grid[on_device(rows, device)] = first
                    if sampler_fn is not None:  # the forward ran pi_old on q: the sampler's weights, read by finish()
                        is_weight, sampler_metrics = sampler_fn(grid)[:2]  # no rejection here (StepPlan)
                    adv = advantages(grid if delta_from_update else delta_logp)  # what finish() reads
                    while held:
                        hooks.before(model, len(held) == 1 and not prefix_backward)
                        step_loss += finish(*held.pop(0), totals, epoch == 0)
                hooks.before(model, True)
                start = time.perf_counter()
            timers["backward"] += time.perf_counter() - start  # the contexts' own backward, on leaving
            sync_gradients(model, state.dist)
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad))
            # the one host sync of the optimizer step: its loss and gradient norm decide whether it is taken
            step_loss, norm = torch.stack([torch.as_tensor(step_loss, dtype=torch.float64, device=grad_norm.device),
                                           grad_norm.double()]).tolist()
            step_loss = all_reduce_sum(step_loss, state.dist)
            add("train/loss", step_loss)
            add("train/grad_norm", norm)
            if not (math.isfinite(step_loss) and math.isfinite(norm)):
                # numeric guard: a NaN/inf would poison the weights and Adam's moments for good; skip the
                # step (the schedule does not advance either), count it, and let the loop stop the run
                # after train.max_nonfinite_steps in a row
                state.optimizer.zero_grad(set_to_none=True)
                state.nonfinite_skips += 1
                state.nonfinite_streak += 1
                add("train/nonfinite_skip", 1.0)
                continue
            state.nonfinite_streak = 0
            add("train/nonfinite_skip", 0.0)
            start = time.perf_counter()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)  # not held through the next rollout beside vLLM
            state.scheduler.step()
            timers["optimizer"] += time.perf_counter() - start
    names = list(sums)
    means = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device) / counts[k] for k in names])
    metrics = dict(zip(names, means.tolist())) if names else {}  # one read of every metric of the update
    metrics["train/lr"] = state.scheduler.get_last_lr()[0]
    metrics.update(sampler_metrics)
    metrics.update({f"perf/update_{name}_s": value for name, value in timers.items()})
    return metrics, first_pass.cpu(), adv
