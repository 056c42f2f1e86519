"""Policy losses, registered by name, one signature:

    fn(logp, old_logp, ref_logp, adv, mask, cfg, totals, is_weight=None) -> (loss, metrics)

logp, old_logp, ref_logp: [B, L] per-token log-probs (ref_logp may be None when no KL is used);
adv: [B] per-sequence advantages; mask: [B, L] completion mask; cfg: the ``algo`` config;
totals: ``StepTotals`` of the whole optimizer step (the aggregation's normaliser);
is_weight: optional [B, L] detached per-token weight on the policy-gradient term (the rollout engine's
importance weights, ``rollout.correction``: bicc/method/correction.py), applied before aggregation.
``loss`` is this micro-batch's share of the step's loss; ``metrics`` are floats for logging.

A variant's own hyperparameters are a dataclass given to ``LOSSES.register(name, params=...)``, set under
``algo.params`` in its conf/algo YAML and read with ``variant_params(cfg, Params)`` (``common.py``); validation refuses
a key the dataclass lacks, and runs its ``check()``. A loss that selects tokens by statistics of the batch it is
given (a micro-batch, as verl does) sets ``fn.micro_batch_statistics = True``: its step depends on how the step is
split (the split-invariance tests pass it by), and it runs eagerly where the model is compiled (data-dependent
shapes). A loss with a penalty that is no policy-gradient term declares the ``algo.params`` that turn it off
(``fn.penalty_off``: the test that a zero advantage gives no gradient sets them). A loss with detached factors whose
gradient is not its value's derivative sets ``fn.stop_gradient = True`` (the finite-difference test passes it by; its
own test holds its gradient).

Every module of this folder is imported here, so a new variant is one module (and its YAML).
"""

from bicc.method.losses.agg import AGGREGATIONS, StepTotals, aggregate, masked_mean  # noqa: F401
from bicc.method.losses.kl import KL_ESTIMATORS  # noqa: F401
from bicc.registry import Registry

LOSSES: Registry = Registry("policy loss")


def _import_all() -> None:
    """Every module of this folder, so that each registers its loss: a new variant is its module, with no import
    to add here."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all()
