"""The policy update of one RL step (``bicc.trainer.step.rl_step``'s phase 6): epochs x minibatches x micro-batches,
each micro-batch's loss normalised by its minibatch's ``StepTotals`` over every rank, gradients summed over its
micro-batches, one optimizer step per minibatch."""

from __future__ import annotations

import math
import time

import torch

from bicc.config import StepConfig
from bicc.kernels.batching import micro_batches
from bicc.kernels.compiled_loss import loss_function
from bicc.machine.distributed import full_tensor
from bicc.method.losses import StepTotals, masked_mean, rows_loss
from bicc.model.logprobs import TokenBatch, on_device
from bicc.trainer.state import RLState


def update_policy(state: RLState, batch: TokenBatch, numerator, old_logp, ref_logp, adv: torch.Tensor, cfg: StepConfig,
                  step_seed: int, is_weight: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Epochs x minibatches optimizer steps over one rollout batch. ``numerator``: the rows whose log-probs are trained
    (on q or x^c, ``bicc.kernels.rows``); ``batch``: their completion masks; ``old_logp``/``ref_logp`` [N, L]: pi_old
    (None: this update's first forward, detached) and the loss's pi_ref; ``adv`` [N]; ``is_weight`` [N, L]: the
    sampler correction or None. Returns (metrics, ``first`` [N, L]: each row's log-probs in the first epoch's forward,
    detached: the numerator at theta_old)."""
    model, ranks = state.model, state.ranks
    train, T = cfg.train, cfg.rollout.temperature
    mask = batch.completion_mask
    first = None
    sums: dict[str, torch.Tensor | float] = {}  # summed as they come, on the model's device; read once at the end
    counts: dict[str, int] = {}
    timers = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # seconds, for perf/ (not synchronised on CUDA)

    def add(name: str, value) -> None:
        value = value.detach().double() if isinstance(value, torch.Tensor) else value
        sums[name], counts[name] = sums[name] + value if name in sums else value, counts.get(name, 0) + 1

    loss_fn = loss_function(model, cfg.algo.loss)  # compiled where the layers are (model.compile)
    generator = torch.Generator().manual_seed(step_seed)
    model.train()
    for epoch in range(train.epochs_per_rollout):
        n = mask.shape[0]
        order = torch.randperm(n, generator=generator) if train.minibatches_per_rollout > 1 else torch.arange(n)
        for mb_rows in order.tensor_split(train.minibatches_per_rollout):
            totals = ranks.totals(StepTotals.of(mask[mb_rows], cfg.rollout.max_new_tokens))  # over every rank
            state.optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64, device=mask.device)
            start = time.perf_counter()
            with numerator.contexts_once(model, mb_rows):  # shared contexts or prompts: once per minibatch
                timers["forward"] += time.perf_counter() - start  # their forward, on entering
                plan = micro_batches(mb_rows, numerator, train.micro_batch_size, train.micro_batch_tokens, model, ranks)
                for i, rows in enumerate(plan):
                    # FSDP2's hooks: the last backward is this micro-batch's, or the contexts' own on leaving them
                    ranks.before_backward(model, i == len(plan) - 1 and not numerator.kv)
                    start = time.perf_counter()
                    if len(rows) == 0:  # an empty micro-batch: the other ranks' forward and backward are collectives
                        ranks.no_op(model, numerator, T)
                        continue
                    at = on_device(rows, mask.device)  # sent once, without a sync
                    logp, entropy = numerator.logprobs(model, rows, T, with_entropy=True)
                    loss, metrics = rows_loss(logp, at, mask[at], old_logp, ref_logp, adv, cfg.algo, totals,
                                                   is_weight, loss_fn)
                    if epoch == 0:
                        first = mask.new_zeros(mask.shape, dtype=logp.dtype) if first is None else first
                        first[at] = logp.detach()
                    timers["forward"] += time.perf_counter() - start
                    start = time.perf_counter()
                    (loss * ranks.loss_scale).backward()
                    timers["backward"] += time.perf_counter() - start
                    for name, value in {**metrics, "train/entropy": masked_mean(entropy, mask[at])}.items():
                        add(name, value)
                    step_loss += loss.detach()
                    del logp, entropy, loss  # no name holds a graph, or the tensors its nodes keep, past its backward
                ranks.before_backward(model, True)
                start = time.perf_counter()
            timers["backward"] += time.perf_counter() - start  # the contexts' own backward, on leaving them
            ranks.sync_gradients(model)
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad))
            # the one host sync of the optimizer step: its loss and gradient norm decide whether it is taken
            step_loss, norm = torch.stack([step_loss, grad_norm.double().to(step_loss.device)]).tolist()
            step_loss = ranks.sum_value(step_loss)
            add("train/loss", step_loss)
            add("train/grad_norm", norm)
            finite = math.isfinite(step_loss) and math.isfinite(norm)
            add("train/nonfinite_skip", float(not finite))
            state.nonfinite_streak = 0 if finite else state.nonfinite_streak + 1
            if not finite:  # a NaN/inf would poison the weights and Adam's moments for good: the step is skipped
                state.optimizer.zero_grad(set_to_none=True)  # (nor does the schedule advance); the loop stops the run
                state.nonfinite_skips += 1  # after train.max_nonfinite_steps in a row
                continue
            start = time.perf_counter()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)  # not held through the next rollout beside vLLM
            state.scheduler.step()
            timers["optimizer"] += time.perf_counter() - start
    names = list(sums)
    means = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=mask.device) / counts[k] for k in names])
    metrics = dict(zip(names, means.tolist())) if names else {}  # one read of every metric of the update
    metrics["train/lr"] = state.scheduler.get_last_lr()[0]
    metrics.update({f"perf/update_{name}_s": value for name, value in timers.items()})
    return metrics, mask.new_zeros(mask.shape, dtype=torch.float32) if first is None else first
