"""Which no-grad passes one RL step makes, resolved once from the config (``StepPlan``), and running them
(``step_logprobs``).

Every no-grad forward has to earn its place:
- pi_old is evaluated on q (the paper) or on x^c (``bicc.old_on_context``, the stabilised form; and under
  ``bicc.context_in=denominator``, the released code's form, whose update then runs on q). With one optimizer
  update per rollout and pi_old on the numerator's own context, pi_old *is* the policy the update's first forward
  runs, so that forward supplies it (``old_source = "update"``) unless the advantages or the loss need it before:
  RCC's delta, the diagnostics, the sampler's weights or rejection. The sampler's log-prob gap alone is a metric,
  read after the update from its first forward. ``rollout.old_from_sampler`` takes pi_old on q from the engine's own
  sampling log-probs (``"sampler"``).
- pi_ref on q is computed only when something reads it: a KL term, a ref-denominated ratio, RCC's delta. Under
  ``bicc.old_on_context`` a KL term compares like with like, KL(pi_theta(.|x^c) || pi_ref(.|x^c)), which costs
  pi_ref on x^c too: against pi_ref(.|q) the k3 estimator grows as exp(log pi_ref(o|q) - log pi_theta(o|x^c)) and
  swamps the update (BiCC-Dr.GRPO collapsed).
- RCC's delta, for an estimator that reads it (``StepConfig.reads``), reads log pi_theta_old(o | q) (Section 4.2:
  pi_old on q, the sampler's under ``rollout.old_from_sampler``, as in the ratio) or (o | x^c) (Algorithm 1,
  ``rcc.delta_context=xc``: one more pass on x^c in the paper's form).
Passes that read the same policy on the same rows are one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from bicc.config import StepConfig, corrects, diag_every
from bicc.kernels.batching import logprobs_no_grad
from bicc.machine.ranks import Ranks
from bicc.method.losses.tis import sampler_grid
from bicc.model.lora import module_of

NAMES = {"q": "q", "xc": "x^c"}


@dataclass(frozen=True)
class StepPlan:
    """old_context:    "q" | "xc": where pi_old is evaluated
    update_context: "q" | "xc": where the trainable numerator pi_theta is evaluated (x^c under BiCC unless
                    ``bicc.context_in=denominator``)
    old_source:     "forward" (a no-grad pass) | "update" (the update's first forward, detached) | "sampler"
    delta:          None | "q" | "xc": the context of RCC's delta (None: no delta this step)
    ref_context:    None | "q" | "xc": where the loss reads pi_ref (a KL term, a ref-denominated ratio; None: not)
    passes:         the no-grad passes, in order: (policy "model" | "ref", context "q" | "xc")
    """

    old_context: str
    update_context: str
    old_source: str
    delta: Optional[str]
    ref_context: Optional[str]
    passes: tuple

    @classmethod
    def from_config(cls, cfg: StepConfig, sampler_logprobs: bool, diagnostics: bool = False) -> "StepPlan":
        """The plan for a step; ``sampler_logprobs``: the engine returns sampling log-probs; ``diagnostics``: this
        step runs the gradient-variance diagnostic (``diag.every``), which reads delta."""
        conditioned = bool(cfg.bicc.enabled)
        denominator = conditioned and cfg.bicc.context_in == "denominator"
        old = "xc" if conditioned and (cfg.bicc.old_on_context or denominator) else "q"
        update = "xc" if conditioned and not denominator else "q"
        from_sampler = bool(cfg.rollout.old_from_sampler)
        if from_sampler and old != "q":
            raise ValueError("rollout.old_from_sampler: the sampler's log-probs are on q, but bicc.old_on_context "
                             "(or bicc.context_in=denominator) evaluates pi_old on x^c; use bicc=on or turn "
                             "old_from_sampler off")
        if from_sampler and not sampler_logprobs:
            raise ValueError(f"rollout.old_from_sampler needs sampling log-probs from the engine "
                             f"(rollout={cfg.rollout.engine} returns none)")
        delta = (cfg.rcc.delta_context if conditioned else "q") if "delta" in cfg.reads or diagnostics else None
        weighted = sampler_logprobs and corrects(cfg.rollout) and not from_sampler  # weights or rejection, pre-loss
        single = cfg.train.epochs_per_rollout == 1 and cfg.train.minibatches_per_rollout == 1
        source = "sampler" if from_sampler else \
            "update" if single and old == update and delta is None and not weighted else "forward"
        ref = ("xc" if old == update == "xc" and cfg.algo.kl_coef > 0 else "q") if reads_reference(cfg.algo) else None
        passes = [("model", old)] if source == "forward" else []
        if old == "xc" and (sampler_logprobs or delta == "q" or diagnostics):  # beside pi_old on x^c: log w, the gap
            passes.append(("model", "q"))
        if delta is not None:  # delta_i reads log pi_ref(o_i | q)
            passes.append(("ref", "q"))
        passes += [("ref", ref), ("model", delta)]  # delta on q under old_from_sampler reads the sampler's
        passes = [p for p in passes if p[1] is not None and not (source == "sampler" and p == ("model", "q"))]
        return cls(old, update, source, delta, ref, tuple(dict.fromkeys(passes)))

    def describe(self) -> list[str]:
        """The forwards a step makes, in order, for the start-up summary and the profile."""
        out = [f"{'pi_old' if policy == 'model' else 'pi_ref'} on {NAMES[ctx]} (no grad)" for policy, ctx in self.passes]
        supplies = ", supplies pi_old" if self.old_source == "update" else ""
        return out + [f"update on {NAMES[self.update_context]} (forward + backward{supplies})"]


def diagnoses(cfg: StepConfig, step: int, sharded: bool) -> bool:
    """Whether ``step`` runs the gradient-variance diagnostic (``diag.every``; not under FSDP2: its sharded gradients
    are averaged over processes inside backward)."""
    every = diag_every(cfg.diag, cfg.rcc)
    return every > 0 and step % every == 0 and not sharded


def reads_reference(algo) -> bool:
    """Whether the loss reads pi_ref: a KL term or a ref-denominated ratio."""
    return algo.kl_coef > 0 or algo.ratio_denominator == "ref"


def loads_reference(cfg: StepConfig) -> bool:
    """Whether the run loads the frozen initial policy: some step's plan reads pi_ref (every step's, or the
    diagnostics' steps')."""
    return reads_reference(cfg.algo) or "delta" in cfg.reads or diag_every(cfg.diag, cfg.rcc) > 0


def step_logprobs(plan: StepPlan, models: dict, rows: dict, sampled, mask, cfg: StepConfig, ranks: Ranks = Ranks()) -> dict:
    """The plan's no-grad passes: {(policy, context): log-probs [N, L]}, zeros past each output. ``models``: "model"
    and "ref" (None: not loaded); ``rows``: the rows on "q" and "xc" (``bicc.kernels.rows``; q's with BiCC off);
    ``sampled``: the engine's per-output sampling log-probs, pi_old on q under ``rollout.old_from_sampler``; ``mask``
    [N, L]: the completion mask."""
    out = {}
    if plan.old_source == "sampler":
        grid, valid = sampler_grid(sampled, torch.zeros(mask.shape), mask.cpu())
        if not bool(valid[mask.cpu().bool()].all()):
            raise ValueError("rollout.old_from_sampler: the engine returned no log-prob for some sampled tokens")
        out["model", "q"] = grid.to(mask.device)
    for policy, ctx in plan.passes:
        if models[policy] is not None and (policy, ctx) not in out:
            with module_of(models[policy]) as module:  # pi_ref under model.lora: the policy, adapters off
                out[policy, ctx] = logprobs_no_grad(module, rows[ctx], len(rows[ctx].lengths), cfg.train.micro_batch_size,
                                                    cfg.rollout.temperature, ranks, cfg.train.micro_batch_tokens)
    return out
