"""Statistics for evaluation: unbiased pass@k, bootstrap confidence intervals over problems, and the
paired Wilcoxon signed-rank test for comparing two runs problem by problem."""

from __future__ import annotations

import math

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), as a product so that large n does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_table(n: int, correct: list[int], ks) -> dict[int, np.ndarray]:
    """Per-problem pass@k for each k <= n: {k: array [num_problems]}."""
    return {k: np.array([pass_at_k(n, c, k) for c in correct]) for k in ks if k <= n}


def bootstrap_ci(values, num_samples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean, resampling problems with replacement."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(num_samples, len(values)))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def paired_bootstrap_diff(a, b, num_samples: int = 2000, level: float = 0.95, seed: int = 0):
    """mean(b - a) over problems and its percentile bootstrap CI (problems resampled in pairs)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired comparison needs the same problems: {a.shape} vs {b.shape}")
    diff = b - a
    lo, hi = bootstrap_ci(diff, num_samples, level, seed)
    return float(diff.mean()), lo, hi


def crossed_bootstrap_diff(a, b, num_samples: int = 2000, level: float = 0.95, seed: int = 0):
    """mean(b - a) over a [seeds, problems] grid of paired scores and its percentile bootstrap CI, resampling seeds
    and problems independently (each draw: S seeds and P problems with replacement, the mean of the differences
    over every drawn (seed, problem) pair), so that the interval holds both the run-to-run and the problem-to-problem
    spread. One seed: the same resampling of problems as ``paired_bootstrap_diff``."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"crossed comparison needs two [seeds, problems] grids of one shape: {a.shape} vs {b.shape}")
    diff = b - a  # [S, P]
    S, P = diff.shape
    rng = np.random.default_rng(seed)
    # each draw's weights: how often each seed and each problem was drawn, over S and P
    seeds = np.stack([np.bincount(row, minlength=S) for row in rng.integers(0, S, size=(num_samples, S))]) / S
    problems = np.stack([np.bincount(row, minlength=P) for row in rng.integers(0, P, size=(num_samples, P))]) / P
    means = np.einsum("bs,sp,bp->b", seeds, diff, problems)  # [num_samples]
    alpha = (1 - level) / 2
    return float(diff.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def wilcoxon_paired(a, b) -> tuple[float, float]:
    """Paired Wilcoxon signed-rank test of b vs a on per-problem accuracy (scipy; zero differences
    are dropped, as in Wilcoxon's original test). Returns (statistic, two-sided p). With no nonzero
    difference the runs are indistinguishable: (0, 1)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not np.any(a != b):
        return 0.0, 1.0
    result = stats.wilcoxon(b, a, zero_method="wilcox", alternative="two-sided")
    return float(result.statistic), float(result.pvalue)


def normal_ci_half_width(values) -> float:
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan")
    return 1.96 * float(values.std(ddof=1)) / math.sqrt(len(values))
