"""DPPO (bicc/method/losses/dppo.py): the trust region by hand for each bound, verl's dppo_tv and dppo_kl written out
token by token on seeded cases (value and gradient), and its parameters refused where they are out of range."""

import math

import pytest
import torch

from bicc.method.losses import LOSSES, StepTotals
from tests.conftest import compose_cfg
from tests.losses.helpers import VARIANTS, random_case


def with_params(variant: str, **params):
    base = VARIANTS[variant]
    return type(base)(**{**base.__dict__, "params": {**dict(base.params), **params}})


def test_dppo_tv_masks_a_token_that_moved_past_the_bound_on_its_side():
    """Two tokens of one A = +1 sequence, p_old = 0.5 each: p = 0.6 (+0.1, inside 0.2) keeps its term, p = 0.8 (+0.3)
    is masked; a token of an A = -1 sequence falling 0.5 -> 0.2 (-0.3) is masked, 0.5 -> 0.45 kept. token-mean over 4
    tokens, weight = rho (under the cap): the kept terms are -1 * (0.6/0.5) * log 0.6 and +1 * (0.45/0.5) * log 0.45."""
    logp = torch.log(torch.tensor([[0.6, 0.8], [0.2, 0.45]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.full((2, 2), 0.5, dtype=torch.float64))
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    loss, metrics = LOSSES.get("dppo_tv")(logp, old, None, adv, mask, VARIANTS["dppo_tv"], StepTotals.of(mask, 2))
    expected = (-1.2 * math.log(0.6) + 0.9 * math.log(0.45)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert float(metrics["train/dppo_masked_frac"]) == 0.5
    loss.backward()  # d/dlogp of -A w logp, w detached: -A w / 4 on kept tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 / 4, 0.0], [0.0, 0.9 / 4]], dtype=torch.float64))


def test_dppo_kl_keeps_a_token_moving_against_its_advantage_whatever_its_kl():
    """A = +1, p_old 0.5 -> p 0.05: its binary KL is large (1.20), but it fell, so it is kept (p <= p_old); the same
    move under A = -1 is masked. Bernoulli KL(0.5 || 0.05) = 0.5 log(0.5/0.05) + 0.5 log(0.5/0.95)."""
    kl = 0.5 * math.log(10) + 0.5 * math.log(0.5 / 0.95)
    assert kl > 0.2
    logp = torch.log(torch.tensor([[0.05], [0.05]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.full((2, 1), 0.5, dtype=torch.float64))
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 1, dtype=torch.float64)
    loss, metrics = LOSSES.get("dppo_kl")(logp, old, None, adv, mask, VARIANTS["dppo_kl"], StepTotals.of(mask, 1))
    assert loss.item() == pytest.approx(-1 * 0.1 * math.log(0.05) / 2, abs=1e-12)
    assert float(metrics["train/dppo_masked_frac"]) == 0.5


def verl_dppo(logp, old, adv, mask, low, high, cap, bound):
    """verl's dppo_tv / dppo_kl, token by token: rho = exp(clamp(log rho, -20, 20)), w = min(rho, cap) detached,
    p = exp(logp), p_old = exp(old); the token's term -A w log p where it is inside the bound for its advantage's
    sign, 0 elsewhere; token-mean over the masked tokens."""
    terms = []
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            log_rho = min(max(float(logp[i, t].detach() - old[i, t]), -20.0), 20.0)
            w = min(math.exp(log_rho), cap)
            p, p_old = math.exp(float(logp[i, t].detach())), math.exp(float(old[i, t]))
            if bound == "tv":
                inside = p - p_old <= high if adv[i] > 0 else p - p_old >= -low
            else:
                kl = p_old * (math.log(p_old) - math.log(p)) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
                inside = (kl <= high or p <= p_old) if adv[i] > 0 else (kl <= low or p >= p_old)
            terms.append(-adv[i] * w * logp[i, t] * float(inside))
    return torch.stack(terms).sum() / mask.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bound", ["tv", "kl"])
@pytest.mark.parametrize("params", [(0.2, 0.2, 20.0), (0.05, 0.1, 1.5)])
def test_dppo_equals_verls_formula(seed, bound, params):
    logp, old, _, adv, mask = random_case(seed, scale=1.0)
    logp, old = -logp.abs() - 0.05, -old.abs() - 0.05  # log-probs below 0: probabilities
    adv[0] = 0.0  # A = 0 takes the negative side's bound, as verl's torch.where(A > 0, ...)
    cfg = with_params(f"dppo_{bound}", divergence_low=params[0], divergence_high=params[1], truncation=params[2])
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, metrics = LOSSES.get(f"dppo_{bound}")(ours, old, None, adv, mask, cfg, StepTotals.of(mask, 6))
    want = verl_dppo(theirs, old, adv, mask, *params, bound)
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
    assert 0 < float(metrics["train/dppo_masked_frac"]) < 1  # the case reaches both sides of the bound


@pytest.mark.parametrize("override", ["algo.params.divergence_low=0", "algo.params.divergence_high=-1",
                                      "algo.params.truncation=0", "+algo.params.clip=1"])
def test_dppo_parameters_out_of_range_are_refused(override):
    from bicc.trainer.validation import validate

    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ValueError, match=f"config field '{key}'"):
        validate(compose_cfg(["algo=dppo_tv", override, "sft.cache_dir=/tmp/x"]))
