"""Reward-confidence correction (paper eq. 17, Algorithm 1 lines 9-11) and its diagnostics."""

import pytest
import torch

from bicc.config import StepConfig, TinyArchConfig
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import ContextRows, Packing, QueryRows
from bicc.method.advantages import ADVANTAGES, sequence_delta
from bicc.method.conditioning import build_contexts
from bicc.method.diagnostics import GradientMoments, delta_by_reward, gradient_variance
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch
from bicc.trainer.plan import StepPlan, step_logprobs
from tests.conftest import compose_cfg
from tests.helpers import BiccCfg, rows_setup


class Cfg:
    adv_eps = 1e-6


def algorithm1_loop(rewards, groups, delta):
    """Lines 9-11 of the paper's Algorithm 1, one group at a time, in plain Python floats."""
    out = [0.0] * len(rewards)
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        G = len(idx)
        r_bar = sum(rewards[i] for i in idx) / G
        d_bar = sum(delta[i] for i in idx) / G
        cov = sum((rewards[i] - r_bar) * (delta[i] - d_bar) for i in idx) / G
        for i in idx:
            out[i] = rewards[i] - r_bar - 2 * cov
    return out


def test_rcc_matches_loop_on_random_interleaved_groups():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        n = 48
        rewards = torch.randint(0, 2, (n,), generator=gen).float()
        groups = torch.randperm(n, generator=gen) % 6  # interleaved groups of 8
        delta = torch.randn(n, generator=gen) * 20
        adv, metrics = ADVANTAGES.get("rcc")(rewards, groups, delta, Cfg)
        expected = torch.tensor(algorithm1_loop(rewards.tolist(), groups.tolist(), delta.tolist()))
        torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    assert "rcc/cov" in metrics


def test_rcc_hand_computed():
    # r = [1, 1, 0, 0], delta = [2, 0, 0, -2]: R_bar = 0.5, delta_bar = 0,
    # Cov = ((0.5)(2) + (0.5)(0) + (-0.5)(0) + (-0.5)(-2)) / 4 = 0.5 -> A = r - 0.5 - 1
    adv, m = ADVANTAGES.get("rcc")(torch.tensor([1.0, 1, 0, 0]), torch.zeros(4, dtype=torch.long),
                                   torch.tensor([2.0, 0, 0, -2]), Cfg)
    torch.testing.assert_close(adv, torch.tensor([-0.5, -0.5, -1.5, -1.5]))
    assert m["rcc/cov"] == pytest.approx(0.5)


def test_zero_covariance_gives_mean_centred_advantages():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: delta equal on both reward classes; group 1: a constant shift. Both uncorrelated with r.
    delta = torch.tensor([3.0, 3.0, -1.0, -1.0, 7.0, 7.0, 7.0, 7.0])
    adv, m = ADVANTAGES.get("rcc")(rewards, groups, delta, Cfg)
    centred, _ = ADVANTAGES.get("mean_centered")(rewards, groups, None, Cfg)
    torch.testing.assert_close(adv, centred)
    assert m["rcc/cov"] == 0.0


def test_rcc_requires_delta():
    with pytest.raises(ValueError, match="needs delta"):
        ADVANTAGES.get("rcc")(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), None, Cfg)
    with pytest.raises(ValueError, match="shape"):
        ADVANTAGES.get("rcc")(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.zeros(3), Cfg)


def test_sequence_delta_sum_and_mean():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(sequence_delta(logp, ref, mask, "sum"), torch.tensor([-0.5, 1.5]))
    torch.testing.assert_close(sequence_delta(logp, ref, mask, "mean"), torch.tensor([-0.25, 0.5]))
    m = delta_by_reward(torch.tensor([1.0, 3.0, -2.0]), torch.tensor([1.0, 1.0, 0.0]))
    assert m == {"rcc/delta_pos": 2.0, "rcc/delta_neg": -2.0, "rcc/delta_sep": 4.0}


def test_delta_uses_conditioned_numerator_and_unconditioned_reference():
    policy, tok, prompts, completions, batch = rows_setup()
    # a reference that differs from the policy: same architecture, other init
    ref, _ = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=1)
    ref.eval()
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    texts = ["Compute 1+1."] * 2 + ["Compute 22+1."] * 2
    ctx = build_contexts(texts, completions, correct, torch.tensor([0, 0, 1, 1]), tok, BiccCfg(min_attempt_tokens=4),
                         64, prompts)
    numerator = ContextRows(ctx, completions, batch.completion_len, Packing(),
                            tok.pad_token_id, "cpu")
    plain = QueryRows(batch)
    # the paper: delta on x^c, from its own no-grad pass
    cfg = compose_cfg(["bicc=on", "rcc=on", "rcc.delta_context=xc", "train.micro_batch_size=2"])
    models, on = {"model": policy, "ref": ref}, {"q": plain, "xc": numerator}
    lp = step_logprobs(StepPlan.from_config(StepConfig.of(cfg), False), models, on, None, batch.completion_mask, cfg)
    delta = sequence_delta(lp["model", "xc"], lp["ref", "q"], batch.completion_mask)
    # by hand: each output scored alone after its conditioned prompt (policy) and after q (reference)
    for i, completion in enumerate(completions):
        cond = make_token_batch([ctx.prompt_ids[i]], [completion], tok.pad_token_id)
        on_q = make_token_batch([prompts[i]], [completion], tok.pad_token_id)
        a = logprobs_no_grad(policy, QueryRows(cond), 1, 1, 1.0).sum()
        b = logprobs_no_grad(ref, QueryRows(on_q), 1, 1, 1.0).sum()
        assert delta[i].item() == pytest.approx((a - b).item(), abs=1e-4)
    # the plain numerator gives delta on q instead, which differs
    cfg.rcc.delta_context = "q"
    lp_q = step_logprobs(StepPlan.from_config(StepConfig.of(cfg), False), models, on, None, batch.completion_mask, cfg)
    delta_q = sequence_delta(lp_q["model", "q"], lp_q["ref", "q"], batch.completion_mask)
    assert (delta_q - delta).abs().max() > 1e-3


def test_gradient_moments_known_value():
    # g_1 = (1, 0), g_2 = (3, 0), g_3 = (2, 3): mean (2, 1), |mean|^2 = 5;
    # squared distances: 1 + 1 = 2, 1 + 1 = 2, 0 + 4 = 4 -> mean 8/3 -> V = 8/15
    moments = GradientMoments()
    for g in ([1.0, 0.0], [3.0, 0.0], [2.0, 3.0]):
        moments.add([torch.tensor(g[:1]), torch.tensor(g[1:])])  # two "parameters"
    assert moments.relative_variance() == pytest.approx(8 / 15)
    single = GradientMoments()
    single.add([torch.ones(2)])
    with pytest.raises(ValueError, match=">= 2 estimates"):
        single.relative_variance()


def test_gradient_variance_on_a_synthetic_linear_problem():
    # loss over a set S = sum_{i in S} c_i . theta / |S|, so the gradient of split k is the mean of its
    # c_i. Four groups of two rows; with 4 splits each split is one group: g_k = mean of that group's c.
    theta = torch.nn.Linear(2, 1, bias=False)
    c = torch.tensor([[1.0, 0], [1, 0], [3, 0], [3, 0], [2, 2], [2, 4], [2, 0], [2, 0]])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])

    def loss_of_rows(rows, norm_rows):
        return (c[rows] @ theta.weight.T).sum() / len(norm_rows)

    v = gradient_variance(theta, loss_of_rows, groups, 4, torch.Generator().manual_seed(0), micro_batch_size=1)
    g = torch.tensor([[1.0, 0], [3, 0], [2, 3], [2, 0]])
    expected = ((g - g.mean(0)) ** 2).sum(1).mean() / (g.mean(0) ** 2).sum()
    assert v == pytest.approx(expected.item())
    assert theta.weight.grad is None  # cleared: the update that follows is unchanged
    # identical groups have no variance
    same = torch.tensor([[1.0, 2.0]]).repeat(8, 1)
    v0 = gradient_variance(theta, lambda rows, norm: (same[rows] @ theta.weight.T).sum() / len(norm), groups, 2,
                           torch.Generator().manual_seed(0), micro_batch_size=3)
    assert v0 == pytest.approx(0.0, abs=1e-12)
