import pytest
import torch

from bicc.method.diagnostics import conditioning_weights


def test_conditioning_weights_split_by_reward_and_skip_unconditioned():
    log_w = torch.tensor([0.5, -1.0, 2.0, -3.0, 9.0])
    conditioned = torch.tensor([True, True, True, True, False])
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    m = conditioning_weights(log_w, conditioned, correct)
    # correct & conditioned: rows 0, 1 -> mean log w -0.25, one of two above 0
    # incorrect & conditioned: rows 2, 3 -> mean -0.5, one of two above 0; row 4 is not conditioned
    assert m["bicc/log_w_pos"] == pytest.approx(-0.25) and m["bicc/w_gt1_share_pos"] == 0.5
    assert m["bicc/log_w_neg"] == pytest.approx(-0.5) and m["bicc/w_gt1_share_neg"] == 0.5


def test_no_conditioned_samples_gives_no_metrics():
    assert conditioning_weights(torch.zeros(3), torch.zeros(3, dtype=torch.bool), torch.ones(3)) == {}


def test_shift_and_delta_hand_computed():
    from bicc.method.diagnostics import shift_and_delta

    # group 0: r = [1, 0], log w = [-1, -3] -> centred r [.5, -.5], log w [1, -1]: Cov = (0.5 + 0.5) / 2 = 0.5
    # group 1: r = [1, 1], log w = [0, 2]: r centred is 0 -> Cov 0; mean over groups 0.25
    rewards, groups = torch.tensor([1.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1])
    log_w = torch.tensor([-1.0, -3.0, 0.0, 2.0])
    conditioned = torch.tensor([True, True, True, True])
    m = shift_and_delta(log_w, None, rewards, groups, conditioned)
    assert m == {"bicc/cov_r_log_w": pytest.approx(0.25)}
    # delta centred per group: [0.5, -0.5] and [-1, 1] against log w centred [1, -1] and [-1, 1]:
    # sum d*w = 0.5 + 0.5 + 1 + 1 = 3, |d| = sqrt(2.5), |w| = 2 -> corr = 3 / (2 sqrt(2.5)) = 0.9487
    m = shift_and_delta(log_w, torch.tensor([1.0, 0.0, -1.0, 1.0]), rewards, groups, conditioned)
    assert m["rcc/delta_log_w_corr"] == pytest.approx(3 / (2 * 2.5**0.5))


def test_stage_label_ends_at_the_last_step_run():
    from bicc.evaluation.plots import stage_label

    assert stage_label(0, 100, 150) == "1-100"
    assert stage_label(1, 100, 150) == "101-150"  # a 150-step run stops inside the second stage
    assert stage_label(1, 100, 250) == "101-200"
    assert stage_label(1, 100, 0) == "101-200"  # no steps logged: the stage window
