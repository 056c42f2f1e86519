"""KV reuse: each distinct prefix (a prompt q, or a BiCC context x^c) computed once, its keys and values
read by every completion behind it (``bicc.kernels.packing.padding_free``: padding-free under a varlen kernel).

``encode_prefixes`` runs one forward over the distinct prefixes; ``completion_logprobs`` runs one forward over
the completions, each attending to its prefix's keys/values (gathered per completion, differentiably) and
causally to itself. Detached prefix states (``PrefixStates.backward``) let several micro-batches share one
prefix forward and send their gradients back through it once.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from bicc.kernels.packing import _ragged, padding_free
from bicc.machine.distributed import is_sharded
from bicc.model.logprobs import (
    at_least_fp32,
    attention_input,
    compute_precision,
    entropy_from_logits,
    forward_logprobs,
    host_tensor,
    logprobs_from_logits,
    on_device,
    reading_mask,
)


class _RecordLayer(DynamicLayer):
    """Prefix pass: keeps this layer's keys/values from the forward. The backward replay of a checkpointed layer
    (inside a backward pass) records nothing: the forward's are the ones the completions read, and keeping the
    replay's would hold its graph (the layer's recomputed norms and projections) until the whole backward ends,
    every layer's at once."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch._C._current_graph_task_id() == -1:  # not a replay inside the backward
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadLayer(DynamicLayer):
    """Padded completion pass: each completion attends to its prefix's keys/values, ``keys``/``values`` [U,
    kv_heads, W, d] of the distinct prefixes and ``index`` [n] each completion's row among them, then causally to
    itself. The rows are picked inside the layer's call (compiled, in the layer's graph: no copy per micro-batch
    outside it, and the gradient's scatter back to the prefixes runs in the layer's backward). Never changes the
    prefixes, so a checkpointed layer's replay reads exactly what its forward read."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True  # as lazy_initialization leaves it
        self.keys, self.values, self.index = keys, values, index

    def _read(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old.index_select(0, self.index), new], dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        return self._read(self.keys, key_states), self._read(self.values, value_states)


class _GatherLayer(_ReadLayer):
    """Padding-free completion pass: the keys/values each query sequence attends to, laid end to end: ``index``
    picks, from [every prefix's tokens; every completion's tokens], each completion's prefix and then its own
    tokens (replay-safe like ``_ReadLayer``)."""

    def _read(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old, new], dim=-2).index_select(-2, self.index)


@contextlib.contextmanager
def _cache_through_checkpointing(model):
    """Under activation checkpointing transformers drops a layer's cache (a writer would be updated twice
    by the replay); ours are replay-safe (``_RecordLayer`` overwrites, ``_ReadLayer`` only reads), so the
    decoder layers are told to keep it for the duration."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


@dataclass
class PrefixStates:
    """Distinct prefixes computed once: their keys/values and their last position's logits.

    keys, values:  per layer [U, kv_heads, W, head_dim], the prefixes left-padded to the longest (W); padding-free:
                   [1, kv_heads, sum of lengths, head_dim], the prefixes end to end
    mask:          [U, W] 1 on real prefix tokens; None when padding-free
    lengths:       [U] each prefix's tokens
    first_logits:  [U, V] the last position's logits: they predict the first token of every completion behind
    roots:         when computed with grad and detached (``encode_prefixes(..., detach=True)``), the tensors the
                   forward produced, in the order of ``leaves()``: ``backward()`` carries the gradient the
                   completions left on the detached copies back through the prefix forward
    """

    keys: list
    values: list
    mask: torch.Tensor | None
    lengths: list[int]
    first_logits: torch.Tensor
    roots: list | None = None

    def leaves(self) -> list:
        return [*self.keys, *self.values, self.first_logits]

    def backward(self) -> None:
        """One backward through the prefix forward, with the gradients accumulated on the detached copies."""
        if self.roots is None:
            return
        pairs = [(root, leaf.grad) for root, leaf in zip(self.roots, self.leaves()) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        self.roots = None


def encode_prefixes(model, prefixes: list[list[int]], pad_id: int, detach: bool = False) -> PrefixStates:
    """One forward over the distinct ``prefixes`` (left-padded, with a cache, keeping only the last position's
    logits). ``detach``: return detached copies that collect gradients (``PrefixStates.backward``), so that
    several completion forwards and backwards can share one prefix forward. Padding-free (``padding_free``):
    one sequence of all the prefixes' tokens, positions restarting at each."""
    device = next(model.parameters()).device
    lengths = [len(p) for p in prefixes]
    if padding_free(model):
        ids = host_tensor([t for p in prefixes for t in p], device)[None]  # [1, sum W]
        pos = on_device(torch.cat([torch.arange(n) for n in lengths]), device)[None]  # [1, sum W]
        last = host_tensor(lengths, device).cumsum(0) - 1  # [U]: each prefix's last token
        inputs = dict(input_ids=ids, position_ids=pos, logits_to_keep=last, **_ragged(lengths, lengths, device))
        mask = None
    else:
        width = max(lengths)
        ids = torch.tensor([[pad_id] * (width - len(p)) + [*p] for p in prefixes], dtype=torch.long)  # [U, W]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes], dtype=torch.long)  # [U, W]
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # [U, W]
        mask = on_device(mask, device)
        inputs = dict(input_ids=on_device(ids, device), attention_mask=attention_input(model, mask),
                      position_ids=on_device(pos, device), logits_to_keep=1)
    with _cache_through_checkpointing(model):
        cache = DynamicCache()
        cache.layer_class_to_replicate = _RecordLayer
        cache.bicc_record = True  # compiled layers (bicc.kernels.compile) record through their graph's outputs
        with compute_precision(model):
            logits = model(**inputs, past_key_values=cache, use_cache=True).logits
    first_logits = logits[0] if mask is None else logits[:, -1]  # [U, V]
    states = PrefixStates([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask,
                          lengths, first_logits)
    if not (detach and torch.is_grad_enabled()):
        return states
    roots = states.leaves()
    leaf = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
    return PrefixStates([leaf(k) for k in states.keys], [leaf(v) for v in states.values], mask, lengths,
                        leaf(states.first_logits), roots)


def completion_logprobs(model, states: PrefixStates, prefix_of: list[int], completions: list[list[int]], length: int,
                        pad_id: int, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs [n, length] (zeros past each output's end) of each completion after its prefix
    (``prefix_of[i]``: its row in ``states``). All completions go in one forward, each attending to its
    prefix's keys/values (gathered per completion, differentiably: the prefix receives the gradient of
    every completion behind it) and causally to itself; completions never meet in one attention matrix, so
    the cost is linear in the number of completions per prefix. Padding-free when ``states`` is."""
    device = states.first_logits.device
    index = host_tensor(prefix_of, device)  # [n]
    first = host_tensor([c[0] if c else pad_id for c in completions], device)  # [n]
    first_logits = states.first_logits.index_select(0, index)  # [n, V]: predicts each completion's first token
    if temperature != 1.0:
        first_logits = at_least_fp32(first_logits) / temperature
    first_logp = logprobs_from_logits(first_logits, first)  # [n]
    first_entropy = None
    if with_entropy:
        with torch.no_grad():
            first_entropy = entropy_from_logits(first_logits)
    rest = _ragged_rest if states.mask is None else _padded_rest
    return rest(model, states, index, completions, length, pad_id, temperature, with_entropy, first_logp, first_entropy)


def _padded_rest(model, states, index, completions, grid, pad_id, temperature, with_entropy, first_logp, first_entropy):
    """``completion_logprobs`` on left-padded prefixes: the completions right-padded to their longest, each
    reading a copy of its prefix's keys/values."""
    device = index.device
    # computed to the longest here; sharded, at least two wide: the model runs even when every output is one
    # token, so FSDP2 ranks gather (and reduce-scatter) every layer in step
    length = max(2 if is_sharded(model) else 1, min(grid, max(len(c) for c in completions)))
    # built as Python lists, one tensor each (not a copy per row: a few ops per row on the host, each launched)
    c_ids = host_tensor([[*c] + [pad_id] * (length - len(c)) for c in completions], device)  # [n, L]
    c_mask = host_tensor([[1] * len(c) + [0] * (length - len(c)) for c in completions], device)
    p_mask = states.mask[index]  # [n, W]
    c_pos = p_mask.sum(1)[:, None] + torch.arange(length, device=device)[None]  # [n, L]: after the real prefix
    if length > 1:
        with _cache_through_checkpointing(model):
            # each completion reads its prefix's keys/values [U, ...] (row ``index``), differentiably
            cache = DynamicCache()
            cache.layers = [_ReadLayer(k, v, index) for k, v in zip(states.keys, states.values)]
            cache.bicc_compile = True  # read-only: compiled layers (bicc.kernels.compile) take it
            mask = torch.cat([p_mask, c_mask[:, :-1]], dim=1)  # [n, W + L - 1]: the keys
            if model.config._attn_implementation == "sdpa":
                mask = reading_mask(mask, p_mask.shape[1])
            rest_logp, rest_entropy = forward_logprobs(
                model, c_ids[:, 1:], temperature, with_entropy, input_ids=c_ids[:, :-1], attention_mask=mask,
                position_ids=c_pos[:, :-1], past_key_values=cache, logits_to_keep=0)  # [n, L-1]
        logp = torch.cat([first_logp[:, None], rest_logp], dim=1)
        entropy = torch.cat([first_entropy[:, None], rest_entropy], dim=1) if with_entropy else None
    else:
        logp, entropy = first_logp[:, None], (first_entropy[:, None] if with_entropy else None)
    logp = torch.nn.functional.pad(logp * c_mask, (0, grid - length))  # [n, grid]
    if entropy is not None:
        entropy = torch.nn.functional.pad(entropy.detach() * c_mask, (0, grid - length))
    return logp, entropy


def _ragged_rest(model, states, index, completions, grid, pad_id, temperature, with_entropy, first_logp, first_entropy):
    """``completion_logprobs`` on prefixes laid end to end: every completion's tokens after its first as one
    sequence of their real tokens (queries), each completion's keys its prefix's and then its own."""
    device, n = index.device, len(completions)
    prefix_of = index.tolist()
    rows = [i for i, c in enumerate(completions) if c]  # where each value goes: its completion and token
    cols = [0] * len(rows)
    values = [first_logp[rows]]
    entropies = [first_entropy[rows]] if with_entropy else []
    seqs = [i for i, c in enumerate(completions) if len(c) > 1]  # completions with a token after their first
    queries = [completions[i] for i in seqs]
    stand_in = not seqs and is_sharded(model)  # every output one token, sharded: the model still runs, on a pad
    if stand_in:  # token after the first prefix, so FSDP2 ranks gather every layer in step
        seqs, queries = [0], [[pad_id, pad_id]]
    if seqs:
        rest_logp, rest_entropy = _ragged_forward(model, states, [prefix_of[i] for i in seqs], queries, temperature,
                                                  with_entropy, device)
        if stand_in:  # in the graph times zero: the backward reaches every layer too
            values[0] = values[0] + 0.0 * rest_logp.sum()
        else:
            values.append(rest_logp)
            entropies += [rest_entropy] if with_entropy else []
            rows += [i for i, q in zip(seqs, queries) for _ in range(len(q) - 1)]
            cols += [t for q in queries for t in range(1, len(q))]
    at = (host_tensor(rows, device), host_tensor(cols, device))
    logp = first_logp.new_zeros(n, grid).index_put(at, torch.cat(values))  # [n, grid]
    entropy = first_logp.new_zeros(n, grid).index_put(at, torch.cat(entropies).detach()) if with_entropy else None
    return logp, entropy


def _ragged_forward(model, states, prefix_of, queries, temperature, with_entropy, device):
    """Log-probs [sum q] of each query's tokens after its first, every query one ragged sequence reading its
    prefix's keys (``prefix_of``) and then its own."""
    q_len = [len(q) - 1 for q in queries]
    p_start = [0, *itertools.accumulate(states.lengths)]  # each prefix's first token among all of theirs
    q_start = [0, *itertools.accumulate(q_len)]
    index_k = on_device(torch.cat([torch.cat([torch.arange(p_start[p], p_start[p + 1]),
                                              p_start[-1] + torch.arange(q_start[j], q_start[j + 1])])
                                   for j, p in enumerate(prefix_of)]), device)  # [sum(W_i + q_i)]
    as_row = lambda xs: host_tensor(xs, device)[None]  # noqa: E731
    ids = as_row([t for q in queries for t in q[:-1]])  # [1, sum q]
    targets = as_row([t for q in queries for t in q[1:]])  # [1, sum q]
    pos = as_row([states.lengths[p] + t for p, q in zip(prefix_of, q_len) for t in range(q)])
    k_len = [states.lengths[p] + q for p, q in zip(prefix_of, q_len)]
    with _cache_through_checkpointing(model):
        cache = DynamicCache()
        cache.layers = [_GatherLayer(k, v, index_k) for k, v in zip(states.keys, states.values)]
        cache.bicc_compile = True  # read-only: compiled layers (bicc.kernels.compile) take it
        logp, entropy = forward_logprobs(model, targets, temperature, with_entropy, input_ids=ids, position_ids=pos,
                                         past_key_values=cache, logits_to_keep=0, **_ragged(q_len, k_len, device))
    return logp[0], (entropy[0] if with_entropy else None)


class OneLayer:
    """For a compiled layer (``bicc.kernels.compile``): layer ``index`` of a read-only KV-reuse cache, as that layer's
    attention uses it: ``update`` with the layer's number ignored (the graph never indexes the cache by it);
    anything else is the whole cache's."""

    def __init__(self, cache, index: int):
        self.layer, self.cache = cache.layers[index], cache

    def update(self, key_states, value_states, *args, **kwargs):
        return self.layer.update(key_states, value_states)

    def __getattr__(self, name):
        return getattr(self.cache, name)


class Recorder(OneLayer):
    """For a compiled layer: layer ``index`` of the prefix pass's recording cache (``bicc_record``): the graph hands
    its keys/values out through a list, and the layer's own ``update`` keeps them after the call, outside the graph
    (nothing in a checkpoint's replay, which usually ends inside the call). A replay thus runs the very graph its
    forward ran."""

    def __init__(self, cache, index: int):
        while len(cache.layers) <= index:  # the cache makes its layers on their first update
            cache.layers.append(cache.layer_class_to_replicate())
        super().__init__(cache, index)
        self.seen = []

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen.append((key_states, value_states))
        return key_states, value_states

    def keep(self):
        for keys, values in self.seen:
            self.layer.update(keys, values)
