"""Advantage estimators, registered by name, one signature:

    fn(rewards [N], group_ids [N], delta [N] | None, cfg, **inputs) -> (advantages [N], metrics)

``group_ids`` says which query each sample answers (integers, any order). ``delta`` is RCC's per-sample sequence
log-prob shift (``sequence_delta``), computed for an estimator that declares ``fn.reads = ("delta",)`` (RCC's own, or
one's own; ``rcc.delta_context`` and ``rcc.delta`` say how) and None for the others.
Every group needs at least 2 samples: a group-relative advantage of one sample is meaningless.

An estimator declares what else it reads, and the step gives it that alone (``inputs_of``):

- ``fn.greedy_baseline = True`` (ReMax): ``baseline=`` [N], the reward of its query's greedy output, which the
  rollout draws for it;
- ``fn.reads = ("lengths",)``: ``lengths=`` [N], each output's token count;
- ``fn.reads = ("step_sum",)``: ``step_sum=``, a function that sums a tensor over every output of the step, on
  every rank (the identity in one process), for statistics over the whole batch (verl computes those on its driver,
  over the whole batch; here each rank holds its shards, so the sums are a collective).
- ``fn.reads = ("positive",)``: ``positive=`` [N] bool, O+ by ``algo.partition``: the partition BiCC's contexts
  read too (``bicc.method.conditioning.positives``), so the two never disagree;
- ``fn.reads = ("delta",)``: ``delta`` (the third argument) is RCC's delta rather than None: the step's plan reads
  the declaration (``StepConfig.reads``) and adds the passes delta needs (pi_ref on q, pi_old on delta's context).

This module holds the paper's estimators and what they share. Every module of this folder is imported here, so a new
estimator is one module (and its conf/algo YAML).
"""

from __future__ import annotations

import torch

from bicc.config.method import advantage_name  # noqa: F401  (the run's estimator, by the switches)
from bicc.registry import ADVANTAGES, import_folder


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, population std and group size. All [N]."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError(f"every group needs >= 2 samples for a group-relative advantage; got sizes {counts.tolist()}")
    values = values.double()
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, values)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (values - means[inverse]) ** 2)
    stds = (sq / counts).sqrt()
    return means[inverse], stds[inverse], counts[inverse]


def _degenerate_share(std: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of groups whose rewards are all equal (their advantage is 0: no learning signal).
    Each sample carries 1/count of its group, so summing over samples counts each group once."""
    num_groups = (1.0 / counts).sum()
    return (((std == 0).double() / counts).sum() / num_groups).item()


@ADVANTAGES.register("grpo")
def grpo_advantage(rewards, group_ids, delta, cfg):
    """A_i = (r_i - mean r) / (std r + eps) over the group, population std (paper eq. 5)."""
    mean, std, counts = group_stats(rewards, group_ids)
    adv = (rewards.double() - mean) / (std + cfg.adv_eps)
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts)}


@ADVANTAGES.register("mean_centered")
def mean_centered_advantage(rewards, group_ids, delta, cfg):
    """A_i = r_i - mean r, no std normalisation (Dr.GRPO)."""
    mean, std, counts = group_stats(rewards, group_ids)
    adv = rewards.double() - mean
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(std, counts)}


@ADVANTAGES.register("src")
def src_advantage(rewards, group_ids, delta, cfg, positive=None):
    """The released BiCC code's advantage: per group, with n+ outputs in O+ (``positive``, the step's partition;
    None: reward > 0.5, the released code's rule) and n- the rest, A = sqrt(n- / n+) for the former and
    -sqrt(n+ / n-) for the latter; 0 in a group with one side only. For 0/1 rewards this is GRPO's
    (r - mean r) / std r (population std) with no eps; a reward counts only by its side."""
    _, _, counts = group_stats(rewards, group_ids)
    positive = (rewards > 0.5 if positive is None else positive).double()
    n_pos, _, _ = group_stats(positive, group_ids)  # the group's share of positives
    n_pos = n_pos * counts
    n_neg = counts - n_pos
    mixed = (n_pos > 0) & (n_neg > 0)
    ratio = torch.where(mixed, n_neg / n_pos.clamp(min=1), torch.ones_like(n_pos))
    adv = torch.where(positive.bool(), ratio.sqrt(), -(1 / ratio).sqrt()) * mixed
    share = ((~mixed).double() / counts).sum() / (1.0 / counts).sum()
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": share.item()}


src_advantage.reads = ("positive",)


@ADVANTAGES.register("remax")
def remax_advantage(rewards, group_ids, delta, cfg, baseline=None):
    """ReMax (Li et al. 2023): A_i = r_i - b(q_i), b the reward of one greedy output of the query (the rollout draws
    it: ``remax_advantage.greedy_baseline``; ``Rollout.baseline`` [N]). No std normalisation."""
    if baseline is None:
        raise ValueError("advantage 'remax' needs the reward of a greedy output per sample (Rollout.baseline: the "
                         "collection draws it when algo.advantage=remax)")
    adv = rewards.double() - baseline.double()
    _, spread, counts = group_stats(adv, group_ids)
    return adv.to(rewards.dtype), {"train/adv_zero_group_share": _degenerate_share(spread + adv.abs(), counts),
                                   "train/remax_baseline": baseline.double().mean().item()}


remax_advantage.greedy_baseline = True


def baseline_of(ro) -> dict:
    """The keyword an estimator with a greedy baseline takes from a rollout: ``{"baseline": [N]}``, or none."""
    return {} if getattr(ro, "baseline", None) is None else {"baseline": ro.baseline}


def inputs_of(estimator, ro, lengths: torch.Tensor, step_sum=None, positive=None) -> dict:
    """The keywords ``estimator`` declares it reads (``fn.reads``, ``fn.greedy_baseline``), from the rollout ``ro``,
    each output's token count ``lengths`` [N], ``step_sum`` (a sum over every rank's outputs; None: this
    process's alone) and ``positive`` (a function giving O+ [N], the step's partition; called only for an
    estimator that reads it)."""
    reads = getattr(estimator, "reads", ())
    inputs = baseline_of(ro)
    if "lengths" in reads:
        inputs["lengths"] = lengths.to(ro.rewards.device, torch.float64)
    if "step_sum" in reads:
        inputs["step_sum"] = step_sum or (lambda t: t)
    if "positive" in reads and positive is not None:
        inputs["positive"] = positive()
    return inputs


def sequence_delta(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """RCC's delta_i = log pi_theta(o_i | x^c) - log pi_ref(o_i | q) per sequence [N], from per-token
    log-probs [N, L] on the completion grid: summed over the output's tokens (the paper) or their mean."""
    diff = ((logp - ref_logp) * mask).sum(-1)
    if reduce == "mean":
        diff = diff / mask.sum(-1).clamp(min=1)
    return diff.detach()


def advantage_metrics(adv: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """What the advantages' scale is, whatever the estimator: mean |A| over samples, and the mean group std of
    the rewards over mixed groups (those with a learning signal; GRPO divides their centred rewards by it)."""
    _, std, counts = group_stats(rewards, group_ids)
    weight = (std > 0).double() / counts  # each mixed group's samples carry 1/G of it (masked: static shapes)
    return {"train/adv_abs_mean": adv.double().abs().mean().item(),
            "train/reward_std_mixed": ((std * weight).sum() / weight.sum()).item() if bool(weight.sum() > 0) else 0.0}


@ADVANTAGES.register("rcc")
def rcc_advantage(rewards, group_ids, delta, cfg):
    """Reward-confidence correction (paper eq. 17; Algorithm 1 lines 9-11). Per group of G samples:

        Cov = (1/G) sum_i (r_i - R_bar)(delta_i - delta_bar),    A_i = r_i - R_bar - 2 Cov,

    with delta_i = log pi_theta(o_i | q) - log pi_ref(o_i | q) (``rcc=on``; on x^c in Algorithm 1's reading,
    ``rcc.delta_context=xc``), detached, and no std normalisation.
    It replaces the variant's own advantage."""
    if delta is None:
        raise ValueError("advantage 'rcc' needs delta: the per-sample log pi_theta(o|x^c) - log pi_ref(o|q)")
    if delta.shape != rewards.shape:
        raise ValueError(f"advantage 'rcc': delta has shape {tuple(delta.shape)}, rewards {tuple(rewards.shape)}")
    r_mean, r_std, counts = group_stats(rewards, group_ids)
    d_mean, _, _ = group_stats(delta, group_ids)
    r_centred = rewards.double() - r_mean
    cov, _, _ = group_stats(r_centred * (delta.double() - d_mean), group_ids)  # group mean of the products
    adv = r_centred - 2 * cov
    per_group = 1.0 / counts  # each sample carries 1/G of its group: sums below are over groups
    num_groups = per_group.sum()
    return adv.to(rewards.dtype), {
        "train/adv_zero_group_share": _degenerate_share(r_std, counts),
        "rcc/cov": ((cov * per_group).sum() / num_groups).item(),
        "rcc/abs_cov": ((cov.abs() * per_group).sum() / num_groups).item(),
        "rcc/correction_share": ((cov != 0).double() * per_group).sum().item() / num_groups.item(),
    }


@ADVANTAGES.register("rcc_std")
def rcc_std_advantage(rewards, group_ids, delta, cfg):
    """RCC's corrected advantage divided by the group's reward std, as GRPO divides: (r_i - R_bar - 2 Cov) /
    (std r + eps). Not the paper's (eq. 17 has no std): ``rcc=std``, a named diagnostic form that keeps GRPO's
    scale to tell RCC's correction from its dropping of the std (docs/pretrained.md)."""
    adv, metrics = rcc_advantage(rewards, group_ids, delta, cfg)
    _, std, _ = group_stats(rewards, group_ids)
    return (adv.double() / (std + cfg.adv_eps)).to(rewards.dtype), metrics


rcc_advantage.reads = rcc_std_advantage.reads = ("delta",)


import_folder(__name__, __path__)  # every module of this folder registers its entries

