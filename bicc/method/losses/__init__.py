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
from bicc.registry import LOSSES, import_folder


def rows_loss(logp, rows, mask, old_logp, ref_logp, adv, algo, totals, is_weight=None, loss_fn=None):
    """The loss on ``rows`` (one micro-batch; ``mask`` [n, L]) from their log-probs ``logp`` [n, L] with their
    graph, normalised by ``totals``: (differentiable loss, its metrics). ``old_logp`` None: pi_old is
    this forward, detached (``StepPlan.old_source`` "update"). ``loss_fn``: the registered ``algo.loss`` or its
    compiled form; None: the registered one. Each [N, ...] tensor is indexed on its own device."""
    pick = lambda x: None if x is None else x[rows if rows.device == x.device else rows.to(x.device)]  # noqa: E731
    old = logp.detach() if old_logp is None else pick(old_logp)
    loss, metrics = (loss_fn or LOSSES.get(algo.loss))(logp, old, pick(ref_logp), pick(adv), mask, algo, totals,
                                                      is_weight=pick(is_weight))
    return loss, metrics


import_folder(__name__, __path__)  # every module of this folder registers its entries
