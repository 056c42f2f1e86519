"""Schemas of the method's groups: the variant (conf/algo), BiCC (conf/bicc) and RCC (conf/rcc), each with
the range checks of its own fields. Names checked against the registries (losses, advantages) and checks
across groups are in ``bicc.trainer.validation``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional

from omegaconf import MISSING

from bicc.config.fields import choice, need


@dataclass
class AlgoConfig:
    """Policy loss and advantage estimator (conf/algo)."""

    name: str = MISSING
    loss: str = MISSING
    advantage: str = MISSING
    loss_agg: str = MISSING
    # Lower clip: ratio floor 1 - eps.
    clip_eps_low: float = 0.2
    # Upper clip of the IS weight: ceiling 1 + eps.
    clip_eps_high: float = 0.2
    # Dual clip constant c for A < 0 (per-token loss capped at -c*A); 0 = off.
    dual_clip_c: float = 0.0
    # Denominator of the ratio: old (sampling policy) | ref (frozen initial policy).
    ratio_denominator: str = choice(Literal["old", "ref"], "old")
    # KL penalty coefficient to the frozen initial policy (0 = off, no reference model is loaded).
    kl_coef: float = 0.0
    # KL estimator: k1 | k2 | k3.
    kl_estimator: str = "k3"
    # Added to the group std before dividing.
    adv_eps: float = 1e-6
    # Drop groups whose rewards are all equal and draw more prompts until the batch is full (DAPO).
    dynamic_sampling: bool = False
    # Most generate rounds per step when dynamic sampling refills the batch.
    max_sampling_rounds: int = 4
    # Overlong reward shaping buffer L_cache as a share of rollout.max_new_tokens (DAPO: 0.2); 0 = off.
    overlong_buffer_share: float = 0.0
    # Penalty at the length limit for overlong shaping (reward -= penalty * overshoot / L_cache).
    overlong_penalty: float = 1.0
    # O+, which BiCC's contexts and an advantage that partitions (src) both read: correct = the task's verdict r = 1
    # (the paper's); reward = the shaped reward above 0.5 (the released code's rule: a correct output the overlong
    # penalty takes to 0.5 or below counts as wrong).
    partition: str = choice(Literal["correct", "reward"], "correct")
    # the variant's own hyperparameters, declared by its loss (``LOSSES.register(name, params=...)``)
    params: Dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def check(a) -> None:
        need(a.clip_eps_low > 0, "algo.clip_eps_low",
             f"must be > 0 (ratio floor 1-eps; 1 or more: no floor, as CISPO's), got {a.clip_eps_low}")
        need(a.clip_eps_high > 0, "algo.clip_eps_high", f"must be > 0, got {a.clip_eps_high}")
        need(a.dual_clip_c == 0 or a.dual_clip_c > 1, "algo.dual_clip_c", f"must be 0 (off) or > 1, got {a.dual_clip_c}")
        need(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
        need(a.max_sampling_rounds >= 1, "algo.max_sampling_rounds", f"must be >= 1, got {a.max_sampling_rounds}")
        need(0 <= a.overlong_buffer_share < 1, "algo.overlong_buffer_share",
             f"must be in [0, 1) (a share of rollout.max_new_tokens), got {a.overlong_buffer_share}")
        need(a.overlong_penalty >= 0, "algo.overlong_penalty", f"must be >= 0, got {a.overlong_penalty}")
        need(a.adv_eps >= 0, "algo.adv_eps", f"must be >= 0, got {a.adv_eps}")


@dataclass
class BiccConfig:
    """Bilateral Context Conditioning (conf/bicc): what the trainable numerator is conditioned on."""

    enabled: bool = MISSING
    # partition: every sample sees the whole opposite partition (Algorithm 1) | paired: k attempts round-robin.
    mode: str = choice(Literal["partition", "paired", "last"], "partition")
    # Opposite attempts per sample in paired mode.
    paired_k: int = 1
    # The opposite attempts of one context take at most floor(context_ratio x max_tokens) tokens.
    context_ratio: float = 0.4
    max_tokens: int = MISSING
    # How an attempt longer than its share is cut: middle (head + final answer) | head | tail.
    truncate: str = choice(Literal["middle", "head", "tail", "none"], "middle")
    # Attempts whose share falls below this many tokens are dropped, not cut further.
    min_attempt_tokens: int = 12
    # Partition threshold for non-binary rewards; null = rewards must be exactly 0 or 1.
    reward_threshold: Optional[float] = None
    # Placed after the problem, before the attempts (inside the user turn).
    preamble: str = "\n\nOther attempts at this problem:"
    # Header of each attempt; {i} is its number.
    attempt_header: str = "\nAttempt {i}:\n"
    # Marker where the middle of a truncated attempt was cut.
    elision: str = " ... "
    # Stabiliser: evaluate pi_old on x^c too, so the ratio starts at 1 (the paper: false).
    old_on_context: bool = False
    # Stabiliser: multiply optim.lr by this while BiCC is on; 1 = the base variant's lr (the paper).
    lr_scale: float = 1.0
    context_in: str = choice(Literal["numerator", "denominator"], "numerator")
    layout: str = choice(Literal["paper", "released"], "paper")
    # The separator: token id 2, whatever it is in the model's vocabulary (the released code's constant).
    separator_id: int = 2

    @staticmethod
    def check(b) -> None:
        need(0 < b.context_ratio < 1, "bicc.context_ratio", f"must be in (0, 1), got {b.context_ratio}")
        need(b.paired_k >= 1, "bicc.paired_k", f"must be >= 1, got {b.paired_k}")
        need(b.min_attempt_tokens >= 1, "bicc.min_attempt_tokens", f"must be >= 1, got {b.min_attempt_tokens}")
        need(b.max_tokens >= 1, "bicc.max_tokens", f"must be >= 1, got {b.max_tokens}")
        need(0 < b.lr_scale <= 10, "bicc.lr_scale", f"must be in (0, 10], got {b.lr_scale}")
        need("{i}" in b.attempt_header, "bicc.attempt_header",
             f"must contain '{{i}}' (the attempt number), got {b.attempt_header!r}")
        need(0 <= b.separator_id < 2**31, "bicc.separator_id", f"must be a token id (>= 0), got {b.separator_id}")
        need(b.truncate != "none" or b.mode != "partition", "bicc.truncate",
             "'none' (attempts shown whole, no budget) needs bicc.mode=last or paired: a whole opposite partition can "
             "hold G - 1 full outputs")
        need(not (b.context_in == "denominator" and b.old_on_context), "bicc.context_in",
             "'denominator' already evaluates pi_old on x^c (and pi_theta on q); bicc.old_on_context=true puts both "
             "on x^c: set one of them")


@dataclass
class RccConfig:
    """Reward-confidence correction (conf/rcc)."""

    enabled: bool = MISSING
    # Per-token mean of log pi_theta(o_i | q) - log pi_ref(o_i | q) (delta's context as under rcc=on).
    delta: str = choice(Literal["sum", "mean"], "mean")
    # Where log pi_theta(o_i | .) in delta is evaluated (read by the diagnostics): q (as under rcc=on) | xc.
    delta_context: str = choice(Literal["xc", "q"], "q")
    # Scale of the corrected advantage (unused while off).
    scale: str = choice(Literal["none", "std"], "none")


def advantage_name(algo, rcc) -> str:
    """The run's advantage estimator: RCC's (``rcc=on``; ``rcc=std`` its diagnostic form divided by the group's
    std) when RCC is on, else the variant's own (``algo.advantage``)."""
    if not rcc.enabled:
        return algo.advantage
    return "rcc_std" if rcc.scale == "std" else "rcc"
