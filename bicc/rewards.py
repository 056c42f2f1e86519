"""Answer extraction and the binary reward.

Model outputs are untrusted text: extraction is a single linear scan (no backtracking regex over the
whole output, no eval), and inputs are capped at ``MAX_CHARS`` from the end, where the final answer is.

Extraction order: the last balanced ``\\boxed{...}`` (the one that closes last, so an outer box wins
over a box nested in it); else the last number after "The answer is"; else nothing.
"""

from __future__ import annotations

import re

import torch

MAX_CHARS = 20_000
_BOX_OR_BRACE = re.compile(r"\\boxed\s*\{|\{|\}")
_ANSWER_IS = re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...}, or None. Linear in len(text)."""
    stack: list[tuple[bool, int]] = []  # (opens a box?, index where the content starts)
    found: str | None = None
    for match in _BOX_OR_BRACE.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                is_box, start = stack.pop()
                if is_box:
                    found = text[start : match.start()]
        else:
            stack.append((token != "{", match.end()))
    return found


def extract_answer(text: str) -> str | None:
    text = text[-MAX_CHARS:]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = _ANSWER_IS.findall(text)
    return matches[-1] if matches else None


def normalize_answer(answer: str) -> str:
    """Canonical text for exact match: no spaces, '$' or trailing '.', integers without padding."""
    s = answer.strip().replace(" ", "").replace("$", "").rstrip(".")
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    if _NUMBER.fullmatch(s.replace(",", "")):
        s = s.replace(",", "")
        value = float(s)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return s


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
