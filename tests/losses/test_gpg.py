"""GPG's loss (bicc/method/losses/gpg.py): -A log pi by hand, and verl's gpg written out token by token."""

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.losses.helpers import VARIANTS, random_case


def test_gpg_is_the_plain_policy_gradient_by_hand():
    """A = [2, -1], log pi = [[-0.5, -1], [-2, pad]], token-mean over 3 tokens: (2*0.5 + 2*1 - 1*2) / 3 = 1/3; the
    gradient is -A / 3 on each real token, whatever pi_old (here far from pi_theta: no ratio, no clip)."""
    logp = torch.tensor([[-0.5, -1.0], [-2.0, -9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.full((2, 2), -7.0, dtype=torch.float64)
    adv, mask = torch.tensor([2.0, -1.0], dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, _ = LOSSES.get("gpg")(logp, old, None, adv, mask, VARIANTS["gpg"], StepTotals.of(mask, 2))
    assert loss.item() == pytest.approx(1 / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_equals_verls_formula(seed):
    logp, old, _, adv, mask = random_case(seed)
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = LOSSES.get("gpg")(ours, old, None, adv, mask, VARIANTS["gpg"], StepTotals.of(mask, 6))
    want = sum(-adv[i] * theirs[i, t] for i in range(8) for t in range(6) if mask[i, t]) / mask.sum()  # token-mean
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
