"""KL-Cov (bicc/method/losses/kl_cov.py): a hand-computed case, and verl's selection and formula written out token by
token on seeded cases, value and gradient."""

import math

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.losses.helpers import VARIANTS, random_case

KL_COV = VARIANTS["kl_cov"]


def test_kl_cov_penalises_the_token_of_largest_covariance():
    """A = [+2, -2]; log pi = [[1.0, 0.2], [-0.2, -0.2]], log pi_old = log pi - 0.1 (rho = e^0.1, no clip).
    cov = A * (log pi - 0.2) = [[1.6, 0], [0.8, 0.8]]: k = max(floor(2e-3 * 4), 1) = 1, token (0, 0) takes
    1.0 * |0.1|. Token-mean over 4: gradient -A rho / 4, plus 1.0 * sign(0.1) / 4 on the penalised token."""
    logp = torch.tensor([[1.0, 0.2], [-0.2, -0.2]], dtype=torch.float64, requires_grad=True)
    old, adv = logp.detach() - 0.1, torch.tensor([2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, metrics = LOSSES.get("kl_cov")(logp, old, None, adv, mask, KL_COV, StepTotals.of(mask, 2))
    r = math.exp(0.1)
    assert loss.item() == pytest.approx((-2 * r + 0.1 - 2 * r + 2 * r + 2 * r) / 4, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[(-2 * r + 1) / 4, -2 * r / 4], [2 * r / 4, 2 * r / 4]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    assert metrics["train/cov_penalised_frac"].item() == pytest.approx(1 / 4)


def verl_kl_cov(logp, old, adv, mask, ratio, coef):
    """verl's KL-Cov, token by token: the unclipped term -A rho; cov over the masked tokens; the k of largest cov take
    coef * |log rho| more; token-mean."""
    rows, cols = logp.shape
    real = [(i, t) for i in range(rows) for t in range(cols) if mask[i, t]]
    mean_a = sum(float(adv[i]) for i, _ in real) / len(real)
    mean_logp = sum(float(logp[i, t]) for i, t in real) / len(real)
    cov = {(i, t): (float(adv[i]) - mean_a) * (float(logp[i, t]) - mean_logp) for i, t in real}
    top = set(sorted(real, key=lambda it: -cov[it])[: max(int(len(real) * ratio), 1)])
    total = 0.0
    for i, t in real:
        log_rho = logp[i, t] - old[i, t]
        total = total - adv[i] * torch.exp(log_rho) + (coef * log_rho.abs() if (i, t) in top else 0.0)
    return total / len(real)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("params", [(2e-3, 1.0), (0.2, 0.5)])
def test_kl_cov_equals_verls_selection_and_formula(seed, params):
    logp, old, _, adv, mask = random_case(seed)
    cfg = type(KL_COV)(**{**KL_COV.__dict__, "params": {"kl_cov_ratio": params[0], "ppo_kl_coef": params[1]}})
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = LOSSES.get("kl_cov")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    want = verl_kl_cov(theirs, old, adv, mask, *params)
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
