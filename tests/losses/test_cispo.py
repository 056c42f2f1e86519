"""CISPO (bicc/method/losses/cispo.py): a hand-computed case, and verl's formula written out token by token on seeded
cases, value and gradient."""

import math

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.losses.helpers import VARIANTS, random_case

CISPO = VARIANTS["cispo"]


def test_cispo_keeps_the_gradient_of_a_token_outside_the_band():
    """Seq 0 (A = +1) has log-ratios [0.3, 0, -0.3], seq 1 (A = -1) [0.3, -0.3] and a pad; old = 0, token-mean over
    5 tokens. Weights min(rho, 1.2) (no floor): [1.2, 1, e^-0.3] and [1.2, e^-0.3]. Each token's gradient is
    -w A / 5: the token at rho = e^0.3 > 1.2, which PPO's clip drops, keeps -1.2/5."""
    logp = torch.tensor([[0.3, 0.0, -0.3], [0.3, -0.3, 9.0]], dtype=torch.float64, requires_grad=True)
    old, adv = torch.zeros(2, 3, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    loss, metrics = LOSSES.get("cispo")(logp, old, None, adv, mask, CISPO, StepTotals.of(mask, 3))
    w = math.exp(-0.3)
    # value: sum of -w A logp / 5 = (-1.2*0.3 - 0 + w*0.3 + 1.2*0.3 - w*0.3) / 5 = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.2 / 5, -1 / 5, -w / 5], [1.2 / 5, w / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    assert metrics["train/clip_frac_high"] == pytest.approx(1 / 5)  # the band's reading, as PPO's


def verl_cispo(logp, old, adv, mask, eps_low, eps_high):
    """verl's CISPO, token by token: w = clip(exp(clamp(log rho, -20, 20)), 1 - eps_low, 1 + eps_high) detached,
    term -w A log pi, token-mean."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                w = min(max(math.exp(min(max(float(logp[i, t] - old[i, t]), -20.0), 20.0)), 1 - eps_low), 1 + eps_high)
                total = total - w * adv[i] * logp[i, t]
                count += 1
    return total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps", [(10.0, 0.2), (0.2, 0.28)])
def test_cispo_equals_verls_formula(seed, eps):
    logp, old, _, adv, mask = random_case(seed)
    cfg = type(CISPO)(**{**CISPO.__dict__, "clip_eps_low": eps[0], "clip_eps_high": eps[1]})
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = LOSSES.get("cispo")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    want = verl_cispo(theirs, old, adv, mask, *eps)
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
