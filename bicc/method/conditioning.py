"""Bilateral Context Conditioning: partition each group by reward, and build for every sample the
prompt x^c that shows it the opposite partition's attempts under a token budget.

x+ = [q; O-] for correct outputs and x- = [q; O+] for incorrect ones. The attempts go inside the user
turn, after the problem and a short neutral preamble, before the assistant turn opens; the sampled
output that follows keeps exactly its sampled token ids. Contexts are built at the token level (the
attempts are the sampled ids themselves), so the budget is exact.

Budget: the attempts of one context take at most floor(context_ratio * max_tokens) tokens together,
shared max-min fairly (short attempts keep all their tokens, the rest split what is left). An attempt
longer than its share is cut (``truncate``): ``middle`` keeps its head and its final answer with an
elision marker between, ``head`` keeps the head, ``tail`` keeps the end. An attempt whose share is below
``min_attempt_tokens`` (or whose final answer alone does not fit) is dropped, not cut further.

Matching (``mode``): ``partition`` (the paper's Algorithm 1) shows every sample the whole opposite
partition, so all samples of a partition share one prefix (which packing exploits); ``paired`` shows
each sample ``paired_k`` opposite attempts assigned round-robin, reusing minority attempts; ``last`` shows
each sample one: the last of the opposite partition in group order (the released code's, where each later
pair overwrites the one before). ``truncate=none`` shows attempts whole, with no budget.
A group whose partition is empty keeps the plain prompt q (BiCC falls back to the base variant).

Layout (``layout``): ``paper`` as above; ``released`` (the released code's) places the attempts after the
templated prompt q, its assistant turn already open, each after the separator token ``separator_id``, with one
more separator before the output: [q; sep; o_opp; sep] (the attempt keeps its end token; no preamble, header or
elision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bicc.data import encode_prompt

SENTINEL = "\x00ATTEMPTS\x00"


@dataclass
class ConditionedPrompts:
    """The conditioned prompt of every sample.

    prompt_ids:  N lists of ids: x^c (or the plain prompt q where the group fell back)
    context_key: N ints; samples with equal keys have identical ``prompt_ids`` (a shareable prefix)
    conditioned: [N] bool, True where the sample sees opposite attempts
    metrics:     ``bicc/`` diagnostics of the build
    shown:       N lists: the rows whose attempts the sample's context shows, in order (empty on q)
    cut:         N lists: those of them shown truncated (the middle cut, the final answer kept)
    """

    prompt_ids: list[list[int]]
    context_key: list[int]
    conditioned: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    shown: list = field(default_factory=list)
    cut: list = field(default_factory=list)


def partition(correct: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """Boolean mask of O+ (correct) samples. Rewards must be exactly 0 or 1 unless a threshold is set."""
    if threshold is None:
        bad = ~((correct == 0) | (correct == 1))
        if bad.any():
            raise ValueError(f"BiCC partitions on binary rewards, got {correct[bad][:5].tolist()}; "
                             "set bicc.reward_threshold to partition non-binary rewards")
        return correct == 1
    return correct >= threshold


def positives(ro, rule: str, threshold: float | None) -> torch.Tensor:
    """O+ [N] bool by ``algo.partition``, the one partition BiCC's contexts and an advantage that reads one (src)
    share: ``correct``, the task's verdict r = 1 (the paper's; ``bicc.reward_threshold`` for non-binary verdicts);
    ``reward``, the shaped reward ``ro.rewards`` above 0.5 (the released code's rule: a correct output the overlong
    penalty takes to 0.5 or below is on the wrong side)."""
    return ro.rewards > 0.5 if rule == "reward" else partition(ro.correct, threshold)


def fair_shares(lengths: list[int], budget: int) -> list[int]:
    """Max-min fair integer split of ``budget`` over items wanting ``lengths``; sum <= budget, and
    == budget whenever the items want more than it."""
    shares = [0] * len(lengths)
    remaining, left = budget, len(lengths)
    for order, i in enumerate(sorted(range(len(lengths)), key=lambda j: lengths[j])):
        share = remaining // left
        if lengths[i] <= share:
            shares[i] = lengths[i]
        else:  # every item from here on wants at least `share`: split the rest evenly, remainder first
            rest = sorted(range(len(lengths)), key=lambda j: lengths[j])[order:]
            base, extra = divmod(remaining, left)
            for k, j in enumerate(rest):
                shares[j] = min(lengths[j], base + (1 if k < extra else 0))
            return shares
        remaining -= shares[i]
        left -= 1
    return shares


DEFAULT_ANCHORS = ("\\boxed", "answer is")


def answer_start(ids: list[int], tokenizer, anchors=DEFAULT_ANCHORS) -> int:
    """Index of the first token of the final answer: the shortest suffix whose text contains the last
    anchor, and the line break before it when the anchor starts a line (so an ``Answer:`` line stays a line after
    the elision marker). Binary search over suffixes (O(log n) decodes). ``len(ids)`` when there is no anchor."""
    text = tokenizer.decode(ids)
    anchor = next((a for a in anchors if a in text), None)
    if anchor is None:
        return len(ids)
    lo, hi = 0, len(ids)  # invariant: suffix ids[lo:] contains the anchor, ids[hi:] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if anchor in tokenizer.decode(ids[mid:]):
            lo = mid
        else:
            hi = mid
    if lo > 0 and "\n" in (before := tokenizer.decode(ids[lo - 1:lo])) and not before.strip():
        lo -= 1
    return lo


def truncate(ids: list[int], keep: int, how: str, elision: list[int], ans_start: int, min_tokens: int) -> list[int] | None:
    """``ids`` cut to at most ``keep`` tokens (elision marker included), or None when dropped; whole under
    ``how="none"``."""
    if len(ids) <= keep or how == "none":
        return ids
    if keep < min_tokens:
        return None
    if how == "head":
        return ids[:keep]
    if how == "tail":
        return elision + ids[len(ids) - (keep - len(elision)):] if keep > len(elision) else None
    tail = ids[ans_start:]
    head_len = keep - len(elision) - len(tail)
    if head_len < 0 or head_len + len(tail) == 0:
        return None  # the final answer does not fit, or nothing but the marker would: drop rather than lose it
    return ids[:head_len] + elision + tail


@dataclass
class _Encoded:
    """Template pieces as token ids."""

    head: list[int]
    tail: list[int]
    preamble: list[int]
    elision: list[int]
    headers: list[list[int]]


def _encode_template(tokenizer, prompt: str, bicc_cfg, max_attempts: int) -> _Encoded:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt + SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
    head_text, tail_text = rendered.split(SENTINEL)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return _Encoded(enc(head_text), enc(tail_text), enc(bicc_cfg.preamble), enc(bicc_cfg.elision),
                    [enc(bicc_cfg.attempt_header.format(i=i + 1)) for i in range(max_attempts)])


def _released_template(prompt_ids: list[int], bicc_cfg, max_attempts: int) -> _Encoded:
    """The released layout as template pieces: q (the templated prompt) first, each attempt after a separator,
    one more separator last."""
    sep = [bicc_cfg.separator_id]
    return _Encoded(list(prompt_ids), sep, [], [], [sep] * max_attempts)


def context_budget(bicc_cfg, max_tokens: int | None = None) -> int:
    """Tokens the attempts of one context share: floor(context_ratio x max tokens), the max tokens being
    ``bicc.max_tokens`` unless given; under ``truncate=none`` (attempts whole) the most its attempts can hold:
    max tokens x the attempts one context shows (1 under ``mode=last``, ``paired_k`` under ``paired``)."""
    tokens = bicc_cfg.max_tokens if max_tokens is None else max_tokens
    if bicc_cfg.truncate == "none":
        return tokens * (1 if bicc_cfg.mode == "last" else bicc_cfg.paired_k)
    return int(bicc_cfg.context_ratio * tokens)


def build_contexts(prompts: list[str], completion_ids: list[list[int]], correct: torch.Tensor,
                   group_ids: torch.Tensor, tokenizer, bicc_cfg, max_tokens: int,
                   plain_prompt_ids: list[list[int]], end_ids=None, anchors=DEFAULT_ANCHORS) -> ConditionedPrompts:
    """x^c for every sample. ``correct``: each sample's verdict (0/1; others by ``bicc.reward_threshold``), or O+
    itself as a bool mask (``positives``). ``prompts`` holds the user-turn text of each sample's query (per sample),
    ``plain_prompt_ids`` the ids of q used where a group falls back. ``end_ids``: the tokens that end an
    output (default the tokenizer's EOS), stripped from attempts shown in a context. ``anchors``: text that
    starts a final answer (the task's extractors'), kept by middle truncation.

    A group is conditioned whole or not at all: when every attempt of one side is dropped (so some of its
    samples would see attempts and others not, ratios w and 1 in one group), the whole group keeps q."""
    positive = correct if correct.dtype == torch.bool else partition(correct, bicc_cfg.reward_threshold)
    budget = context_budget(bicc_cfg, max_tokens)
    end = set(end_ids or [tokenizer.eos_token_id])
    released = bicc_cfg.layout == "released"  # the attempt as sampled, its end token kept
    attempts = [list(ids) if released or not (ids and ids[-1] in end) else ids[:-1] for ids in completion_ids]
    n = len(completion_ids)
    out_ids: list[list[int]] = [list(p) for p in plain_prompt_ids]
    keys = list(range(n))  # unconditioned samples: unique keys (their q prefix is not shared in packing)
    conditioned = torch.zeros(n, dtype=torch.bool)
    shown, whole = torch.zeros(n), torch.zeros(n)
    stats = {"groups": 0, "groups_conditioned": 0, "groups_dropped": 0, "attempts": 0, "truncated": 0, "dropped": 0,
             "context_tokens": 0, "contexts": 0}
    cache: dict[tuple, tuple] = {}
    shown_rows: list[list[int]] = [[] for _ in range(n)]
    cut_rows: list[list[int]] = [[] for _ in range(n)]
    next_key = n
    for g in torch.unique(group_ids).tolist():
        rows = (group_ids == g).nonzero().flatten().tolist()
        stats["groups"] += 1
        pos = [r for r in rows if positive[r]]
        neg = [r for r in rows if not positive[r]]
        if not pos or not neg:
            continue
        enc = (_released_template(plain_prompt_ids[rows[0]], bicc_cfg, max(len(pos), len(neg))) if released
               else _encode_template(tokenizer, prompts[rows[0]], bicc_cfg, max(len(pos), len(neg))))
        assigned = {}
        for side, opposite in ((pos, neg), (neg, pos)):
            for j, r in enumerate(side):
                if bicc_cfg.mode == "partition":
                    chosen = tuple(opposite)
                elif bicc_cfg.mode == "last":
                    chosen = (opposite[-1],)
                else:
                    k = min(bicc_cfg.paired_k, len(opposite))
                    chosen = tuple(opposite[(j * k + t) % len(opposite)] for t in range(k))
                if chosen not in cache:
                    ids, used, kept, cut = _render(enc, [attempts[o] for o in chosen], budget, bicc_cfg, tokenizer,
                                                   stats, anchors)
                    cache[chosen] = (ids, next_key, [chosen[c] for c in kept], [chosen[c] for c in cut])
                    next_key += 1
                    stats["context_tokens"] += used
                    stats["contexts"] += 1
                assigned[r] = cache[chosen]
        if any(ids is None for ids, _, _, _ in assigned.values()):  # some sample would keep q: the group keeps q
            stats["groups_dropped"] += 1
            continue
        stats["groups_conditioned"] += 1
        for r, (ids, key, kept, cut) in assigned.items():
            out_ids[r], keys[r], conditioned[r], shown[r], whole[r] = ids, key, True, len(kept), len(kept) - len(cut)
            shown_rows[r], cut_rows[r] = kept, cut
    metrics = {
        "bicc/groups_conditioned_share": stats["groups_conditioned"] / max(1, stats["groups"]),
        "bicc/groups_dropped_share": stats["groups_dropped"] / max(1, stats["groups"]),
        "bicc/samples_conditioned_share": conditioned.float().mean().item(),
        "bicc/attempts_shown": shown[conditioned].mean().item() if conditioned.any() else 0.0,
        "bicc/whole_attempts_shown": whole[conditioned].mean().item() if conditioned.any() else 0.0,
        "bicc/context_tokens": stats["context_tokens"] / max(1, stats["contexts"]),
        "bicc/context_budget_used": stats["context_tokens"] / max(1, stats["contexts"] * budget),
        "bicc/truncated_share": stats["truncated"] / max(1, stats["attempts"]),
        "bicc/dropped_share": stats["dropped"] / max(1, stats["attempts"]),
    }
    return ConditionedPrompts(out_ids, keys, conditioned, metrics, shown_rows, cut_rows)


def _render(enc: _Encoded, chosen: list[list[int]], budget: int, bicc_cfg, tokenizer, stats,
            anchors=DEFAULT_ANCHORS) -> tuple[list[int] | None, int, list[int], list[int]]:
    """Context ids for the chosen attempts, the attempt tokens used (elision markers included), and which of
    ``chosen`` are shown and which of those cut (indices); ids None when no attempt fits. Attempts that would fall
    below the minimum length are dropped one at a time (latest first) and the budget re-shared among the rest."""
    starts = [answer_start(a, tokenizer, anchors) if bicc_cfg.truncate == "middle" else len(a) for a in chosen]
    candidates = list(range(len(chosen)))
    stats["attempts"] += len(chosen)
    while candidates:
        shares = fair_shares([len(chosen[c]) for c in candidates], budget)
        cuts = [truncate(chosen[c], share, bicc_cfg.truncate, enc.elision, starts[c], bicc_cfg.min_attempt_tokens)
                for c, share in zip(candidates, shares)]
        failed = [i for i, cut in enumerate(cuts) if cut is None]
        if not failed:
            break
        candidates.pop(failed[-1])
        stats["dropped"] += 1
    if not candidates:
        return None, 0, [], []
    body: list[int] = []
    truncated = [c for c, cut in zip(candidates, cuts) if cut != chosen[c]]
    stats["truncated"] += len(truncated)
    for shown, cut in enumerate(cuts):
        body += enc.headers[shown] + cut
    return enc.head + enc.preamble + body + enc.tail, sum(len(cut) for cut in cuts), candidates, truncated


def render_context(tokenizer, prompt: str, attempts: list[list[int]], bicc_cfg, budget: int,
                   anchors=DEFAULT_ANCHORS) -> list[int] | None:
    """The prompt ``prompt`` with ``attempts`` (token ids) shown under the BiCC template and budget, as
    build_contexts renders them (in ``bicc.layout``); None when no attempt fits. Used to show warm starts such prompts."""
    if bicc_cfg.layout == "released":
        enc = _released_template(encode_prompt(tokenizer, prompt), bicc_cfg, len(attempts))
    else:
        enc = _encode_template(tokenizer, prompt, bicc_cfg, len(attempts))
    stats = {"attempts": 0, "dropped": 0, "truncated": 0}
    return _render(enc, attempts, budget, bicc_cfg, tokenizer, stats, anchors)[0]


def template_prompt(tokenizer, prompt: str, bicc_cfg) -> list[int]:
    """The BiCC template around ``prompt`` with no attempts in it (the probe's template-only placebo)."""
    enc = _encode_template(tokenizer, prompt, bicc_cfg, 0)
    return enc.head + enc.preamble + enc.tail
