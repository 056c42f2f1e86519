"""DRO (bicc/method/losses/dro.py): the penalty by hand, verl's dro written out token by token, beta refused at 0."""

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.conftest import compose_cfg
from tests.losses.helpers import VARIANTS, random_case


def test_dro_penalises_the_log_ratio_quadratically_by_hand():
    """One token, A = 1, log pi = -1, log pi_old = -1.5 (log rho = 0.5), beta 0.1: L = -(A log pi - beta/2 * 0.25)
    = 1 + 0.0125; dL/dlog pi = -(A - beta log rho) = -(1 - 0.05) = -0.95."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5]], dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    loss, _ = LOSSES.get("dro")(logp, old, None, adv, mask, VARIANTS["dro"], StepTotals.of(mask, 1))
    assert loss.item() == pytest.approx(1.0125, abs=1e-12)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-0.95, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_dro_equals_verls_formula(seed, beta):
    logp, old, _, adv, mask = random_case(seed)
    base = VARIANTS["dro"]
    cfg = type(base)(**{**base.__dict__, "params": {"beta": beta}})
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = LOSSES.get("dro")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    want = sum(-(theirs[i, t] * adv[i] - 0.5 * beta * (theirs[i, t] - old[i, t]) ** 2)
               for i in range(8) for t in range(6) if mask[i, t]) / mask.sum()
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)


def test_dro_needs_a_positive_beta():
    from bicc.trainer.validation import validate

    with pytest.raises(ValueError, match="config field 'algo.params.beta'"):
        validate(compose_cfg(["algo=dro", "algo.params.beta=0", "sft.cache_dir=/tmp/x"]))
