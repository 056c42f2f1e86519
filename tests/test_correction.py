"""The rollout correction (bicc/method/correction.py): its thresholds read as verl reads them, the weights and the
rejection by hand, and verl's rollout_corr_helper written out token by token on seeded cases (weights, masks and
each criterion's masked share)."""

import math

import pytest
import torch

from bicc.method.correction import CRITERIA, correct, is_bounds, rs_bounds

SAFE = 20.0


def case(seed, n=6, length=5):
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(n, length, generator=gen, dtype=torch.float64) * 0.6
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    return log_ratio, mask


def test_thresholds_read_as_verl_reads_them():
    assert is_bounds("2.0").upper == 2.0 and is_bounds(2).lower is None  # TIS
    b = is_bounds("0.5_2.0")
    assert (b.lower, b.upper) == (0.5, 2.0)  # IcePop
    k1 = rs_bounds(["token_k1", "seq_mean_k3"], "2.0,0.1")
    assert (k1["token_k1"].lower, k1["token_k1"].upper) == (0.5, 2.0)  # one value u: [1/u, u]
    assert k1["seq_mean_k3"].upper == 0.1 and k1["seq_mean_k3"].lower is None
    assert rs_bounds(["token_k2", "seq_max_k3"], "0.3") == {"token_k2": rs_bounds(["token_k2"], "0.3")["token_k2"],
                                                            "seq_max_k3": rs_bounds(["seq_max_k3"], "0.3")["seq_max_k3"]}
    for bad, match in [(("token_k4",), "unknown criterion"), (("token_k2", "token_k3"), "2 criteria"),
                       (("token_k2",), "one upper bound")]:
        spec = "0.1,0.2,0.3" if len(bad) == 2 else ("0.1_0.2" if "upper" in match else "1")
        with pytest.raises(ValueError, match=match):
            rs_bounds(list(bad), spec)
    with pytest.raises(ValueError, match="lo <= hi"):
        is_bounds("2.0_0.5")


def test_icepop_token_weights_and_a_rejection_by_hand():
    """log r per token: [ln 3, ln 0.4, 0] and [ln 1.5, pad]. IcePop [0.5, 2]: 3 and 0.4 fall outside, zeroed; 1 and
    1.5 kept. token_k1 at 2.0 ([1/2, 2] on pi_sampler / pi_old = 1/r): 1/3 and 1/0.4 = 2.5 out, so those two tokens
    leave the loss (2 of 4 real tokens: a masked share of 0.5; 1 of 2 sequences)."""
    log_ratio = torch.log(torch.tensor([[3.0, 0.4, 1.0], [1.5, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    w, kept, metrics = correct(log_ratio, mask, "token", "0.5_2.0", False, "token_k1", "2.0")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.5, 0.0, 0.0]]))
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)


def test_sequence_weights_and_the_batch_normalisation_by_hand():
    """Sequence level: w = exp(sum log r) on every token of the output, truncated at 4: rows [ln 2 + ln 3] -> 6 -> 4 and
    [ln 0.5] -> 0.5. Normalised over the step's sequences: mean (4 + 0.5) / 2 = 2.25, so 4/2.25 and 0.5/2.25."""
    log_ratio = torch.log(torch.tensor([[2.0, 3.0], [0.5, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    w, kept, metrics = correct(log_ratio, mask, "sequence", "4", True, None, None)
    torch.testing.assert_close(w, torch.tensor([[4 / 2.25, 4 / 2.25], [0.5 / 2.25, 0.0]], dtype=torch.float64))
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(2.25)
    torch.testing.assert_close(kept, mask)
    # over two ranks, each its row: the step's sums make the same factor
    halves = [correct(log_ratio[i:i + 1], mask[i:i + 1], "sequence", "4", True, None, None,
                      step_sum=lambda t: torch.tensor([4.0 + 0.5, 2.0], dtype=torch.float64))[0] for i in range(2)]
    torch.testing.assert_close(torch.cat(halves), w)


def verl_weights(log_ratio, mask, level, threshold, normalize):
    """verl's compute_rollout_correction_weights, written out: token w = exp(clamp(log r)), sequence w = exp(clamp(sum
    over the row's tokens)); times the mask; TIS clamps at the upper bound, IcePop zeroes outside [lo, hi]; detached;
    normalised by the masked mean (token) or the mean over sequences of each row's masked mean (sequence)."""
    n, length = log_ratio.shape
    lo, hi = (float(x) for x in threshold.split("_")) if "_" in threshold else (None, float(threshold))
    w = torch.zeros(n, length, dtype=torch.float64)
    for i in range(n):
        seq = sum(float(log_ratio[i, t]) for t in range(length) if mask[i, t])
        for t in range(length):
            x = float(log_ratio[i, t]) if level == "token" else seq
            raw = math.exp(min(max(x, -SAFE), SAFE)) * float(mask[i, t])
            w[i, t] = min(raw, hi) if lo is None else (raw if lo <= raw <= hi else 0.0)
    if normalize:
        if level == "token":
            mean = float((w * mask).sum() / mask.sum())
        else:
            rows = [float((w[i] * mask[i]).sum() / mask[i].sum()) for i in range(n) if mask[i].sum() > 0]
            mean = sum(rows) / len(rows)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_keep(log_ratio, mask, option, spec):
    """verl's compute_rollout_rejection_mask for one option, written out: per token k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r (log r clamped); the sequence options sum, average or take the max over the row's tokens; k1
    kept within [log lo, log hi] (one value u: lo = 1/u), k2 and k3 at most the threshold."""
    n, length = log_ratio.shape
    keep = torch.ones(n, length, dtype=torch.float64)
    for i in range(n):
        vals = []
        for t in range(length):
            x = min(max(float(log_ratio[i, t]), -SAFE), SAFE)
            vals.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[option[-2:]])
        real = [v for v, m in zip(vals, mask[i]) if m]
        if option.startswith("seq_sum"):
            vals = [sum(real)] * length
        elif option.startswith("seq_mean"):
            vals = [sum(real) / max(len(real), 1)] * length
        elif option.startswith("seq_max"):
            vals = [max(real) if real else 0.0] * length
        for t in range(length):
            if option.endswith("k1"):
                lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
                keep[i, t] = float(math.log(lo) <= vals[t] <= math.log(hi))
            else:
                keep[i, t] = float(vals[t] <= float(spec))
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", ["1.5", "0.7_1.4"])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_equal_verls(seed, level, threshold, normalize):
    log_ratio, mask = case(seed)
    w, _, _ = correct(log_ratio, mask, level, threshold, normalize, None, None)
    torch.testing.assert_close(w, verl_weights(log_ratio, mask, level, threshold, normalize), atol=1e-12, rtol=0)
    assert 0 < float((w * mask).sum()) and not torch.equal(w * mask, mask)  # neither nothing kept nor all 1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("option", CRITERIA)
def test_each_rejection_criterion_equals_verls(seed, option):
    log_ratio, mask = case(seed)
    spec = {"k1": "0.6_1.6", "k2": "0.15", "k3": "0.15"}[option[-2:]] if option.startswith("token") else \
        {"k1": "0.4_2.5", "k2": "0.5", "k3": "0.5"}[option[-2:]]
    if option.startswith("seq_mean") or option.startswith("seq_max"):
        spec = {"k1": "0.7_1.4", "k2": "0.12", "k3": "0.12"}[option[-2:]]
    _, kept, metrics = correct(log_ratio, mask, "none", "2.0", False, option, spec)
    want = verl_keep(log_ratio, mask, option, spec) * mask
    torch.testing.assert_close(kept, want, atol=0, rtol=0)
    share = float(((1 - want) * mask).sum() / mask.sum())
    assert metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] == pytest.approx(share)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(share)


def test_chained_criteria_keep_what_every_one_keeps():
    log_ratio, mask = case(4)
    _, kept, metrics = correct(log_ratio, mask, "none", "2.0", False, "token_k2,seq_mean_k3", "0.2,0.1")
    want = verl_keep(log_ratio, mask, "token_k2", "0.2") * verl_keep(log_ratio, mask, "seq_mean_k3", "0.1") * mask
    torch.testing.assert_close(kept, want, atol=0, rtol=0)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert {"rollout_corr/rollout_rs_token_k2_masked_fraction", "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction"} \
        <= set(metrics)
