"""Which log-probs one RL step computes, resolved once from the config (``StepPlan``), and computing them
(``step_logprobs`` -> ``StepLogProbs``).

Every no-grad forward has to earn its place:
- pi_old is evaluated on q (the paper) or on x^c (``bicc.old_on_context``, the stabilised form; and under
  ``bicc.context_in=denominator``, the released code's form, whose update then runs on q). With one
  optimizer update per rollout (``train.epochs_per_rollout = minibatches_per_rollout = 1``) and pi_old on
  the numerator's own context, pi_old *is* the policy the update's first forward runs, so that forward
  supplies it (``old_source = "update"``) unless something needs it before the update (RCC's delta, TIS,
  the diagnostics). ``rollout.old_from_sampler`` takes pi_old on q from the rollout engine's own sampling
  log-probs instead (``"sampler"``).
- pi_ref on q is computed only when something reads it: a KL term, a ref-denominated ratio, RCC's delta,
  the diagnostics. Under ``bicc.old_on_context`` a KL term compares like with like,
  KL(pi_theta(.|x^c) || pi_ref(.|x^c)), which costs pi_ref on x^c too: against pi_ref(.|q) the k3 estimator
  grows as exp(log pi_ref(o|q) - log pi_theta(o|x^c)) and swamps the update (BiCC-Dr.GRPO collapsed).
- RCC's delta needs log pi_theta_old(o | x^c) (Algorithm 1) or (o | q) (Section 4.2) before the
  advantages. When its context is the numerator's and there is one update per rollout, the update's own
  first forward computes exactly it (``delta_from_update``, ``train.delta_from_update``): the update runs
  every micro-batch's forward, then the advantages, then the backwards, holding the minibatch's graphs in
  between. The sampler's correction (TIS's weights min(pi_old / pi_sampler, C) and the log-prob gap) waits for
  that forward the same way when it is pi_old on q (no BiCC context; ``sampler_from_update``). Else delta comes
  before the update: on q it is pi_old on q (the sampler's under
  ``rollout.old_from_sampler``, as in the ratio); on x^c under the paper's form one more no-grad forward on x^c.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from bicc.config import StepConfig, corrects, diag_every
from bicc.kernels.batching import logprobs_no_grad
from bicc.machine.distributed import Dist


def reads_reference(algo, delta: Optional[str]) -> bool:
    """pi_ref on q is read by a KL term, a ref-denominated ratio (``algo``), or RCC's delta (``delta``: its context,
    None when the step computes none)."""
    return algo.kl_coef > 0 or algo.ratio_denominator == "ref" or delta is not None


@dataclass(frozen=True)
class StepPlan:
    """conditioned:  BiCC builds contexts x^c this step (BiCC on)
    old_context:  "q" | "xc": where pi_old is evaluated
    update_context: "q" | "xc": where the trainable numerator pi_theta is evaluated (x^c under BiCC unless
                  ``bicc.context_in=denominator``)
    old_source:   "forward" (a no-grad pass) | "update" (the update's first forward) | "sampler"
    need_q:       pi_old on q is needed beside pi_old on x^c (the sampler's log-probs: their gap and TIS; delta on
                  q; diagnostics); it also gives log w
    reference:    pi_ref on q is computed
    kl_ref_xc:    the KL term's reference is pi_ref on x^c (bicc.old_on_context with a KL term)
    delta:        None | "q" | "xc": the context of RCC's delta (None: no delta this step)
    tis:          truncated importance weights against the sampler's log-probs
    diagnostics:  the gradient-variance diagnostic runs this step
    delta_from_update: the update's first forward supplies delta's log-probs, and the advantages are computed
                  between its forwards and its backwards (``bicc.trainer.update.update_policy``)
    sampler_from_update: the update's first forward (pi_old on q) supplies the sampler's correction: TIS's weights and
                  ``rollout/logprob_diff``, computed between its forwards and its backwards, as the deferred advantages
    """

    conditioned: bool
    old_context: str
    update_context: str
    old_source: str
    need_q: bool
    reference: bool
    kl_ref_xc: bool
    delta: Optional[str]
    tis: bool
    diagnostics: bool = False
    delta_from_update: bool = False
    sampler_from_update: bool = False

    @classmethod
    def from_config(cls, cfg: StepConfig, sampler_logprobs: bool, diagnostics: bool = False) -> "StepPlan":
        """The plan for a step; ``sampler_logprobs``: the engine returns sampling log-probs;
        ``diagnostics``: this step runs the gradient-variance diagnostic (``diag.every``)."""
        conditioned = bool(cfg.bicc.enabled)
        denominator = conditioned and cfg.bicc.context_in == "denominator"
        old_context = "xc" if conditioned and (cfg.bicc.old_on_context or denominator) else "q"
        update_context = "xc" if conditioned and not denominator else "q"
        from_sampler = bool(cfg.rollout.old_from_sampler)
        if from_sampler and old_context != "q":
            raise ValueError("rollout.old_from_sampler: the sampler's log-probs are on q, but bicc.old_on_context "
                             "(or bicc.context_in=denominator) evaluates pi_old on x^c; use bicc=on or turn "
                             "old_from_sampler off")
        if from_sampler and not sampler_logprobs:
            raise ValueError(f"rollout.old_from_sampler needs sampling log-probs from the engine "
                             f"(rollout={cfg.rollout.engine} returns none)")
        tis = sampler_logprobs and corrects(cfg.rollout) and not from_sampler  # rollout.correction
        delta = cfg.rcc.delta_context if (cfg.rcc.enabled or diagnostics) else None
        single_update = cfg.train.epochs_per_rollout == 1 and cfg.train.minibatches_per_rollout == 1
        same_context = old_context == update_context
        # delta on the numerator's own context (x^c, or q when BiCC is off), at theta_old = the update's weights; not
        # where that is q and pi_old on q is the sampler's: delta reads the same pi_old on q as the ratio does
        deferred = (cfg.train.delta_from_update and single_update and not diagnostics and delta is not None
                    and ((update_context == "xc" and delta == "xc") or (not conditioned and not from_sampler)))
        # the sampler's correction (its gap to pi_old on q, TIS's weights) from the update's first forward where that
        # forward is pi_old on q: no BiCC context, one update per rollout
        sampler_deferred = (cfg.train.delta_from_update and single_update and not diagnostics and sampler_logprobs
                            and not from_sampler and not conditioned
                            and not cfg.rollout.correction.rollout_rs)  # a rejection changes the update's normalisers
        before_update = ((delta is not None and not deferred) or diagnostics
                         or (sampler_logprobs and not sampler_deferred))  # TIS's weights and the mismatch metric
        if from_sampler:
            source = "sampler"
        elif single_update and same_context and not before_update:
            source = "update"
        else:
            source = "forward"
        # the sampler's log-probs are read against pi_old on q: the mismatch metric always, TIS's weights when on
        need_q = old_context == "xc" and (sampler_logprobs or delta == "q" or diagnostics)
        reference = reads_reference(cfg.algo, delta)
        kl_ref_xc = old_context == "xc" and update_context == "xc" and cfg.algo.kl_coef > 0
        return cls(conditioned, old_context, update_context, source, need_q, reference, kl_ref_xc, delta, tis, diagnostics,
                   delta_from_update=deferred, sampler_from_update=sampler_deferred and source == "update")

    def at_step(self, cfg: StepConfig, step: int, sampler_logprobs: bool, sharded: bool) -> "StepPlan":
        """This plan, or the diagnostics' plan on the steps ``diag.every`` picks (not under FSDP2:
        its sharded gradients are averaged over processes inside backward)."""
        every = diag_every(cfg.diag, cfg.rcc)
        if every > 0 and step % every == 0 and not sharded:
            return StepPlan.from_config(cfg, sampler_logprobs, diagnostics=True)
        return self

    @staticmethod
    def loads_reference(cfg: StepConfig) -> bool:
        """Whether the run loads the frozen initial policy: some step's plan reads pi_ref (every step's, or the
        diagnostics' steps')."""
        diagnostics = diag_every(cfg.diag, cfg.rcc) > 0
        return reads_reference(cfg.algo, cfg.rcc.delta_context if (cfg.rcc.enabled or diagnostics) else None)

    @property
    def delta_pass(self) -> bool:
        """RCC's delta needs its own no-grad forward on x^c (the paper's form, delta on x^c, not read from the
        update)."""
        return self.delta == "xc" and self.conditioned and self.old_context != "xc" and not self.delta_from_update

    def passes(self) -> list[str]:
        """The forwards a step makes, in order, for the start-up summary and the profile."""
        ctx = {"q": "q", "xc": "x^c"}
        out = []
        if self.old_source == "forward":
            out.append(f"pi_old on {ctx[self.old_context]} (no grad)")
        if self.need_q:
            out.append("pi_old on q (no grad)")
        if self.reference:
            out.append("pi_ref on q (no grad)")
        if self.kl_ref_xc:
            out.append("pi_ref on x^c for the KL term (no grad)")
        if self.delta_pass:
            out.append("pi_theta_old on x^c for RCC's delta (no grad)")
        numerator = ctx[self.update_context]
        supplies = [name for name, yes in (("pi_old", self.old_source == "update"),
                                           ("RCC's delta", self.delta_from_update),
                                           ("the sampler's weights", self.sampler_from_update)) if yes]
        out.append(f"update on {numerator} (forward + backward" + (f", supplies {' and '.join(supplies)})" if supplies else ")"))
        return out

    def no_grad_passes(self) -> int:
        return len(self.passes()) - 1


@dataclass
class StepLogProbs:
    """The per-token log-probs [N, L] a step reads (zeros past each output); None where the plan needs none.

    old:     pi_old on the plan's old context; None when the update's own first forward supplies it
    on_q:    pi_old on q (``old`` itself when pi_old is on q)
    ref:     pi_ref on q (RCC's delta, the paper's KL)
    kl_ref:  the KL term's reference: ``ref``, or pi_ref on x^c under ``bicc.old_on_context``
    delta:   log pi_theta_old(o | delta context), for RCC's delta and the diagnostics; None when the update's
             forward supplies it (``StepPlan.delta_from_update``)
    log_w:   [N] log conditioning weight per sequence when known before the update (pi_old on x^c minus on
             q); else None, and the update's first pass measures it
    """

    old: Optional[torch.Tensor]
    on_q: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    kl_ref: Optional[torch.Tensor]
    delta: Optional[torch.Tensor]
    log_w: Optional[torch.Tensor]


def step_logprobs(plan: StepPlan, model, ref_model, plain, on_xc, sampled: Optional[torch.Tensor], cfg: StepConfig,
                  mask: torch.Tensor, d: Dist = Dist()) -> StepLogProbs:
    """The plan's no-grad passes. ``plain``/``on_xc``: the rows on q and on x^c (q itself with BiCC off)
    (``bicc.kernels.rows``); ``sampled`` [N, L]: the engine's sampling log-probs on the grid (or None);
    ``mask`` [N, L]: the completion mask."""
    T, n = cfg.rollout.temperature, mask.shape[0]

    def run(m, inputs):
        return logprobs_no_grad(m, inputs, n, cfg.train.micro_batch_size, T, d, cfg.train.micro_batch_tokens)

    context = on_xc if plan.old_context == "xc" else plain
    old = {"forward": lambda: run(model, context), "sampler": lambda: sampled, "update": lambda: None}[plan.old_source]()
    on_q = old if plan.old_context == "q" else (run(model, plain) if plan.need_q else None)
    ref = run(ref_model, plain) if plan.reference and ref_model is not None else None
    kl_ref = run(ref_model, on_xc) if plan.kl_ref_xc and ref_model is not None else ref
    if plan.delta is None or plan.delta_from_update:
        delta = None
    elif plan.delta == "q":
        delta = on_q
    else:  # on x^c: pi_old itself when it is on x^c (or there is no context), else its own pass
        delta = run(model, on_xc) if plan.delta_pass else (old if plan.old_context == "xc" or not plan.conditioned else None)
    log_w = None
    if plan.old_context == "xc" and on_q is not None and old is not None:
        log_w = ((old - on_q) * mask).sum(-1).cpu()
    return StepLogProbs(old, on_q, ref, kl_ref, delta, log_w)
