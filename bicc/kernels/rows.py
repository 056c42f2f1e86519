"""The rows a log-prob pass is evaluated on: the plain prompt q or the conditioned prompt x^c.

``query_rows`` gives the rows on q: ``QueryRows`` (one padded row per output) or, with ``train.share_prompts``,
``ContextRows`` over q, each prompt computed once for its G outputs. ``ContextRows`` on x^c gives BiCC's rows,
one row per output or packed behind shared prefixes (``bicc.kernels.packing``). The trainable numerator of a base
variant reads the rows on q, BiCC's the rows on x^c; the no-grad passes take theirs from the same places
(``bicc.trainer.plan``): pi_old and pi_ref on q, pi_old on x^c (``bicc.old_on_context``) and RCC's delta on x^c.

Both offer ``logprobs(model, rows, temperature, with_entropy)`` returning [len(rows), L] log-probs (and
entropies) aligned with the plain batch's completion grid, zero past each output; ``contexts_once(model,
rows)``: a context manager inside which what rows share is computed once (contexts or shared prompts under KV reuse;
nothing for ``QueryRows``); ``tokens``: how many tokens one forward over all rows processes; and ``lengths``
[N, 2]: the prompt (or context) and output tokens each row adds to its micro-batch, which length-aware
micro-batches plan on (``bicc.kernels.batching``; 0 for a context that ``contexts_once`` computes apart); ``kv``:
whether the rows go through KV reuse (``bicc.kernels.prefix_cache.encode_prefixes``), the forwards that can be padding-free.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from bicc.kernels.batching import to_grid, trim_rows
from bicc.kernels.packing import pack, packed_logprobs
from bicc.kernels.prefix_cache import completion_logprobs, encode_prefixes
from bicc.method.conditioning import ConditionedPrompts
from bicc.model.logprobs import TokenBatch, batch_logprobs, make_token_batch, on_device


class QueryRows:
    kv = False  # one padded row per output

    def __init__(self, batch: TokenBatch):
        self.batch = batch
        out = batch.completion_mask.sum(-1)
        self.lengths = torch.stack([batch.attention_mask.sum(-1) - out, out], -1).cpu()  # [N, 2]: prompt, output
        self.tokens = int(self.lengths.sum())

    def logprobs(self, model, rows, temperature: float, with_entropy: bool = False):
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        widths = self.lengths[rows].amax(0).tolist() if len(rows) else (0, 1)  # on the host: no read of the GPU
        return trimmed_logprobs(model, self.batch.rows(on_device(rows, self.batch.input_ids.device)), temperature,
                                with_entropy, widths)

    def contexts_once(self, model, rows):
        return contextlib.nullcontext()  # nothing shared between rows


def trimmed_logprobs(model, batch: TokenBatch, temperature: float, with_entropy: bool, widths=None, device=None):
    """``batch_logprobs`` over the rows' own columns only (``trim_rows``; ``widths`` as there), back on the batch's
    grid. ``device``: where the trimmed rows go (host rows are trimmed on the host, then sent)."""
    part = trim_rows(batch, widths)
    part = part if device is None else part.to(device)
    logp, entropy = batch_logprobs(model, part, temperature, with_entropy)
    length = batch.completion_len
    return to_grid(logp, part.completion_mask, length), to_grid(entropy, part.completion_mask, length)


def step_rows(batch: TokenBatch, out, contexts: ConditionedPrompts | None, train, pad_id: int) -> dict:
    """The rows a step's passes read: {"q": on q (``query_rows``), "xc": on x^c (``ContextRows`` over ``contexts``; q's
    with BiCC off)}. ``out``: the rollout's ``RolloutOutput``; ``train``: what ``Packing`` reads."""
    device = batch.input_ids.device
    plain = query_rows(batch, out.prompt_ids, out.completion_ids, train.share_prompts, pad_id, device)
    return {"q": plain, "xc": plain if contexts is None else ContextRows(contexts, out.completion_ids, batch.completion_len,
                                                                         train, pad_id, device)}


def query_rows(batch: TokenBatch, prompt_ids: list[list[int]], completion_ids: list[list[int]], share: bool,
               pad_id: int, device: torch.device):
    """The rows on q. ``share`` (``train.share_prompts``): each distinct prompt is computed once per step and its
    G outputs read its keys/values (``ContextRows`` under KV reuse, every row's "context" being its own q), so
    the prompt's tokens cost one forward and one backward per step instead of G; else ``QueryRows``."""
    if not share:
        return QueryRows(batch)
    keys: dict[tuple, int] = {}
    key = [keys.setdefault(tuple(p), len(keys)) for p in prompt_ids]
    on_q = ConditionedPrompts([list(p) for p in prompt_ids], key, torch.zeros(len(key), dtype=torch.bool))
    return ContextRows(on_q, completion_ids, batch.completion_len, KV_REUSE, pad_id, device)


@dataclass(frozen=True)
class Packing:
    """What ``ContextRows`` reads of ``cfg.train``: whether and how rows behind one prefix share it."""

    context_packing: bool = True
    context_packing_impl: str = "kv"
    max_packed_len: int = 4096


KV_REUSE = Packing(context_packing=True, context_packing_impl="kv", max_packed_len=0)  # max_packed_len: mask packing only


class ContextRows:
    def __init__(self, contexts: ConditionedPrompts, completion_ids: list[list[int]], length: int, packing,
                 pad_id: int, device: torch.device):
        self.contexts, self.completion_ids, self.length = contexts, completion_ids, length
        self.packing, self.max_packed_len = packing.context_packing, packing.max_packed_len
        self.packing_impl = packing.context_packing_impl
        self.pad_id, self.device = pad_id, device
        completion_tokens = sum(map(len, completion_ids))
        self.kv = self.packing and self.packing_impl == "kv"
        # KV reuse computes the contexts apart from the micro-batches (``contexts_once``): plan on outputs alone
        self.lengths = torch.tensor([[0 if self.kv else len(p), len(c)]
                                     for p, c in zip(contexts.prompt_ids, completion_ids)])
        self._shared = None  # (PrefixStates, {context key: its row there}) inside ``contexts_once``
        if self.packing:  # each distinct prefix once (ignoring splits of over-long packs)
            prefixes = {k: len(p) for k, p in zip(contexts.context_key, contexts.prompt_ids)}
            self.tokens = sum(prefixes.values()) + completion_tokens
        else:
            self.tokens = sum(map(len, contexts.prompt_ids)) + completion_tokens

    def logprobs(self, model, rows, temperature: float, with_entropy: bool = False):
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if not self.packing:
            return self._rows(model, rows, temperature, with_entropy)
        if self.kv:  # each distinct prefix once, its keys/values reused by its outputs
            states, slot = self._shared or self._encode(model, rows, detach=False)
            return completion_logprobs(model, states, [slot[self.contexts.context_key[r]] for r in rows],
                                       [self.completion_ids[r] for r in rows], self.length, self.pad_id,
                                       temperature, with_entropy)
        # Only prefixes shared within this micro-batch gain from packing; the rest go as plain rows.
        counts: dict[int, int] = {}
        for r in rows:
            counts[self.contexts.context_key[r]] = counts.get(self.contexts.context_key[r], 0) + 1
        shared = [i for i, r in enumerate(rows) if counts[self.contexts.context_key[r]] > 1]
        single = [i for i, r in enumerate(rows) if counts[self.contexts.context_key[r]] == 1]
        if not shared:
            return self._rows(model, rows, temperature, with_entropy)
        packed = pack([self.contexts.prompt_ids[rows[i]] for i in shared], [self.contexts.context_key[rows[i]] for i in shared],
                      [self.completion_ids[rows[i]] for i in shared], self.max_packed_len, self.pad_id).to(self.device)
        logp, entropy = packed_logprobs(model, packed, len(shared), self.length, temperature, with_entropy)
        if not single:
            return logp, entropy
        logp_single, entropy_single = self._rows(model, [rows[i] for i in single], temperature, with_entropy)
        order = on_device(torch.tensor(shared + single).argsort(), logp.device)  # back to the caller's row order
        logp = torch.cat([logp, logp_single])[order]
        entropy = torch.cat([entropy, entropy_single])[order] if with_entropy else None
        return logp, entropy

    @contextlib.contextmanager
    def contexts_once(self, model, rows):
        """Under KV reuse: inside, every distinct context of ``rows`` is computed once (one forward) and each
        ``logprobs`` call reads its keys/values, so a context costs one forward per step however its outputs
        are cut into micro-batches. With grad enabled, each micro-batch's backward leaves its share of the
        gradient on the contexts' keys/values, and leaving runs one backward through the context forward (so
        the gradient is complete on exit, before clipping). An exception inside drops the contexts' graph.
        Other packings: a no-op. (The contexts' activations are held until exit: one forward's worth of
        context tokens, on top of a micro-batch's.)"""
        if not self.kv:
            yield
            return
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        self._shared = self._encode(model, rows or [0], detach=True)  # no rows: the first context, for collectives
        try:
            yield
            self._shared[0].backward()
        finally:
            self._shared = None

    def _encode(self, model, rows: list[int], detach: bool):
        """``PrefixStates`` of the distinct contexts of ``rows``, and each context key's row in them."""
        slot: dict[int, int] = {}
        prefixes = []
        for r in rows:
            key = self.contexts.context_key[r]
            if key not in slot:
                slot[key] = len(prefixes)
                prefixes.append(self.contexts.prompt_ids[r])
        return encode_prefixes(model, prefixes, self.pad_id, detach), slot

    def _rows(self, model, rows: list[int], temperature: float, with_entropy: bool):
        """One row per output: [left-padded x^c; right-padded output]."""
        prefixes = [self.contexts.prompt_ids[r] for r in rows]
        completions = [self.completion_ids[r] for r in rows]
        batch = make_token_batch(prefixes, completions, self.pad_id, length=self.length)
        widths = (max(map(len, prefixes)), max(map(len, completions)))
        return trimmed_logprobs(model, batch, temperature, with_entropy, widths, self.device)
