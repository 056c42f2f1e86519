"""Truncated importance sampling for the rollout engine's mismatch (``rollout.correction``'s token level, the
default under rollout workers): the weights by hand, and every loss weighting each token's term by them."""

import math

import pytest
import torch

from bicc.method.correction import correct
from bicc.method.losses import LOSSES, StepTotals
from bicc.method.losses.tis import sampler_grid
from tests.losses.helpers import LOSS_OF, VARIANTS, random_case


def test_weights_hand_computed():
    # trainer's pi_old per token; the engine's sampling probabilities; row 1 has 2 real tokens
    old = torch.log(torch.tensor([[0.5, 0.6, 0.1], [0.3, 0.9, 0.7]], dtype=torch.float64))
    sampler = [[math.log(0.25), math.log(0.2), math.log(0.2)], [float("nan"), math.log(0.9)]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    sampled, valid = sampler_grid(sampler, old, mask)
    w, kept, metrics = correct(torch.where(valid, old - sampled, torch.zeros_like(old)), mask, "token", "2.0", False,
                               None, None)
    # 0.5/0.25 = 2 (at the cap, not over), 0.6/0.2 = 3 -> 2, 0.1/0.2 = 0.5; NaN -> 1; 0.9/0.9 = 1; padding -> 0
    expected = torch.tensor([[2.0, 2.0, 0.5], [1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(kept, mask.double())  # no rejection asked: every token trains
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 + 2 + 0.5 + 1 + 1) / 5)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 5)  # the one over the cap


def reference_weighted_grpo(logp, old, adv, mask, w, eps=0.2):
    """Loop over sequences and tokens: mean_i mean_t w_it * max(-A rho, -A clip(rho))."""
    total = 0.0
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if mask[i, t]:
                rho = torch.exp(logp[i, t] - old[i, t])
                terms.append(w[i, t] * torch.maximum(-adv[i] * rho, -adv[i] * rho.clamp(1 - eps, 1 + eps)))
        total = total + sum(terms) / len(terms)
    return total / logp.shape[0]


def test_grpo_weighted_loss_equals_loop_reference():
    logp, old, _, adv, mask = random_case(3)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    logp_a = logp.clone().requires_grad_(True)
    logp_b = logp.clone().requires_grad_(True)
    loss, _ = LOSSES.get("grpo")(logp_a, old, None, adv, mask, VARIANTS["grpo"], StepTotals.of(mask, 6), is_weight=w)
    ref = reference_weighted_grpo(logp_b, old, adv, mask, w)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logp_a.grad, logp_b.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_unit_weights_change_nothing(variant):
    logp, old, ref, adv, mask = random_case(5)
    fn = LOSSES.get(LOSS_OF[variant])
    totals = StepTotals.of(mask, 6)
    a, _ = fn(logp, old, ref, adv, mask, VARIANTS[variant], totals)
    b, _ = fn(logp, old, ref, adv, mask, VARIANTS[variant], totals, is_weight=torch.ones_like(logp))
    assert a.item() == b.item()


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "gmpo"])
def test_token_weight_scales_each_tokens_gradient(variant):
    """Token-wise losses: d L_w / d logp_t = w_t * d L / d logp_t (the weight is detached)."""
    logp, old, ref, adv, mask = random_case(6)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2
    fn, c, totals = LOSSES.get(LOSS_OF[variant]), VARIANTS[variant], StepTotals.of(mask, 6)
    if c.kl_coef:  # the KL term is not an importance-weighted policy gradient
        c = type(c)(**{**c.__dict__, "kl_coef": 0.0})
    grads = []
    for weight in (None, w):
        x = logp.clone().requires_grad_(True)
        fn(x, old, ref, adv, mask, c, totals, is_weight=weight)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], w * grads[0], atol=1e-12, rtol=0)
    assert not torch.allclose(grads[1], grads[0])


def test_gmpo_weights_each_tokens_share_of_the_sequence_term():
    """GMPO's term is one value per sequence; under seq-mean-token-mean the weighted loss is
    mean_i mean_t(w_it) * term_i."""
    logp, old, ref, adv, mask = random_case(8)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 2
    fn, c, totals = LOSSES.get("gmpo"), VARIANTS["gmpo"], StepTotals.of(mask, 6)
    per_seq = []
    for i in range(logp.shape[0]):  # each sequence alone, unweighted, with seq-mean aggregation over 1 row
        row = slice(i, i + 1)
        term, _ = fn(logp[row], old[row], ref[row], adv[row], mask[row], c, StepTotals.of(mask[row], 6))
        per_seq.append(term.item() * (w[i] * mask[i]).sum().item() / mask[i].sum().item())
    loss, _ = fn(logp, old, ref, adv, mask, c, totals, is_weight=w)
    assert c.loss_agg == "seq-mean-token-mean" and c.kl_coef == 0
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), abs=1e-12)


def test_update_policy_applies_the_weights():
    """Two fresh, identical states: the same step with weights 2 everywhere has twice the loss (the ratio is 1
    on the first pass), and weights 0 on a row leave its advantage without effect."""
    from bicc.kernels.batching import logprobs_no_grad
    from bicc.kernels.rows import QueryRows
    from bicc.trainer.update import update_policy
    from tests.helpers import guard_setup

    adv = torch.tensor([1.0, -0.5, -0.25, 0.5])
    losses, params = {}, {}
    for name, weight in (("none", None), ("two", torch.full((4, 6), 2.0)), ("row0_off", torch.ones(4, 6))):
        state, batch, cfg = guard_setup()
        plain = QueryRows(batch)
        old = logprobs_no_grad(state.model, plain, 4, 4, 1.0)
        a = adv.clone()
        if name == "row0_off":
            weight[0] = 0.0
        metrics, _ = update_policy(state, batch, plain, old, None, a, cfg, 0, is_weight=weight)
        losses[name] = metrics["train/loss"]
        params[name] = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    assert losses["two"] == pytest.approx(2 * losses["none"], rel=1e-6) and losses["none"] != 0
    state, batch, cfg = guard_setup()  # row 0's advantage zeroed instead of its weight: the same update
    plain = QueryRows(batch)
    old = logprobs_no_grad(state.model, plain, 4, 4, 1.0)
    update_policy(state, batch, plain, old, None, torch.tensor([0.0, -0.5, -0.25, 0.5]), cfg, 0)
    for k, v in state.model.state_dict().items():
        torch.testing.assert_close(v, params["row0_off"][k], atol=1e-7, rtol=0)
    assert any(not torch.equal(params["row0_off"][k], params["none"][k]) for k in params["none"])
