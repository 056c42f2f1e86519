"""``rollout.correction``: the sampler's tokens corrected against the trainer's pi_old (bicc/method/correction.py), in
verl's vocabulary (its ``algorithm.rollout_correction``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bicc.config.fields import need

# The importance weight's truncation under rollout workers when rollout_is is null: the sampler is then up to N steps
# older than pi_old, and peers without the weight collapsed.
ASYNC_IS_THRESHOLD = 2.0


LEVELS = ("none", "token", "sequence")
CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2",
            "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class Bounds:
    """A threshold: an upper bound, and a lower one where it has two."""

    upper: float
    lower: float | None = None


def is_bounds(spec) -> Bounds:
    """``rollout_is_threshold``: ``C`` (TIS) or ``lo_hi`` (IcePop). Raises ValueError naming what is wrong."""
    text = str(spec).strip()
    lower, _, upper = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        b = Bounds(float(upper), float(lower) if lower else None)
    except ValueError:
        raise ValueError(f"{spec!r} is not C (truncation) or lo_hi (a band), e.g. 2.0 or 0.5_2.0") from None
    if b.upper <= 0 or (b.lower is not None and not 0 < b.lower <= b.upper):
        raise ValueError(f"{spec!r}: the bounds must be positive and lo <= hi")
    return b


def rs_bounds(criteria: list[str], spec) -> dict[str, Bounds]:
    """``rollout_rs_threshold`` for each criterion: one value for all, or one each (comma-separated); k1's is a
    ratio band ``lo_hi`` (one value u: [1/u, u]), the others an upper bound. Raises ValueError naming what is wrong."""
    for c in criteria:
        if c not in CRITERIA:
            raise ValueError(f"unknown criterion {c!r}; choose from: {', '.join(CRITERIA)}")
    if spec is None:
        raise ValueError("rollout_rs is set, so rollout_rs_threshold must be too")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(criteria)):
        raise ValueError(f"{len(parts)} thresholds for {len(criteria)} criteria: give one, or one each")
    out = {}
    for c, part in zip(criteria, parts * len(criteria) if len(parts) == 1 else parts):
        if c.endswith("k1"):
            b = is_bounds(part)
            out[c] = b if b.lower is not None else Bounds(b.upper, 1 / b.upper)
        else:
            if "_" in part:
                raise ValueError(f"criterion {c!r} takes one upper bound, not {part!r}")
            out[c] = Bounds(float(part))
            if out[c].upper <= 0:
                raise ValueError(f"criterion {c!r}: the threshold must be positive, got {part}")
    return out


def criteria_of(rollout_rs: str | None) -> list[str]:
    """The rejection criteria named by ``rollout_rs`` (comma-separated), each once, in order."""
    names = [c.strip() for c in (rollout_rs or "").split(",") if c.strip()]
    return list(dict.fromkeys(names))


@dataclass
class CorrectionConfig:
    """Importance weights pi_old / pi_sampler and rejection of tokens or sequences far from the sampler."""

    # Importance weights pi_old / pi_sampler: none | token | sequence (the product over the output's tokens); null =
    # token under async_steps, none without.
    rollout_is: Optional[str] = None
    # C truncates the weights at C (TIS); "lo_hi" zeroes those outside [lo, hi] (IcePop, e.g. 0.5_2.0).
    rollout_is_threshold: str = "2.0"
    # Divide the weights by their mean over the step (its tokens, or its sequences), every rank's.
    rollout_is_batch_normalize: bool = False
    # Reject tokens or sequences far from the sampler, comma-separated criteria that must all pass (quote a list on the
    # command line): token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3; null = none. A rejected
    # token leaves the loss and every normaliser, as a masked token does.
    rollout_rs: Optional[str] = None
    # One threshold for every criterion, or one each (comma-separated): k1 a ratio band "lo_hi" (one value u: 1/u_u), k2
    # and k3 an upper bound.
    rollout_rs_threshold: Optional[str] = None

    @staticmethod
    def check(c, async_steps: int = 0) -> None:
        need(c.rollout_is is None or c.rollout_is in LEVELS, "rollout.correction.rollout_is",
             f"must be null (token under rollout.async_steps, else none) or one of {', '.join(LEVELS)}, got "
             f"{c.rollout_is!r}")
        try:
            is_bounds(c.rollout_is_threshold)
        except ValueError as err:
            need(False, "rollout.correction.rollout_is_threshold", str(err))
        if c.rollout_rs is not None:
            try:
                rs_bounds(criteria_of(c.rollout_rs), c.rollout_rs_threshold)
            except ValueError as err:
                need(False, "rollout.correction.rollout_rs" if "criterion" in str(err) and "unknown" in str(err)
                     else "rollout.correction.rollout_rs_threshold", str(err))


def is_level(r) -> str:
    """The importance weights' level a run uses: ``rollout.correction.rollout_is``, or when it is null ``token``
    under rollout workers and ``none`` without."""
    level = r.correction.rollout_is
    if level is not None:
        return level
    return "token" if r.async_steps > 0 else "none"


def corrects(r) -> bool:
    """Whether the sampler's tokens are corrected at all: weighted or rejected."""
    return is_level(r) != "none" or bool(r.correction.rollout_rs)


@dataclass(frozen=True)
class Correction:
    """``rollout.correction`` parsed once: the weights' level and bounds (None at level ``none``), their batch
    normalisation, the rejection's criteria and each criterion's bounds. Raises ValueError naming what is wrong."""

    level: str
    bounds: Optional[Bounds]
    batch_normalize: bool
    criteria: tuple
    criteria_bounds: dict

    @classmethod
    def parse(cls, level: str, is_threshold, batch_normalize: bool, rollout_rs, rs_threshold) -> "Correction":
        criteria = criteria_of(rollout_rs)
        return cls(level, is_bounds(is_threshold) if level != "none" else None, bool(batch_normalize), tuple(criteria),
                   rs_bounds(criteria, rs_threshold) if criteria else {})

    @classmethod
    def of(cls, r) -> "Correction":
        """The rollout config ``r``'s correction."""
        c = r.correction
        return cls.parse(is_level(r), c.rollout_is_threshold, c.rollout_is_batch_normalize, c.rollout_rs,
                         c.rollout_rs_threshold)
