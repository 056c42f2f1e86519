"""pass@k, bootstrap CIs and the paired Wilcoxon test."""

import itertools

import numpy as np
import pytest

from bicc.evaluation.stats import bootstrap_ci, crossed_bootstrap_diff, paired_bootstrap_diff, pass_at_k, wilcoxon_paired


@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_pass_at_1_is_the_sample_mean_and_large_n_is_stable():
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25)
    assert 0.99 < pass_at_k(1000, 10, 900) <= 1.0


def test_bootstrap_ci_coverage_in_simulation():
    """Per-problem accuracies of 100 problems (n = 8 samples, problem difficulties from a Beta):
    the 95% interval must contain the true mean in at least 90% of 300 simulated evaluations."""
    rng = np.random.default_rng(0)
    covered, trials = 0, 300
    for t in range(trials):
        p = rng.beta(0.8, 1.2, size=100)
        true_mean = 0.8 / 2.0  # the Beta's mean: the population the problems are drawn from
        acc = rng.binomial(8, p) / 8
        lo, hi = bootstrap_ci(acc, num_samples=1000, seed=t)
        covered += lo <= true_mean <= hi
    assert covered / trials >= 0.90


def test_bootstrap_ci_has_the_width_of_a_standard_error():
    """Coverage alone is met by any wide interval, (min, max) of the data included: the 95% interval of a mean
    over 400 values in {0, 1} (half of each) is about 2 x 1.96 x sqrt(0.25 / 400) = 0.098 wide, centred."""
    values = np.array([0.0, 1.0] * 200)
    lo, hi = bootstrap_ci(values, num_samples=2000, seed=0)
    assert 0.085 < hi - lo < 0.11
    assert abs((lo + hi) / 2 - 0.5) < 0.01


def test_paired_bootstrap_difference():
    a = np.array([0.0, 0.5, 1.0, 0.25])
    b = np.array([0.5, 0.5, 1.0, 0.75])
    diff, lo, hi = paired_bootstrap_diff(a, b, num_samples=500)
    assert diff == pytest.approx(0.25) and lo <= diff <= hi
    with pytest.raises(ValueError, match="same problems"):
        paired_bootstrap_diff(a, b[:3])


def test_crossed_bootstrap_resamples_seeds():
    """Two seeds whose differences are 0 and 1 on every problem: a draw of two seeds means 0, 0.5 or 1 with
    probabilities 1/4, 1/2, 1/4, whatever problems it draws, so the 95% interval is [0, 1] around 0.5. Resampling
    problems alone (the per-seed paired bootstrap) would give a zero-width interval at 0.5."""
    a = np.zeros((2, 50))
    b = np.array([[0.0] * 50, [1.0] * 50])
    diff, lo, hi = crossed_bootstrap_diff(a, b)
    assert (diff, lo, hi) == pytest.approx((0.5, 0.0, 1.0), abs=1e-12)


def test_crossed_bootstrap_resamples_problems():
    """Three identical seeds: only the problems vary, so the interval is the problem bootstrap's, about
    2 x 1.96 x sqrt(0.25 / 400) = 0.098 wide around the mean (differences of 0 and 1, half each)."""
    b = np.tile(np.array([0.0, 1.0] * 200), (3, 1))
    diff, lo, hi = crossed_bootstrap_diff(np.zeros_like(b), b)
    assert diff == 0.5 and 0.085 < hi - lo < 0.11 and abs((lo + hi) / 2 - 0.5) < 0.01


def test_crossed_bootstrap_equals_a_loop_over_draws():
    """The weighted form (how often each seed and problem was drawn) against the plain loop: draw S seeds and P
    problems, average the differences over every drawn pair; the same random draws, the same quantiles."""
    rng = np.random.default_rng(3)
    a, b = rng.random((3, 7)), rng.random((3, 7))
    diff, lo, hi = crossed_bootstrap_diff(a, b, num_samples=300, seed=5)
    draws = np.random.default_rng(5)
    seeds, problems = draws.integers(0, 3, size=(300, 3)), draws.integers(0, 7, size=(300, 7))
    means = [(b - a)[np.ix_(s, p)].mean() for s, p in zip(seeds, problems)]
    assert diff == pytest.approx((b - a).mean())
    assert (lo, hi) == pytest.approx((np.quantile(means, 0.025), np.quantile(means, 0.975)), abs=1e-12)
    with pytest.raises(ValueError, match="seeds, problems"):
        crossed_bootstrap_diff(a, b[:, :3])
    with pytest.raises(ValueError, match="seeds, problems"):
        crossed_bootstrap_diff(a[0], b[0])


def test_wilcoxon_known_case():
    # scipy's documented example (Cucumber data, two-sided): W = 24, exact p = 0.041259765625
    d = np.array([6, 8, 14, 16, 23, 24, 28, 29, 41, -48, 49, 56, 60, -67, 75], dtype=float)
    w, p = wilcoxon_paired(np.zeros_like(d), d)
    assert w == 24.0 and p == pytest.approx(0.041259765625)
    assert wilcoxon_paired(np.ones(5), np.ones(5)) == (0.0, 1.0)
