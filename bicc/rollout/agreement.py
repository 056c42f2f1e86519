"""Whether the sampler draws from the weights the trainer gave it: ``rollout/token_prob_ratio`` and its gate.

NeMo-RL's token_mult_prob_error: over the sampled tokens, the mean of exp|log pi_sampler - log pi_trainer|, the
trainer's log-probs taken at the weights that sampled (the version the batch carries), so that a rollout worker's
staleness (``rollout.async_steps``) does not count: numerics and faults do. 1 is agreement. In the synchronous
step those weights are the step's own, and pi_old on q is the trainer's side at no cost; under rollout workers the
trainer keeps a host copy of the parameters of each version a worker may still draw with (``WeightVersions``)
and scores the batch with them, one no-grad pass (every ``train.sampler_check_every`` steps; the copies are of
the versions those steps read). Nothing is measured where the sampler gives no log-probs (HF generate on the
training module itself: no push, one set of weights), where its log-probs stand for pi_old
(``rollout.old_from_sampler``), or for a batch drawn before a resume (its version's weights are not kept).

What it exists for: a weight push that did not reach the sampler, weights pushed or read in another dtype, a
prompt's KV cached under older weights served again, a sampler kernel computing something else. Above
``train.max_sampler_mismatch`` (``mismatch_limit``) a step warns (once); ``train.sampler_mismatch_steps`` such steps in a row stop
the run with a checkpoint (``SamplerGate``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from bicc.config import StepConfig, corrects
from bicc.config.correction import Correction
from bicc.kernels.batching import logprobs_no_grad
from bicc.machine.distributed import reshard
from bicc.method.correction import apply
from bicc.method.losses.tis import sampler_grid, sampler_logprob_diff

CAUSES = ("a weight push that did not reach the sampler (its version advanced, its weights did not); weights "
          "pushed or read in another dtype than model.dtype; a prefix cache not reset after a push, serving a "
          "prompt's KV from older weights; a sampler kernel or quantisation computing another distribution")


def mismatch_limit(limit: float | None, dtype: str) -> float:
    """``train.max_sampler_mismatch``, null resolved by ``model.dtype``: 1.01 in float32 (healthy: 1.0000001 on
    CPU, HF workers and vLLM alike), 1.1 in 16-bit (1.001 on CPU in bfloat16; NeMo-RL's gate on GPU)."""
    if limit is not None:
        return float(limit)
    return 1.01 if dtype == "float32" else 1.1


def token_prob_ratio(sampler_logprobs: list[list[float]], trainer_logp: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean over the completion tokens with a sampler log-prob of exp|log pi_sampler - log pi_trainer|
    (``trainer_logp`` [N, L] at the weights that sampled; ``mask`` [N, L]); None without such tokens."""
    trainer_logp, mask = trainer_logp.detach().cpu().double(), mask.cpu()
    sampled, valid = sampler_grid(sampler_logprobs, trainer_logp, mask)
    if not valid.any():
        return None
    return (sampled - trainer_logp).abs()[valid].exp().mean().item()


def local(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (its shard under FSDP2)."""
    return p.to_local() if hasattr(p, "to_local") else p


def kept_versions(async_steps: int, every: int) -> int:
    """Host copies ``WeightVersions`` holds at most: one for each checked step among the ``async_steps + 1`` whose
    batches are drawn or being drawn (a copy is made at the push of the version a checked step reads and dropped
    once that step has read it); 0 when no step is checked."""
    return 0 if not every else -(-(async_steps + 1) // every)


def check_every(every: int | None, async_steps: int) -> int:
    """``train.sampler_check_every``, null resolved: every step where the check is free (no rollout workers: the
    step's own pi_old on q is the trainer's side), every ``async_steps + 1`` under workers, so that at most one host
    copy of the policy's shard is held (``kept_versions``)."""
    if every is not None:
        return every
    return async_steps + 1 if async_steps else 1


class WeightVersions:
    """Host copies of the policy's parameters at the weight versions a rollout worker may still draw a checked
    batch with (this process's shards under FSDP2, in the master dtype), each dropped once its batch is read: those
    that train (``trained``), as the others never change (under ``model.lora``, the adapters alone)."""

    def __init__(self):
        self.kept: dict[int, list[torch.Tensor]] = {}

    def keep(self, model, version: int) -> None:
        reshard(model)  # the shards, not parameters a forward left gathered (dist.reshard_after_forward=false)
        with torch.no_grad():
            self.kept[version] = [local(p).detach().to("cpu", copy=True) for p in trained(model)]

    def forget(self, version: int, still_read: bool = False) -> None:
        """Drop the copies of ``version`` (unless ``still_read``: a later checked step reads it too) and older."""
        for v in [v for v in self.kept if v < version or (v == version and not still_read)]:
            del self.kept[v]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for copy in self.kept.values() for t in copy)

    @contextmanager
    def at(self, model, version: int):
        """``model`` holds version ``version``'s parameters inside, its own again after. The two are swapped in
        place, one tensor at a time (no second host copy); the parameters a forward inside leaves gathered are
        freed on the way out, so that no later forward computes with them."""
        reshard(model)
        params, kept = [local(p) for p in trained(model)], self.kept[version]
        swap(params, kept)
        try:
            yield model
        finally:
            reshard(model)
            swap(params, kept)


def trained(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def swap(params: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """Exchange each parameter's values with its host copy's, holding one tensor's values beside them at a time."""
    for p, h in zip(params, host):
        if p.shape != h.shape:
            raise RuntimeError(f"a kept weight version has a parameter of shape {tuple(h.shape)} where the model's "
                               f"is {tuple(p.shape)}: the model is not in the layout the version was kept in")
        mine = p.detach().to("cpu", copy=True)
        p.copy_(h)
        h.copy_(mine)


class SamplerGate:
    """``train.max_sampler_mismatch`` over ``rollout/token_prob_ratio``: a warning the first time a step is above
    it, and a stop after ``train.sampler_mismatch_steps`` measured steps in a row above it."""

    def __init__(self, limit: float, steps: int):
        self.limit, self.steps = limit, steps
        self.streak, self.warned = 0, False

    def check(self, ratio: float | None, step: int) -> str | None:
        """The step's ratio (None: not measured, the streak stands). Returns the message to stop the run with."""
        if ratio is None or not self.limit:
            return None
        if ratio <= self.limit:
            self.streak = 0
            return None
        self.streak += 1
        what = (f"step {step}: rollout/token_prob_ratio = {ratio:.4g} > train.max_sampler_mismatch = {self.limit:g}: "
                f"the sampler's log-probs are not the trainer's at the weights that sampled")
        if self.streak >= self.steps:
            return (f"[rollout] {what}, {self.streak} measured steps in a row (train.sampler_mismatch_steps = "
                    f"{self.steps}). Likely causes: {CAUSES}.")
        if not self.warned:
            self.warned = True
            print(f"[rollout] warning: {what}. Likely causes: {CAUSES}. The run stops after "
                  f"train.sampler_mismatch_steps = {self.steps} such steps in a row.", flush=True)
        return None


def sampler_correction(ro, plan, on_q, batch, rollout, fresh: bool, step_sum=None):
    """The sampler against the trainer, both on q (``on_q`` [N, L]: pi_old on q): ``rollout/logprob_diff``,
    ``rollout/token_prob_ratio`` where ``fresh`` (these weights drew the batch) and, under ``rollout.correction``, the
    importance weights pi_old / pi_sampler and the rejection of tokens far from the sampler (bicc/method/correction.py).
    Returns (weights [N, L] or None, metrics, the mask the update trains [N, L] or None: the batch's); nothing when the
    engine gave no log-probs or they stand for pi_old."""
    if ro.out.logprobs is None or plan.old_source == "sampler" or on_q is None:
        return None, {}, None
    mask, q, device = batch.completion_mask.cpu(), on_q.cpu(), on_q.device
    metrics = {"rollout/logprob_diff": sampler_logprob_diff(ro.out.logprobs, q, mask)}
    ratio = token_prob_ratio(ro.out.logprobs, q, mask) if fresh else None
    if ratio is not None:
        metrics["rollout/token_prob_ratio"] = ratio
    if not corrects(rollout):
        return None, metrics, None
    spec = Correction.of(rollout)
    sampled, valid = sampler_grid(ro.out.logprobs, q, mask)
    weight, kept, corr_metrics = apply(torch.where(valid, q - sampled, torch.zeros_like(q)), mask, spec, step_sum)
    metrics.update(corr_metrics)
    return (None if weight is None else weight.to(device)), metrics, (kept.to(device) if spec.criteria else None)


def read_at(step: int, every: int | None, async_steps: int) -> bool:
    """Whether ``step`` measures ``rollout/token_prob_ratio`` (``train.sampler_check_every``, null resolved)."""
    every = check_every(every, async_steps)
    return bool(every) and step % every == 0


def agreement_checked(s, train, ro, plan, async_steps: int = 0) -> bool:
    """Whether this step measures ``rollout/token_prob_ratio`` (``bicc.rollout.agreement``); under rollout workers,
    the first step keeps the weights the workers started from where a later step reads them (its own batch is drawn
    by the weights it trains: measured at no cost)."""
    if s.workers is not None and s.versions is None:
        s.versions = WeightVersions()
        if any(read_at(t, train.sampler_check_every, async_steps) for t in range(s.step + 1, s.step + async_steps + 1)):
            s.versions.keep(s.model, s.step)
    return read_at(s.step, train.sampler_check_every, async_steps) and ro.out.logprobs is not None \
        and plan.old_source != "sampler"


def agreement_at_version(s, cfg: StepConfig, ro, plain, batch) -> dict:
    """``rollout/token_prob_ratio`` of a batch drawn by an older weight version, scored by the trainer at that
    version's kept parameters (one no-grad pass on q); {} for a version not kept (drawn before a resume)."""
    if s.versions is None or ro.version not in s.versions.kept:
        return {}
    with s.versions.at(s.model, ro.version):
        then = logprobs_no_grad(s.model, plain, len(ro.out.completion_ids), cfg.train.micro_batch_size,
                                cfg.rollout.temperature, s.ranks, cfg.train.micro_batch_tokens)
    N = cfg.rollout.async_steps  # the version the workers started from is read by the N steps after this one too
    s.versions.forget(ro.version, any(read_at(t, cfg.train.sampler_check_every, N)
                                      for t in range(s.step + 1, ro.version + N + 1)))
    ratio = token_prob_ratio(ro.out.logprobs, then, batch.completion_mask)
    return {} if ratio is None else {"rollout/token_prob_ratio": ratio}
