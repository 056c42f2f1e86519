"""SAPO (bicc/method/losses/sapo.py): the gate's value and slope by hand, verl's formula written out token by token on
seeded cases (value and gradient), and its parameters refused where they are out of range."""

import math

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.conftest import compose_cfg
from tests.losses.helpers import VARIANTS, random_case

SAPO = VARIANTS["sapo"]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_gate_by_hand():
    """Seq 0 (A = +1, tau 1.0) has log-ratios [0, 0.5], seq 1 (A = -2, tau 1.05) [0]; seq-mean-token-mean.
    The gate f(rho) = (4/tau) sigmoid(tau (rho - 1)): at rho = 1 its value is 2/tau and its slope 1, so the token's
    gradient is -A rho f' / (T_i S) = -A / (T_i S). At rho = e^0.5 its slope is 4 s (1 - s), s = sigmoid(e^0.5 - 1)."""
    logp = torch.tensor([[0.0, 0.5], [0.0, 7.0]], dtype=torch.float64, requires_grad=True)
    old, adv = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.float64)
    loss, _ = LOSSES.get("sapo")(logp, old, None, adv, mask, SAPO, StepTotals.of(mask, 2))
    r = math.exp(0.5)
    s = sigmoid(r - 1)
    seq0 = -(2.0 + 4 * s) / 2  # -A f per token, mean over 2 tokens (tau 1)
    seq1 = 2.0 * (2 / 1.05)  # -A f = 2 * 2/1.05
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1 / 4, -r * 4 * s * (1 - s) / 4], [2.0 / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)


def verl_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    """verl's SAPO, token by token: rho = exp(clamp(log rho, -20, 20)), tau = tau_pos if A > 0 else tau_neg,
    term -(4/tau) sigmoid(tau (rho - 1)) A, seq-mean-token-mean."""
    total = 0.0
    for i in range(logp.shape[0]):
        tau = tau_pos if adv[i] > 0 else tau_neg
        terms = [-(4 / tau) * torch.sigmoid(tau * (torch.exp((logp[i, t] - old[i, t]).clamp(-20, 20)) - 1)) * adv[i]
                 for t in range(logp.shape[1]) if mask[i, t]]
        total = total + torch.stack(terms).mean()
    return total / logp.shape[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_equals_verls_formula(seed, taus):
    logp, old, _, adv, mask = random_case(seed, scale=1.0)
    adv[0] = 0.0  # a zero advantage: its term is 0 whichever tau it takes
    cfg = type(SAPO)(**{**SAPO.__dict__, "params": {"tau_pos": taus[0], "tau_neg": taus[1]}})
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = LOSSES.get("sapo")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    want = verl_sapo(theirs, old, adv, mask, *taus)
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("override", ["algo.params.tau_pos=0", "algo.params.tau_neg=-1", "+algo.params.tau=1"])
def test_sapo_parameters_out_of_range_are_refused(override):
    from bicc.trainer.validation import validate

    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ValueError, match=f"config field '{key}'"):
        validate(compose_cfg(["algo=sapo", override, "sft.cache_dir=/tmp/x"]))
