"""Policy losses, registered by name, one signature:

    fn(logp, old_logp, ref_logp, adv, mask, cfg, totals, is_weight=None) -> (loss, metrics)

logp, old_logp, ref_logp: [B, L] per-token log-probs (ref_logp may be None when no KL is used);
adv: [B] per-sequence advantages; mask: [B, L] completion mask; cfg: the ``algo`` config;
totals: ``StepTotals`` of the whole optimizer step (the aggregation's normaliser);
is_weight: optional [B, L] detached per-token weight on the policy-gradient term (the rollout engine's
truncated importance-sampling correction, ``rollout.tis_cap``), applied before aggregation.
``loss`` is this micro-batch's share of the step's loss; ``metrics`` are floats for logging.
"""

from bicc.method.losses.agg import AGGREGATIONS, StepTotals, aggregate, masked_mean  # noqa: F401
from bicc.method.losses.kl import KL_ESTIMATORS  # noqa: F401
from bicc.registry import Registry

LOSSES: Registry = Registry("policy loss")

from bicc.method.losses import aspo, gmpo, grpo, gspo  # noqa: E402,F401  (each registers its loss)
