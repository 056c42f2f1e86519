"""Diagnostics computed from a step's tensors without changing the update."""

from __future__ import annotations

import functools

import torch

from bicc.config import StepConfig


@torch.no_grad()
def conditioning_weights(log_w: torch.Tensor, conditioned: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """BiCC's conditioning weight w_i = pi_theta(o_i | x^c) / pi_theta(o_i | q), from the summed log-ratio
    of the step's first pass (theta = theta_old there), over conditioned samples split by reward. The
    paper's case study expects w > 1 on correct and w < 1 on incorrect outputs. Reported as the mean of
    log w (w itself is a product over tokens and overflows) and the share with w > 1."""
    metrics = {}
    for name, side in (("pos", correct == 1), ("neg", correct != 1)):
        sel = conditioned.to(log_w.device) & side.to(log_w.device)  # masked, not indexed: static shapes (fake tensors)
        if sel.any():
            count = sel.sum()
            metrics[f"bicc/log_w_{name}"] = (torch.where(sel, log_w, 0.0).sum() / count).item()
            metrics[f"bicc/w_gt1_share_{name}"] = ((sel & (log_w > 0)).sum() / count).item()
    return metrics


@torch.no_grad()
def shift_and_delta(log_w: torch.Tensor, delta: torch.Tensor | None, rewards: torch.Tensor, group_ids: torch.Tensor,
                    conditioned: torch.Tensor) -> dict[str, float]:
    """How BiCC's conditioning shift log w meets RCC's Cov. ``bicc/cov_r_log_w``: the mean over groups of
    Cov(r, log w) = (1/G) sum_i (r_i - R_bar)(log w_i - mean log w), what reading delta on x^c instead of q adds to
    Cov(r, delta) (delta on x^c = delta on q + log w). ``rcc/delta_log_w_corr`` (with a delta): the Pearson
    correlation over conditioned samples of delta and log w, each centred in its group."""
    from bicc.method.advantages import group_stats

    r_mean, _, counts = group_stats(rewards, group_ids)
    r = rewards.double() - r_mean
    w = log_w.double() - group_stats(log_w, group_ids)[0]
    cov = group_stats(r * w, group_ids)[0]  # each sample holds its group's mean of the products
    metrics = {"bicc/cov_r_log_w": ((cov / counts).sum() / (1.0 / counts).sum()).item()}
    if delta is not None and int(conditioned.sum()) > 2:  # masked, not indexed: shapes stay static (fake tensors)
        keep = conditioned.double()
        d = (delta.double() - group_stats(delta, group_ids)[0]) * keep
        w = w * keep
        denom = (d.norm() * w.norm()).item()
        metrics["rcc/delta_log_w_corr"] = float((d * w).sum().item() / denom) if denom > 0 else 0.0
    return metrics


@torch.no_grad()
def delta_by_reward(delta: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """Mean delta over correct and incorrect outputs and their separation (the paper's Delta mu)."""
    metrics = {}
    pos, neg = delta[correct == 1], delta[correct != 1]
    if len(pos):
        metrics["rcc/delta_pos"] = pos.mean().item()
    if len(neg):
        metrics["rcc/delta_neg"] = neg.mean().item()
    if len(pos) and len(neg):
        metrics["rcc/delta_sep"] = metrics["rcc/delta_pos"] - metrics["rcc/delta_neg"]
    return metrics


class GradientMoments:
    """Running first and second moments of K gradient estimates, kept as one summed vector per
    parameter plus a scalar (never K copies of the model's gradient)."""

    def __init__(self):
        self.sum: list[torch.Tensor] | None = None
        self.sq_norm_sum = 0.0
        self.count = 0

    def add(self, grads: list[torch.Tensor]) -> None:
        flat = [g.detach().double() for g in grads]
        self.sq_norm_sum += sum(float((g * g).sum()) for g in flat)
        self.sum = flat if self.sum is None else [s + g for s, g in zip(self.sum, flat)]
        self.count += 1

    def variances(self) -> tuple[float, float]:
        """(relative, absolute): mean_k ||g_k - g_bar||^2 / ||g_bar||^2 and mean_k ||g_k - g_bar||^2, with
        g_bar = mean_k g_k (see ``gradient_variance``)."""
        if self.count < 2:
            raise ValueError(f"a gradient variance needs >= 2 estimates, got {self.count}")
        mean_sq_norm = sum(float((s * s).sum()) for s in self.sum) / self.count**2
        spread = max(self.sq_norm_sum / self.count - mean_sq_norm, 0.0)
        return (spread / mean_sq_norm if mean_sq_norm > 0 else float("nan")), spread

    def relative_variance(self) -> float:
        return self.variances()[0]


def gradient_variance(model, loss_of_rows, group_ids: torch.Tensor, splits: int, generator: torch.Generator,
                      micro_batch_size: int, absolute: bool = False):
    """Relative variance of the policy-gradient estimator at the current parameters.

    Definition (fixed across the project): the step's groups (queries) are shuffled and cut into K =
    ``splits`` disjoint, nearly equal sets. For each set k, g_k is the gradient of the step's loss
    computed on that set alone (normalised over the set, exactly as the update normalises over its
    minibatch), so every g_k estimates the same expected gradient from 1/K of the queries. We report

        V = mean_k ||g_k - g_bar||^2 / ||g_bar||^2,      g_bar = mean_k g_k,

    over all trainable parameters flattened: the estimator's variance relative to its squared mean,
    which is invariant to the scale of the advantages (GRPO's std division vs RCC's none). Lower V
    means a less noisy gradient. ``loss_of_rows(rows)`` returns the loss of those rows normalised over
    ``rows`` (callers pass the update's own loss). Gradients are cleared afterwards, so the following
    update is unchanged. With ``absolute`` it returns (V, mean_k ||g_k - g_bar||^2): the absolute spread,
    which does depend on the advantages' scale (it falls by RCC dropping the std division alone)."""
    groups = torch.unique(group_ids)
    groups = groups[torch.randperm(len(groups), generator=generator)]
    moments = GradientMoments()
    params = [p for p in model.parameters() if p.requires_grad]
    for chunk in groups.tensor_split(splits):
        rows = torch.nonzero(torch.isin(group_ids, chunk)).flatten()
        model.zero_grad(set_to_none=True)
        for start in range(0, len(rows), micro_batch_size):
            loss_of_rows(rows[start : start + micro_batch_size], rows).backward()
        moments.add([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    model.zero_grad(set_to_none=True)
    return moments.variances() if absolute else moments.relative_variance()


def gradient_diagnostics(model, numerator, batch, old_logp, ref_logp, adv, is_weight, cfg: StepConfig, ro, delta,
                         seed: int) -> dict:
    """RCC's diagnostics on a step's batch: delta by reward, the gradient variance of the update's loss
    (``numerator``'s rows, as ``bicc.trainer.update`` computes it) over ``diag.splits`` group splits and, without RCC,
    Cov(r, delta). Gradients are cleared before the update."""
    from bicc.method.advantages import ADVANTAGES

    metrics = {}
    if not cfg.rcc.enabled:
        _, rcc_metrics = ADVANTAGES.get("rcc")(ro.rewards, ro.group_ids, delta, cfg.algo)
        metrics.update({k: v for k, v in rcc_metrics.items() if k.startswith("rcc/")})
    model.train()
    loss_of_rows = functools.partial(update_loss, model, numerator, batch, old_logp, ref_logp, adv, is_weight, cfg)
    grad_var = gradient_variance(model, loss_of_rows, ro.group_ids.to(adv.device), cfg.diag.splits,
                                 torch.Generator().manual_seed(seed), cfg.train.micro_batch_size)
    return {**metrics, **delta_by_reward(delta, ro.correct), "rcc/grad_var": grad_var}


def update_loss(model, numerator, batch, old_logp, ref_logp, adv, is_weight, cfg: StepConfig, rows, norm_rows):
    """The update's loss on ``rows`` normalised over ``norm_rows`` (a diagnostic split), differentiable."""
    from bicc.method.losses import StepTotals, rows_loss

    totals = StepTotals.of(batch.completion_mask[norm_rows], cfg.rollout.max_new_tokens)
    logp, _ = numerator.logprobs(model, rows, cfg.rollout.temperature)
    return rows_loss(logp, rows, batch.completion_mask[rows], old_logp, ref_logp, adv, cfg.algo, totals, is_weight)[0]
