"""The embedded arithmetic task's binary reward and DAPO's overlong penalty.

Extraction and normalisation come from ``bicc.answers``: the last balanced ``\\boxed{...}`` (the one that
closes last, so an outer box wins over a box nested in it; an empty box counts), else the number right after
the last "The answer is"; else nothing.
"""

from __future__ import annotations

import torch

from bicc.answers import MAX_CHARS, extract_answer_number, last_boxed, normalize_answer


def extract_answer(text: str) -> str | None:
    text = text[-MAX_CHARS:]
    boxed = last_boxed(text)
    return boxed if boxed is not None else extract_answer_number(text)


def exact_match_reward(completion: str, ground_truth: str) -> float:
    """1.0 when the extracted final answer equals the ground truth after normalisation, else 0.0."""
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return float(normalize_answer(predicted) == normalize_answer(ground_truth))


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float):
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then falling linearly to -penalty at
    max_len: min(0, -(len - (max_len - buffer)) / buffer) * penalty. ``buffer = 0`` gives zeros."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    return (-(lengths.double() - (max_len - buffer)) / buffer).clamp(max=0) * penalty
