import math

import pytest
import torch

from bicc.method.losses import AGGREGATIONS, LOSSES, StepTotals
from tests.losses.helpers import cfg

Cfg = cfg()


def hand_case():
    # seq 0: A = +1, log-ratios [0.3, 0, -0.3], all 3 tokens real
    # seq 1: A = -1, log-ratios [0.3, -0.3, 5.0], last token is padding
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, 0.0, -0.3], [0.3, -0.3, 5.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return logp, old, adv, mask


def test_grpo_hand_computed_value_and_gradient():
    logp, old, adv, mask = hand_case()
    totals = StepTotals.of(mask, max_len=3)
    loss, metrics = LOSSES.get("grpo")(logp, old, None, adv, mask, Cfg, totals)
    # seq 0 (A=+1): rho = [e^0.3=1.34986, 1, e^-0.3=0.74082]
    #   min(rho, clip(rho, 0.8, 1.2)) = [1.2, 1.0, 0.74082] -> token mean 2.94082/3 = 0.98027
    # seq 1 (A=-1): -max(rho, clip(rho)) over 2 real tokens = [-1.34986, -0.8] -> mean -1.07493
    # objective = (0.98027 - 1.07493)/2 = -0.04733 ; loss = +0.04733
    seq0 = (1.2 + 1.0 + math.exp(-0.3)) / 3
    seq1 = -(math.exp(0.3) + 0.8) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, abs=1e-9)
    assert loss.item() == pytest.approx(0.04733, abs=1e-5)
    # gradient d loss / d logp = -A rho / (T_i * S) on unclipped tokens, 0 on clipped or padded ones:
    #   seq 0: [0 (clipped at 1.2), -1/6, -0.74082/6]; seq 1: [1.34986/4, 0 (clipped at 0.8), 0 (pad)]
    loss.backward()
    expected = torch.tensor([[0.0, -1 / 6, -math.exp(-0.3) / 6], [math.exp(0.3) / 4, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    # clip fractions: high = 1 of 5 real tokens (seq 0 token 0), low = 1 of 5 (seq 1 token 1)
    assert metrics["train/clip_frac_high"] == pytest.approx(0.2)
    assert metrics["train/clip_frac_low"] == pytest.approx(0.2)
    # the largest ratio over real tokens: e^0.3 (the padded token's e^5 is not one of them)
    assert metrics["train/ratio_max"] == pytest.approx(math.exp(0.3))
    # approx KL = mean of log_ratio^2 / 2 over the 5 real tokens = (4 x 0.09) / 2 / 5 = 0.036; the ratio's mean
    # (e^0.3 + 1 + e^-0.3 + e^0.3 + e^-0.3) / 5 = (2.69972 + 1 + 1.48164) / 5 = 1.03627
    assert metrics["train/approx_kl_old"] == pytest.approx(0.036, abs=1e-12)
    assert metrics["train/ratio_mean"] == pytest.approx((1 + 2 * math.exp(0.3) + 2 * math.exp(-0.3)) / 5, abs=1e-12)
    assert metrics["train/ratio_mean"] == pytest.approx(1.03627, abs=1e-5)


def test_zero_advantage_gives_zero_loss_and_gradient():
    logp, old, _, mask = hand_case()
    loss, _ = LOSSES.get("grpo")(logp, old, None, torch.zeros(2, dtype=torch.float64), mask, Cfg, StepTotals.of(mask, 3))
    loss.backward()
    assert loss.item() == 0 and torch.all(logp.grad == 0)


def test_kl_term_k3_hand_computed():
    KLCfg = cfg(kl_coef=0.5)

    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    # pg term is 0 (A = 0). k3 with log r = ref - logp = [-0.5, 0]: e^-0.5 - 1 + 0.5 = 0.10653, 0
    # token mean over the sequence = 0.053265; times beta 0.5 = 0.026633
    loss, metrics = LOSSES.get("grpo")(logp, logp.clone(), ref, torch.zeros(1, dtype=torch.float64), mask, KLCfg,
                                       StepTotals.of(mask, 2))
    assert loss.item() == pytest.approx(0.5 * (math.exp(-0.5) - 0.5) / 2, abs=1e-9)
    assert metrics["train/kl_ref"] == pytest.approx((math.exp(-0.5) - 0.5) / 2, abs=1e-9)


@pytest.mark.parametrize("estimator,per_token", [
    ("k1", [0.5, -0.25]),  # -log r = logp - ref
    ("k2", [0.125, 0.03125]),  # (log r)^2 / 2: 0.25 / 2, 0.0625 / 2
    ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(0.25) - 1 - 0.25]),  # r - 1 - log r
])
def test_kl_estimators_hand_computed(estimator, per_token):
    """log r = ref - logp = [-0.5, 0.25]; A = 0, so the loss is beta x the token mean of the estimator."""
    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.5, -0.75]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, metrics = LOSSES.get("grpo")(logp, logp.clone(), ref, torch.zeros(1, dtype=torch.float64), mask,
                                       cfg(kl_coef=0.5, kl_estimator=estimator), StepTotals.of(mask, 2))
    assert metrics["train/kl_ref"] == pytest.approx(sum(per_token) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(0.5 * sum(per_token) / 2, abs=1e-12)


@pytest.mark.parametrize("agg,expected", [
    ("token-mean", (1.8 + 0.6) / 5),  # over the 5 real tokens
    ("token-sum", 1.8 + 0.6),  # verl's token-sum: the step's sum, no normaliser (its dp_size factor: one process)
    ("seq-mean-token-mean", (1.8 / 3 + 0.6 / 2) / 2),  # each sequence's mean, then over the 2 sequences
    ("seq-mean-token-sum", (1.8 + 0.6) / 2),  # each sequence's sum, over the 2 sequences
    ("seq-mean-token-sum-norm", (1.8 + 0.6) / (2 * 4)),  # Dr.GRPO: over sequences x max_len 4, not the width 3
])
def test_kl_term_is_aggregated_like_the_policy_loss(agg, expected):
    """k1 per token = logp - ref = [0.3, 0.6, 0.9] and [0.2, 0.4] (a pad after); A = 0, beta 1: the loss is the KL
    aggregated by algo.loss_agg, over the step's totals (max_len 4)."""
    logp = torch.zeros(2, 3, dtype=torch.float64)
    ref = -torch.tensor([[0.3, 0.6, 0.9], [0.2, 0.4, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    loss, metrics = LOSSES.get("grpo")(logp, logp.clone(), ref, torch.zeros(2, dtype=torch.float64), mask,
                                       cfg(kl_coef=1.0, kl_estimator="k1", loss_agg=agg), StepTotals.of(mask, 4))
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["train/kl_ref"] == pytest.approx(2.4 / 5, abs=1e-12)  # logged as the token mean


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
def test_gradient_matches_finite_differences(agg):
    AggCfg = cfg(loss_agg=agg, kl_coef=0.1)

    gen = torch.Generator().manual_seed(1)
    logp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(True)
    old = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3
    ref = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    totals = StepTotals.of(mask, max_len=5)
    fn = lambda x: LOSSES.get("grpo")(x, old, ref, adv, mask, AggCfg, totals)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_micro_batch_split_gives_same_gradient(agg, splits):
    AggCfg = cfg(loss_agg=agg, kl_coef=0.05)

    gen = torch.Generator().manual_seed(2)
    n, length = 8, 6
    logp = (torch.randn(n, length, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(True)
    old = torch.randn(n, length, generator=gen, dtype=torch.float64) * 0.3
    ref = torch.randn(n, length, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 6])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    totals = StepTotals.of(mask, max_len=length)

    full, _ = LOSSES.get("grpo")(logp, old, ref, adv, mask, AggCfg, totals)
    (full_grad,) = torch.autograd.grad(full, logp)

    total_loss, split_grad = 0.0, torch.zeros_like(logp)
    for rows in torch.arange(n).chunk(splits):
        part, _ = LOSSES.get("grpo")(logp[rows], old[rows], ref[rows], adv[rows], mask[rows], AggCfg, totals)
        (g,) = torch.autograd.grad(part, logp)
        split_grad += g
        total_loss += part.item()
    assert total_loss == pytest.approx(full.item(), abs=1e-9)
    torch.testing.assert_close(split_grad, full_grad, atol=1e-9, rtol=0)


def test_aggregation_modes_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    t = StepTotals.of(mask, max_len=3)  # 4 tokens, 2 seqs
    agg = AGGREGATIONS.get
    assert agg("token-mean")(x, mask, t).item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert agg("token-sum")(x, mask, t).item() == pytest.approx(1 + 2 + 3 + 4)  # 10: the padded 5 and 6 left out
    assert agg("seq-mean-token-mean")(x, mask, t).item() == pytest.approx((2 + 4) / 2)  # seq means 2, 4 -> 3
    assert agg("seq-mean-token-sum")(x, mask, t).item() == pytest.approx((6 + 4) / 2)  # 5
    assert agg("seq-mean-token-sum-norm")(x, mask, t).item() == pytest.approx(10 / (2 * 3))  # 1.667


def test_clip_fractions_tell_low_from_high():
    """A ratio above 1 + eps on A > 0 is clipped high, one below 1 - eps on A < 0 clipped low: here two tokens of
    six high (e^0.3 and e^0.4 > 1.2 on A = +1) and one low (e^-0.3 < 0.8 on A = -1); e^-0.3 on A = +1 and e^0.3 on
    A = -1 are inside the objective's min and count in neither."""
    logp = torch.tensor([[0.3, 0.4, -0.3], [-0.3, 0.0, 0.3]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    _, metrics = LOSSES.get("grpo")(logp, torch.zeros_like(logp), None, adv, mask, Cfg, StepTotals.of(mask, 3))
    assert metrics["train/clip_frac_high"] == pytest.approx(2 / 6) and metrics["train/clip_frac_low"] == pytest.approx(1 / 6)
