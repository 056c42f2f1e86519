"""Answer extraction and normalisation: the one stack that rewards, evaluation and BiCC's truncation use.

Model outputs are untrusted text: every extractor is a linear scan (no backtracking regex over the whole
output, no eval), over at most ``MAX_CHARS`` characters from the end of the output, where the final answer
is. Extractors are registered by name (``EXTRACTORS``); a dataset names an ordered list of them and the first
that finds something wins (``extract``). ``ANSWER_ANCHORS``: the text that starts each extractor's final
answer, which BiCC's middle truncation keeps.

Two normal forms: ``canonical`` (math answers: wrappers and spacing removed, fractions spelled one way,
thousands separators only where they belong, integers without padding), which the checker's exact path
compares before math-verify; and ``normalize_answer`` (the embedded arithmetic task's exact match: spaces,
``$`` and every comma of a number dropped).
"""

from __future__ import annotations

import math
import re

from bicc.registry import Registry

MAX_CHARS = 20_000
EXTRACTORS: Registry = Registry("answer extractor")
_BOX_OR_BRACE = re.compile(r"\\boxed\s*\{|\{|\}")


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


@EXTRACTORS.register("boxed")
def extract_boxed(text: str) -> str | None:
    """The last balanced ``\\boxed{...}`` (``\\fbox`` too)."""
    return last_boxed(text.replace("\\fbox{", "\\boxed{"))


_ANSWER_IS = re.compile(r"(?:[Tt]he )?(?:final )?answer is:?\s*")


@EXTRACTORS.register("answer_is")
def extract_answer_is(text: str) -> str | None:
    """What follows the last "The answer is", up to the end of its line or sentence."""
    last = None
    for last in _ANSWER_IS.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end() : last.end() + 200].split("\n", 1)[0].strip()
    rest = re.sub(r"\.\s*$|\.\s+[A-Z].*$", "", rest).strip()
    return rest.strip("$ ") or None


_ANSWER_NUMBER = re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


@EXTRACTORS.register("answer_number")
def extract_answer_number(text: str) -> str | None:
    """The number right after the last "The answer is" (the arithmetic task's fallback)."""
    found = _ANSWER_NUMBER.findall(text)
    return found[-1] if found else None


_ANSWER_LINE = re.compile(r"(?:^|\n)[ \t*]*Answer:[ \t*]*([^\n]*)")


@EXTRACTORS.register("answer_line")
def extract_answer_line(text: str) -> str | None:
    """The last line of the form ``Answer: X`` (the DAPO-Math-17k instruction)."""
    found = _ANSWER_LINE.findall(text[-4000:])
    return (found[-1].strip().strip("$ ").strip() or None) if found else None


_HASHES = re.compile(r"####\s*([^\n]*)")
_A_COLON = re.compile(r"(?:^|\n)[ \t]*A:\s*([^\n]*)")  # [ \t]* before A:, not \s*: that re-scanned newline runs
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@EXTRACTORS.register("gsm8k")
def extract_gsm8k(text: str) -> str | None:
    """GSM8K's formats: the last ``#### x``, else the last ``A: x`` line; the first number in it."""
    for pattern in (_HASHES, _A_COLON):
        found = pattern.findall(text)
        if found:
            number = _NUMBER.search(found[-1])
            return number.group().replace("$", "") if number else found[-1].strip() or None
    return None


@EXTRACTORS.register("last_number")
def extract_last_number(text: str) -> str | None:
    """The last number in the text (a weak fallback)."""
    found = _NUMBER.findall(text)
    return found[-1].replace("$", "") if found else None


# Text that starts the final answer each extractor reads, so that BiCC's middle truncation keeps it.
ANSWER_ANCHORS = {"boxed": "\\boxed", "answer_is": "answer is", "answer_number": "answer is", "answer_line": "Answer:",
                  "gsm8k": "####"}


def answer_anchors(extractors) -> tuple[str, ...]:
    """The anchors of ``extractors`` in their order (``last_number`` has none)."""
    return tuple(ANSWER_ANCHORS[name] for name in extractors if name in ANSWER_ANCHORS)


def extract(text: str, extractors) -> str | None:
    """The first non-empty answer that ``extractors`` (names, in order) find in the end of ``text``."""
    text = text[-MAX_CHARS:]
    for name in extractors:
        found = EXTRACTORS.get(name)(text)
        if found is not None and found.strip():
            return found.strip()
    return None


# ---- fast path: canonical text ----------------------------------------------------------------
_STRIP = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\displaystyle", "^\\circ", "^{\\circ}", "\\%", "%",
          "\\$", "$", " ", "\n", "\t"]
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_NUMBER = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")


def canonical(answer: str) -> str:
    """Light, purely textual normalisation: wrappers and spacing removed, fractions spelled one way,
    integers without padding."""
    s = answer.strip()
    s = _TEXT_WRAP.sub(r"\1", s)
    for token in _STRIP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.rstrip(".")
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _PLAIN_NUMBER.match(s):
        value = float(s)
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return s


def balanced(answer: str) -> bool:
    """Whether the braces of ``answer`` close in order (escaped ``\\{`` ``\\}`` aside): an unclosed ``\\boxed{42``
    is a malformed answer, not 42."""
    depth = 0
    for brace in _BRACE.finditer(answer):
        depth += 1 if brace.group() == "{" else -1
        if depth < 0:
            return False
    return depth == 0


_BRACE = re.compile(r"(?<!\\)[{}]")


def number_of(s: str) -> float | None:
    return float(s) if _PLAIN_NUMBER.match(s) else None


_ARITH_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def normalize_answer(answer: str) -> str:
    """Canonical text for exact match: no spaces, '$' or trailing '.', integers without padding."""
    s = answer.strip().replace(" ", "").replace("$", "").rstrip(".")
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    if _ARITH_NUMBER.fullmatch(s.replace(",", "")):
        s = s.replace(",", "")
        value = float(s)
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return repr(value)
    return s
