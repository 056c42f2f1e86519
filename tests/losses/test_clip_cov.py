"""Clip-Cov (bicc/method/losses/clip_cov.py): a hand-computed case with one token in the covariance window, and verl's
selection and formula written out token by token on seeded cases (the same draws of torch's generator), value and
gradient."""

import math

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.losses.helpers import VARIANTS, random_case

CLIP_COV = VARIANTS["clip_cov"]


def test_clip_cov_cuts_the_one_token_in_its_window():
    """A = [+2, -2]; log pi = [[1.0, 0.2], [-0.2, -0.2]] (= log pi_old: ratio 1, nothing clipped). Token means:
    A 0, log pi 0.2. cov = A * (log pi - 0.2) = [[1.6, 0], [0.8, 0.8]]: only token (0, 0) lies in (1, 5), and
    n = max(floor(2e-4 * 4), 1) = 1 cuts it. Token-mean over 4: the others keep -A rho / 4 = -A / 4."""
    logp = torch.tensor([[1.0, 0.2], [-0.2, -0.2]], dtype=torch.float64, requires_grad=True)
    old, adv = logp.detach().clone(), torch.tensor([2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, metrics = LOSSES.get("clip_cov")(logp, old, None, adv, mask, CLIP_COV, StepTotals.of(mask, 2))
    assert loss.item() == pytest.approx((0 - 2 + 2 + 2) / 4, abs=1e-12)  # -A rho per kept token
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5], [0.5, 0.5]], dtype=torch.float64), atol=1e-12, rtol=0)
    assert metrics["train/cov_cut_frac"].item() == pytest.approx(1 / 4)


def verl_clip_cov(logp, old, adv, mask, eps, ratio, lb, ub):
    """verl's Clip-Cov, token by token: PPO's terms; cov over the masked tokens (token means of A and log pi); of the
    tokens not clipped with lb < cov < ub, in row-major order, the first n of one ``torch.randperm`` are cut (term
    times 0); token-mean."""
    rows, cols = logp.shape
    real = [(i, t) for i in range(rows) for t in range(cols) if mask[i, t]]
    mean_a = sum(float(adv[i]) for i, _ in real) / len(real)
    mean_logp = sum(float(logp[i, t]) for i, t in real) / len(real)
    terms, candidates = {}, []
    for i, t in real:
        rho = torch.exp(logp[i, t] - old[i, t])
        unclipped, clipped = -adv[i] * rho, -adv[i] * rho.clamp(1 - eps, 1 + eps)
        terms[i, t] = torch.maximum(unclipped, clipped)
        cov = (float(adv[i]) - mean_a) * (float(logp[i, t]) - mean_logp)
        if lb < cov < ub and not clipped > unclipped:
            candidates.append((i, t))
    if candidates:
        n = max(int(ratio * len(real)), 1)
        for k in torch.randperm(len(candidates))[:n].tolist():
            terms[candidates[k]] = terms[candidates[k]] * 0
    return sum(terms.values()) / len(real)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clip_cov_equals_verls_selection_and_formula(seed):
    logp, old, _, adv, mask = random_case(seed, n=8, length=6, scale=1.5)
    adv = adv * 3  # covariances in the window (1, 5)
    cfg = type(CLIP_COV)(**{**CLIP_COV.__dict__, "params": {**CLIP_COV.params, "clip_cov_ratio": 0.1}})
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    torch.manual_seed(seed)
    loss, metrics = LOSSES.get("clip_cov")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    torch.manual_seed(seed)
    want = verl_clip_cov(theirs, old, adv, mask, 0.2, 0.1, 1.0, 5.0)
    loss.backward()
    want.backward()
    cut = metrics["train/cov_cut_frac"].item() * mask.sum().item()
    assert cut == pytest.approx(max(int(0.1 * mask.sum().item()), 1))  # the window held enough tokens to cut n
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
    assert math.isfinite(loss.item())
