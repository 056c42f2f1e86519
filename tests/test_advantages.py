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
