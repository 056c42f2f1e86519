import pytest
import torch

from bicc.method.advantages import ADVANTAGES, group_stats


class Cfg:
    adv_eps = 1e-6


def test_grpo_hand_computed():
    # group 0: r = [1, 0, 0, 1] -> mean 0.5, population std 0.5 -> A = [1, -1, -1, 1]
    # group 1: r = [1, 0, 0, 0] -> mean 0.25, std sqrt(0.1875)=0.4330 -> A = [1.7321, -0.5774 x3]
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, metrics = ADVANTAGES.get("grpo")(rewards, groups, None, Cfg)
    expected = torch.tensor([1.0, -1, -1, 1, 1.7320508, -0.5773503, -0.5773503, -0.5773503])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert metrics["train/adv_zero_group_share"] == 0.0


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_all_equal_groups_get_zero(value):
    rewards = torch.cat([torch.full((4,), value), torch.tensor([1.0, 0, 1, 0])])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for name in ("grpo", "mean_centered"):
        adv, metrics = ADVANTAGES.get(name)(rewards, groups, None, Cfg)
        assert torch.all(adv[:4] == 0)
        assert adv[4:].abs().sum() > 0
        assert metrics["train/adv_zero_group_share"] == 0.5


def test_group_of_one_rejected():
    with pytest.raises(ValueError, match=">= 2 samples"):
        ADVANTAGES.get("grpo")(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), None, Cfg)


def test_vectorised_matches_loop_with_interleaved_groups():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (60,), generator=gen).float()
    groups = torch.randperm(60, generator=gen) % 7  # 7 groups, shuffled order, uneven sizes
    adv, _ = ADVANTAGES.get("grpo")(rewards, groups, None, Cfg)
    for i in range(60):
        members = rewards[groups == groups[i]]
        ref = (rewards[i] - members.mean()) / (members.std(unbiased=False) + Cfg.adv_eps)
        assert abs(adv[i].item() - ref.item()) < 1e-5
    mean, std, counts = group_stats(rewards, groups)
    assert counts.sum().item() == sum((groups == g).sum().item() ** 2 for g in range(7))


def test_mean_centered_no_std():
    adv, _ = ADVANTAGES.get("mean_centered")(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), None, Cfg)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rcc_std_divides_the_corrected_advantage_by_the_group_std():
    # r = [1, 0, 0, 0], delta = [1, 0, 0, 0]: R_bar = 0.25, delta_bar = 0.25, Cov = mean([.75*.75, 3 x .25*.25]) = 0.1875
    # rcc: A = r - R_bar - 2 Cov = [0.375, -0.625 x3]; std r = sqrt(0.1875) = 0.4330 -> rcc_std: A / 0.4330
    rewards, groups, delta = torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 0, 0, 0])
    plain, metrics = ADVANTAGES.get("rcc")(rewards, groups, delta, Cfg)
    torch.testing.assert_close(plain, torch.tensor([0.375, -0.625, -0.625, -0.625]))
    scaled, scaled_metrics = ADVANTAGES.get("rcc_std")(rewards, groups, delta, Cfg)
    torch.testing.assert_close(scaled, torch.tensor([0.8660254, -1.4433757, -1.4433757, -1.4433757]), atol=1e-5, rtol=0)
    assert scaled_metrics["rcc/cov"] == metrics["rcc/cov"] == pytest.approx(0.1875)


def test_advantage_metrics_read_the_scale_over_mixed_groups():
    from bicc.method.advantages import advantage_metrics

    # group 0 mixed, r = [1, 0, 0, 0]: std 0.4330; group 1 all right: std 0 (no signal, left out of the std's mean);
    # group 2 mixed, r = [1, 1, 0, 0]: std 0.5 -> reward_std_mixed = (0.4330 + 0.5) / 2 = 0.4665
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    groups = torch.arange(3).repeat_interleave(4)
    adv = torch.tensor([2.0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])  # mean |A| = 4 / 12
    m = advantage_metrics(adv, rewards, groups)
    assert m["train/adv_abs_mean"] == pytest.approx(1 / 3)
    assert m["train/reward_std_mixed"] == pytest.approx((0.1875**0.5 + 0.5) / 2)
    assert advantage_metrics(adv, torch.ones(12), groups)["train/reward_std_mixed"] == 0.0


def test_advantage_name_follows_the_switches():
    from types import SimpleNamespace as NS

    from bicc.method.advantages import advantage_name

    algo, rcc = NS(advantage="grpo"), lambda enabled, scale: NS(enabled=enabled, scale=scale)  # noqa: E731
    assert [advantage_name(algo, rcc(False, "std")), advantage_name(algo, rcc(True, "none")),
            advantage_name(algo, rcc(True, "std"))] == ["grpo", "rcc", "rcc_std"]


# ---- verl's outcome estimators, each written out group by group as verl's core_algos computes it ----------------
def seeded_case(seed, groups=4, size=4, binary=True):
    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    rewards = torch.randint(0, 2, (n,), generator=gen).double() if binary else torch.randn(n, generator=gen).double()
    group_ids = torch.randperm(n, generator=gen) % groups  # interleaved, as a step's rows may be
    lengths = torch.randint(1, 40, (n,), generator=gen).double()
    return rewards, group_ids, lengths


def verl_loop(rewards, group_ids, per_group):
    """Each sample's value from ``per_group(its group's rewards as a list, its index in them)``."""
    out = torch.zeros_like(rewards)
    for g in group_ids.unique():
        rows = (group_ids == g).nonzero().flatten().tolist()
        for k, i in enumerate(rows):
            out[i] = per_group([float(rewards[j]) for j in rows], k, rows)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("binary", [True, False])
def test_rloo_equals_verls(seed, binary):
    """verl: r_i * n / (n - 1) - mean * n / (n - 1): the mean of the others as the baseline."""
    rewards, groups, _ = seeded_case(seed, binary=binary)
    adv, _ = ADVANTAGES.get("rloo")(rewards, groups, None, Cfg)
    want = verl_loop(rewards, groups, lambda r, k, rows: r[k] * len(r) / (len(r) - 1) - sum(r) / len(r) * len(r) / (len(r) - 1))
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=0)
    # by hand: group [1, 0, 0, 1]: the first's others average 1/3, so A = 2/3; a zero's others 2/3, so A = -2/3
    hand, _ = ADVANTAGES.get("rloo")(torch.tensor([1.0, 0, 0, 1]), torch.zeros(4), None, Cfg)
    torch.testing.assert_close(hand, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_equals_verls(seed):
    """verl: r_i - sum_j |o_j| r_j / sum_j |o_j| over the group."""
    rewards, groups, lengths = seeded_case(seed, binary=False)
    adv, _ = ADVANTAGES.get("opo")(rewards, groups, None, Cfg, lengths=lengths)

    def per_group(r, k, rows):
        ln = [float(lengths[j]) for j in rows]
        return r[k] - sum(a * b for a, b in zip(ln, r)) / sum(ln)

    torch.testing.assert_close(adv, verl_loop(rewards, groups, per_group), atol=1e-12, rtol=0)
    # by hand: rewards [1, 0] of 30 and 10 tokens: baseline 30/40 = 0.75, A = [0.25, -0.75]
    hand, _ = ADVANTAGES.get("opo")(torch.tensor([1.0, 0.0]), torch.zeros(2), None, Cfg, lengths=torch.tensor([30.0, 10.0]))
    torch.testing.assert_close(hand, torch.tensor([0.25, -0.75]))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("binary", [True, False])
def test_grpo_passk_equals_verls(seed, binary):
    """verl: in each group only the top reward's output gets (r_max - r_second) / (unbiased std + eps)."""
    rewards, groups, _ = seeded_case(seed, binary=binary)
    adv, _ = ADVANTAGES.get("grpo_passk")(rewards, groups, None, Cfg)
    want = torch.zeros_like(rewards)
    for g in groups.unique():
        rows = (groups == g).nonzero().flatten()
        top, at = torch.topk(rewards[rows], 2)
        want[rows[at[0]]] = (top[0] - top[1]) / (rewards[rows].std() + 1e-6)
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=0)
    # by hand: [0, 1, 0, 0]: margin 1, unbiased std sqrt(0.25) = 0.5, so A = [0, 2, 0, 0]; [1, 1, 0, 0]: a tie, 0
    hand, _ = ADVANTAGES.get("grpo_passk")(torch.tensor([0.0, 1, 0, 0, 1, 1, 0, 0]), torch.tensor([0] * 4 + [1] * 4),
                                           None, Cfg)
    torch.testing.assert_close(hand, torch.tensor([0.0, 2.0, 0, 0, 0, 0, 0, 0]), atol=1e-5, rtol=0)


def verl_whiten_over_tokens(values, lengths):
    """verl's masked_whiten over a [N, L] grid whose row i holds values[i] on its lengths[i] tokens."""
    grid = torch.zeros(len(values), int(lengths.max()), dtype=torch.float64)
    mask = torch.arange(grid.shape[1])[None, :] < lengths[:, None]
    grid[mask] = values.repeat_interleave(lengths.long())
    mean = grid[mask].mean()
    var = ((grid[mask] - mean) ** 2).mean() * mask.sum() / (mask.sum() - 1)
    return ((grid - mean) * torch.rsqrt(var + 1e-8))[:, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_equals_verls(seed):
    """verl: r - group mean, then whitened over every token of the batch (unbiased variance, + 1e-8); and the same
    split over two ranks (each its half of the groups, the sums over both) gives each half its share."""
    rewards, groups, lengths = seeded_case(seed)
    name = "reinforce_plus_plus_baseline"
    adv, _ = ADVANTAGES.get(name)(rewards, groups, None, Cfg, lengths=lengths, step_sum=lambda t: t)
    centred = rewards - verl_loop(rewards, groups, lambda r, k, rows: sum(r) / len(r))
    torch.testing.assert_close(adv, verl_whiten_over_tokens(centred, lengths), atol=1e-12, rtol=0)
    half = groups < 2  # two "ranks", each the whole of its groups
    for rank in (half, ~half):
        other = ~rank

        def both(t, other=other):  # this rank's sums plus the other's
            return t + torch.stack([lengths[other].sum(), (lengths[other] * centred[other]).sum(),
                                    (lengths[other] * centred[other] ** 2).sum()])
        part, _ = ADVANTAGES.get(name)(rewards[rank], groups[rank], None, Cfg, lengths=lengths[rank], step_sum=both)
        torch.testing.assert_close(part, adv[rank], atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_advantage_equals_verls(seed):
    """verl: alpha (r - group mean) / f_norm with alpha = N / #nonzero rewards over the batch, f_norm = 1."""
    rewards, groups, _ = seeded_case(seed)
    adv, metrics = ADVANTAGES.get("gpg")(rewards, groups, None, Cfg, step_sum=lambda t: t)
    alpha = len(rewards) / max(int((rewards != 0).sum()), 1)
    want = verl_loop(rewards, groups, lambda r, k, rows: alpha * (r[k] - sum(r) / len(r)))
    torch.testing.assert_close(adv, want, atol=1e-12, rtol=0)
    assert metrics["train/gpg_alpha"] == alpha
    # by hand: 8 outputs, 2 rewarded: alpha 4; group [1, 0, 0, 0]: A = 4 * (1 - 0.25) = 3
    hand, _ = ADVANTAGES.get("gpg")(torch.tensor([1.0, 0, 0, 0, 0, 1, 0, 0]), torch.tensor([0] * 4 + [1] * 4), None, Cfg,
                                    step_sum=lambda t: t)
    assert hand[0].item() == pytest.approx(3.0) and hand[1].item() == pytest.approx(-1.0)


@pytest.mark.parametrize("name", ["opo", "reinforce_plus_plus_baseline", "gpg"])
def test_an_estimator_declares_what_it_reads_and_is_given_only_that(name):
    """``inputs_of`` gives each estimator the keywords its ``reads`` name, none else; without them it says so."""
    from types import SimpleNamespace

    from bicc.method.advantages import inputs_of

    estimator = ADVANTAGES.get(name)
    ro = SimpleNamespace(rewards=torch.tensor([1.0, 0.0]), baseline=None)
    assert set(inputs_of(estimator, ro, torch.tensor([3, 5]))) == set(estimator.reads)
    assert inputs_of(ADVANTAGES.get("grpo"), ro, torch.tensor([3, 5])) == {}
    with pytest.raises(ValueError, match=f"advantage '{name}' needs"):
        estimator(ro.rewards, torch.zeros(2), None, Cfg)
