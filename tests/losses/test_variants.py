"""Hand-computed cases for each variant, gradients against finite differences, and micro-batch splits."""

import math

import pytest
import torch

from bicc.method.losses import AGGREGATIONS, LOSSES, StepTotals
from tests.losses.helpers import LOSS_OF, VARIANTS, cfg, random_case, split_invariant

E = math.exp


def two_seq_case(row0, row1):
    """Seq 0 (A=+1) has 3 tokens, seq 1 (A=-1) has 2 real tokens and a pad; old log-probs are 0."""
    logp = torch.tensor([row0, [*row1, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return logp, old, adv, mask


def loss_and_grad(name, algo_cfg, logp, old, ref, adv, mask, max_len=3):
    loss, metrics = LOSSES.get(name)(logp, old, ref, adv, mask, algo_cfg, StepTotals.of(mask, max_len))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def test_dapo_clip_higher_token_mean():
    logp, old, adv, mask = two_seq_case([0.3, 0.0, -0.3], [0.3, -0.3])
    loss, grad, _ = loss_and_grad("grpo", cfg(clip_eps_high=0.28, loss_agg="token-mean"), logp, old, None, adv, mask)
    # seq 0 (A=+1): min(rho, 1.28) = [min(1.34986, 1.28)=1.28, 1, 0.74082]
    # seq 1 (A=-1): -max(rho, 0.8) = [-1.34986, -0.8]
    # token-mean over all 5 tokens: (1.28 + 1 + 0.74082 - 1.34986 - 0.8)/5 = 0.174192 ; loss = -0.174192
    assert loss == pytest.approx(-(1.28 + 1 + E(-0.3) - E(0.3) - 0.8) / 5, abs=1e-12)
    # grad = -A rho / 5 on unclipped tokens: [0, -1/5, -0.74082/5], [1.34986/5, 0, 0]
    expected = torch.tensor([[0, -1 / 5, -E(-0.3) / 5], [E(0.3) / 5, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_dr_grpo_sum_norm_with_ref_denominator():
    logp, _, adv, mask = two_seq_case([0.3, 0.0, -0.3], [0.3, -0.3])
    old = torch.full((2, 3), 5.0, dtype=torch.float64)  # ignored: the ratio is taken against ref
    ref = torch.zeros(2, 3, dtype=torch.float64)
    loss, grad, _ = loss_and_grad("grpo", cfg(loss_agg="seq-mean-token-sum-norm", ratio_denominator="ref"),
                                  logp, old, ref, adv, mask)
    # same clipped terms as GRPO: [1.2, 1, 0.74082] and [-1.34986, -0.8]; summed and divided by S*L_max = 2*3
    assert loss == pytest.approx(-(1.2 + 1 + E(-0.3) - E(0.3) - 0.8) / 6, abs=1e-12)
    expected = torch.tensor([[0, -1 / 6, -E(-0.3) / 6], [E(0.3) / 6, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="ratio_denominator=ref"):
        LOSSES.get("grpo")(logp, old, None, adv, mask, cfg(ratio_denominator="ref"), StepTotals.of(mask, 3))


def test_dual_clip_caps_negative_advantage_loss():
    logp, old, adv, mask = two_seq_case([0.0, 0.0, 0.0], [1.5, 0.0])
    loss, grad, _ = loss_and_grad("grpo", cfg(dual_clip_c=3.0), logp, old, None, adv, mask)
    # seq 0: ratio 1 everywhere -> objective 1 ; seq 1 token 0: rho = e^1.5 = 4.4817 > c=3 -> term capped at
    # -c*|A| = -3 (no gradient) ; token 1: -1. seq 1 mean = -2 ; objective (1 - 2)/2 = -0.5 ; loss 0.5
    assert loss == pytest.approx(0.5, abs=1e-12)
    assert grad[1, 0] == 0 and grad[1, 1] == pytest.approx(1 / 4)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gmpo"])
def test_dual_clip_leaves_positive_advantages_alone(name):
    """Dual clip caps the loss of A < 0 tokens at -c A; on A > 0 the same cap, min(-A rho, -c A), would replace
    every term with ratio below c by the constant -c A. With every sample at A = +1 and ratios near 1, the loss
    and gradient must be those without dual clip (about -1, not -3, and a gradient that is not zero)."""
    logp, old, _, mask = two_seq_case([0.1, -0.1, 0.05], [0.0, 0.1])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    plain = loss_and_grad(name, cfg(), logp, old, None, adv, mask)
    capped = loss_and_grad(name, cfg(dual_clip_c=3.0), logp, old, None, adv, mask)
    assert plain[0] == pytest.approx(capped[0], abs=1e-12) and -1.2 < plain[0] < -0.9
    torch.testing.assert_close(plain[1], capped[1], atol=1e-12, rtol=0)
    assert plain[1].abs().sum() > 0.1


def test_gspo_sequence_ratio_clip():
    logp, old, adv, mask = two_seq_case([0.001, 0.001, 0.001], [0.0001, 0.0003])
    loss, grad, _ = loss_and_grad("gspo", cfg(clip_eps_low=3e-4, clip_eps_high=4e-4), logp, old, None, adv, mask)
    # seq 0 (A=+1): s = exp(mean 0.001) = 1.0010005 > 1.0004 -> clipped to 1.0004, no gradient
    # seq 1 (A=-1): s = exp(mean 0.0002) = 1.00020002, inside (0.9997, 1.0004) -> -1.00020002
    # loss = -(1.0004 - 1.00020002)/2 = -0.00009999
    s1 = E(0.0002)
    assert loss == pytest.approx(-(1.0004 - s1) / 2, abs=1e-12)
    # grad: seq 1 tokens get -A * s / T_i / S = s/4 each (the token form's gradient)
    expected = torch.tensor([[0, 0, 0], [s1 / 4, s1 / 4, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_gspo_token_form_gradient_equals_sequence_form():
    logp, old, _, adv, mask = random_case(3, scale=1e-4)
    logp.requires_grad_(True)
    c = cfg(clip_eps_low=3e-4, clip_eps_high=4e-4)
    loss, grad, _ = loss_and_grad("gspo", c, logp, old, None, adv, mask, max_len=6)
    # sequence form: mean_i max(-A s_i, -A clip(s_i)) with s_i = exp(mean_t (logp - old))
    x = logp.detach().clone().requires_grad_(True)
    s = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    (seq_grad,) = torch.autograd.grad(seq_loss, x)
    assert loss == pytest.approx(seq_loss.item(), abs=1e-12)
    torch.testing.assert_close(grad, seq_grad, atol=1e-12, rtol=0)


def test_gmpo_sign_aware_log_clip():
    logp, old, adv, mask = two_seq_case([0.5, 0.0, -0.3], [0.5, -0.6])
    loss, grad, _ = loss_and_grad("gmpo", cfg(clip_eps_low=0.4, clip_eps_high=0.4), logp, old, None, adv, mask)
    # seq 0 (A=+1): log-ratios clipped from above only: [0.4, 0, -0.3] -> mean 0.1/3 -> ratio e^0.0333 = 1.033895
    # seq 1 (A=-1): clipped from below only: [0.5, -0.4] -> mean 0.05 -> ratio e^0.05 = 1.051271
    # loss = mean_i -A_i ratio_i = (-1.033895 + 1.051271)/2 = 0.008688
    r0, r1 = E(0.1 / 3), E(0.05)
    assert loss == pytest.approx((-r0 + r1) / 2, abs=1e-12)
    # grad on unclipped tokens: -A ratio / T_i / S: seq 0 -> [0, -r0/6, -r0/6]; seq 1 -> [r1/4, 0, 0]
    expected = torch.tensor([[0, -r0 / 6, -r0 / 6], [r1 / 4, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def test_aspo_flipped_weights_and_soft_dual_clip():
    logp, old, adv, mask = two_seq_case([0.3, 0.0, -0.3], [1.2, -0.3])
    c = cfg(clip_eps_high=0.28, loss_agg="token-mean", dual_clip_c=3.0)
    loss, grad, metrics = loss_and_grad("aspo", c, logp, old, None, adv, mask)
    # seq 0 (A=+1): r_p = min(rho, 1.28) = [1.28, 1, 0.74082]; values -1/r_p = [-0.78125, -1, -1.349859]
    #   gradients -1/r_p on unclipped tokens: [0 (clipped), -1, -1.349859]
    # seq 1 (A=-1): rho = [e^1.2 = 3.3201, e^-0.3 = 0.7408]; token 0 weight 3.32 > c = 3 -> soft dual clip:
    #   value -A * 3 * logp = 3.6, gradient 3 ; token 1: -A max(rho, 0.8) = 0.8, clipped, gradient 0
    # token-mean over 5 tokens: (-0.78125 - 1 - 1.349859 + 3.6 + 0.8)/5 = 0.253778
    assert loss == pytest.approx((-1 / 1.28 - 1 - E(0.3) + 3.6 + 0.8) / 5, abs=1e-12)
    expected = torch.tensor([[0, -1 / 5, -E(0.3) / 5], [3 / 5, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    assert metrics["train/dual_clip_frac"] == pytest.approx(1 / 5)


def test_aspo_gradient_matches_closed_form():
    # ASPO's surrogate is built so that its gradient is NOT the derivative of its value (value -A/r_p,
    # gradient -A (1/r_p) grad log pi), so finite differences do not apply; compare with the closed form.
    logp, old, _, adv, mask = random_case(13, scale=0.8)
    logp.requires_grad_(True)
    c = VARIANTS["aspo"]
    loss, grad, _ = loss_and_grad("aspo", c, logp, old, None, adv, mask, max_len=6)
    rho = (logp - old).detach().exp()
    a = adv[:, None].expand_as(rho)
    coef = torch.where(a > 0, torch.where(rho > 1.28, 0.0, -a / rho), torch.where(rho < 0.8, 0.0, -a * rho))
    weight = torch.where(a > 0, 1 / rho.clamp(max=1.28), rho)
    coef = torch.where(weight > 3.0, -a * 3.0, coef)
    expected = coef * mask / mask.sum()
    assert (weight * mask > 3).any() and ((rho > 1.28) & (a > 0)).any()  # the case exercises both branches
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


def declared(variant: str, attribute: str) -> bool:
    return getattr(LOSSES.get(LOSS_OF[variant]), attribute, False)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not declared(v, "stop_gradient")])
def test_gradient_matches_finite_differences(variant):
    logp, old, ref, adv, mask = random_case(11)
    # GSPO's clip band is 7e-4 wide: keep its ratios near 1 so both clipped and unclipped sequences occur
    scale = 1e-3 if variant == "gspo" else 1.0
    logp, old = logp * scale, old * scale
    c = VARIANTS[variant]
    logp.requires_grad_(True)
    fn = lambda x: LOSSES.get(LOSS_OF[variant])(x, old, ref, adv, mask, c, StepTotals.of(mask, 6))[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,), eps=1e-7 if variant == "gspo" else 1e-6, atol=1e-5)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if split_invariant(v)])
@pytest.mark.parametrize("agg", AGGREGATIONS.names())
@pytest.mark.parametrize("splits", [2, 4])
def test_micro_batch_split_gives_same_gradient(variant, agg, splits):
    logp, old, ref, adv, mask = random_case(5)
    c = VARIANTS[variant]
    c = type(c)(**{**c.__dict__, "loss_agg": agg, "kl_coef": 0.05})
    totals = StepTotals.of(mask, max_len=6)
    fn = LOSSES.get(LOSS_OF[variant])
    x = logp.clone().requires_grad_(True)
    full, _ = fn(x, old, ref, adv, mask, c, totals)
    (full_grad,) = torch.autograd.grad(full, x)
    parts, split_grad = 0.0, torch.zeros_like(x)
    for rows in torch.arange(len(adv)).chunk(splits):
        part, _ = fn(x[rows], old[rows], ref[rows], adv[rows], mask[rows], c, totals)
        (g,) = torch.autograd.grad(part, x)
        split_grad += g
        parts += part.item()
    assert parts == pytest.approx(full.item(), abs=1e-9)
    torch.testing.assert_close(split_grad, full_grad, atol=1e-9, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_advantage_zero_policy_gradient(variant):
    logp, old, _, _, mask = random_case(7)
    logp.requires_grad_(True)
    c = type(VARIANTS[variant])(**{**VARIANTS[variant].__dict__, "kl_coef": 0.0})
    off = getattr(LOSSES.get(LOSS_OF[variant]), "penalty_off", None)  # a penalty that is no policy-gradient term
    if off:  # (KL-Cov's on its top tokens, DRO's on the log-ratio) declared with the params that turn it off
        c = type(c)(**{**c.__dict__, "params": {**c.params, **off}})
    loss, _ = LOSSES.get(LOSS_OF[variant])(logp, old, None, torch.zeros(8, dtype=torch.float64), mask, c,
                                            StepTotals.of(mask, 6))
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0 and torch.all(grad == 0)


def gmpo_loop_reference(logp, old, adv, mask, eps_low, eps_high):
    """GMPO per sequence, written out: for A > 0 each token's log-ratio is capped above at +eps_high
    (min(rho, e^eps_high)), for A < 0 floored below at -eps_low (max(rho, e^-eps_low)); the sequence term is
    -A * exp(mean of the clipped log-ratios); mean over sequences."""
    total = 0.0
    for i in range(logp.shape[0]):
        clipped = []
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            d = logp[i, t] - old[i, t]
            clipped.append(torch.minimum(d, torch.tensor(eps_high, dtype=d.dtype)) if adv[i] > 0
                           else torch.maximum(d, torch.tensor(-eps_low, dtype=d.dtype)))
        total = total - adv[i] * torch.exp(torch.stack(clipped).mean())
    return total / logp.shape[0]


def test_gmpo_asymmetric_bounds_against_a_loop():
    """With eps_low = 0.1, eps_high = 0.5, a token at log-ratio -0.3 on A < 0 lies below the floor -0.1:
    its gradient is 0 (the high bound used as the floor gave 0.74)."""
    logp, old, adv, mask = two_seq_case([0.3, 0.6, -0.3], [-0.3, 0.2])
    algo = cfg(clip_eps_low=0.1, clip_eps_high=0.5, loss_agg="seq-mean-token-mean")
    loss, grad, _ = loss_and_grad("gmpo", algo, logp, old, None, adv, mask)
    ref = gmpo_loop_reference(logp, old, adv, mask, 0.1, 0.5)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert loss == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    assert grad[1, 0].item() == 0.0 and grad[0, 1].item() == 0.0  # floored (A < 0) and capped (A > 0) tokens
    assert grad[1, 1].item() != 0.0 and grad[0, 0].item() != 0.0
