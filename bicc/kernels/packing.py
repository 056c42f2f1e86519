"""Shared-prefix packing: several outputs behind one prefix in one row, so the prefix is computed once.

A packed row is [prefix; o_1; ...; o_k]. Its 4-D attention mask lets every o_j attend to the prefix and
causally to itself, never to another o_i; position ids restart after the prefix for each o_j, so each
o_j sees exactly the positions it would in its own row [prefix; o_j]. The first token of every o_j is
predicted from the prefix's last position, the rest from o_j's own previous position. Rows longer than
``max_len`` are split (each piece repeats the prefix).

The mask goes to SDPA as a bool mask (True = attend); eager attention gets the additive float form.
flash-attn has no 4-D mask (it would read one as padding and attend across outputs), so packed rows
refuse it: under flash_attention_2 BiCC uses KV reuse (``bicc.kernels.prefix_cache``, ``train.context_packing_impl=kv``).

Padding-free forwards. Under a kernel that takes ragged sequences (``VARLEN_ATTENTION``: flash-attn's
varlen path, through transformers' ``cu_seq_lens_*`` kwargs) and ``model.padding_free`` (``padding_free``),
the prefix-cache forwards compute no padding at all: the distinct prefixes go as one sequence of all their
tokens with restarting positions, and the completions as another, each completion's queries attending to
its prefix's keys/values and its own (``cu_seq_lens_k`` counts prefix + completion). Elsewhere (SDPA,
eager, any CPU) each forward pads its rows to its longest, and length-aware micro-batches keep that small.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from bicc.model.logprobs import (
    at_least_fp32,
    compute_precision,
    entropy_from_logits,
    host_tensor,
    logprobs_from_logits,
    on_device,
)

MASK_ATTENTION = ("sdpa", "eager")  # kernels that honour a custom 4-D mask
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")  # kernels that take ragged sequences (cu_seqlens)


def padding_free(model) -> bool:
    """Whether the prefix-cache forwards of ``model`` go padding-free: its attention kernel takes ragged
    sequences and ``model.padding_free`` did not turn it off (``bicc_padding_free``, set at load)."""
    return model.config._attn_implementation in VARLEN_ATTENTION and getattr(model, "bicc_padding_free", True)


def _ragged(lengths_q: list[int], lengths_k: list[int], device) -> dict:
    """transformers' varlen kwargs for sequences of ``lengths_q`` queries over ``lengths_k`` keys, laid end to
    end (int32 cumulative lengths, as flash-attn takes them)."""
    cu = lambda xs: host_tensor([0, *itertools.accumulate(xs)], device, torch.int32)  # noqa: E731
    return dict(cu_seq_lens_q=cu(lengths_q), cu_seq_lens_k=cu(lengths_k), max_length_q=max(lengths_q),
                max_length_k=max(lengths_k))


@dataclass
class PackedBatch:
    """Packed rows and where each sample's target tokens sit in them.

    input_ids:      [R, T]
    position_ids:   [R, T]
    attention_mask: [R, 1, T, T] bool
    row, pos:       [M] row and position whose logits predict each target token
    target:         [M] target token ids
    sample, step:   [M] sample index (0..n-1 in the caller's order) and token index within its output
    num_tokens:     real (non-pad) tokens in the rows: the forward's work
    first:          the first position whose logits predict a target (min of ``pos``), known on the host
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    target: torch.Tensor
    sample: torch.Tensor
    step: torch.Tensor
    num_tokens: int
    first: int = 0

    def to(self, device) -> "PackedBatch":
        tensors = (self.input_ids, self.position_ids, self.attention_mask, self.row, self.pos, self.target, self.sample,
                   self.step)
        return PackedBatch(*(on_device(t, device) for t in tensors), self.num_tokens, self.first)


def plan_rows(prefixes: list[list[int]], keys: list[int], completions: list[list[int]], max_len: int):
    """Group samples by prefix key into rows of at most ``max_len`` tokens (a sample alone may exceed it).
    Returns a list of (prefix, [sample indices])."""
    by_key: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    rows = []
    for members in by_key.values():
        prefix = prefixes[members[0]]
        current, length = [], len(prefix)
        for i in members:
            if current and length + len(completions[i]) > max_len:
                rows.append((prefix, current))
                current, length = [], len(prefix)
            current.append(i)
            length += len(completions[i])
        rows.append((prefix, current))
    return rows


def pack(prefixes: list[list[int]], keys: list[int], completions: list[list[int]], max_len: int,
         pad_id: int) -> PackedBatch:
    """Build packed rows for samples whose prefixes are given per sample (equal keys = equal prefixes)."""
    rows = plan_rows(prefixes, keys, completions, max_len)
    lengths = [len(prefix) + sum(len(completions[i]) for i in members) for prefix, members in rows]
    width = max(lengths)
    R = len(rows)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)  # [R, T]
    position_ids = torch.zeros((R, width), dtype=torch.long)  # [R, T]
    segment = torch.full((R, width), -1, dtype=torch.long)  # [R, T]: 0 prefix, j>0 output j, -1 pad
    row_idx, pos_idx, target, sample, step = [], [], [], [], []
    for r, (prefix, members) in enumerate(rows):
        P = len(prefix)
        input_ids[r, :P] = torch.tensor(prefix, dtype=torch.long)
        position_ids[r, :P] = torch.arange(P)
        segment[r, :P] = 0
        start = P
        for j, i in enumerate(members, start=1):
            ids = completions[i]
            n = len(ids)
            if n == 0:
                continue
            input_ids[r, start : start + n] = torch.tensor(ids, dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(P, P + n)
            segment[r, start : start + n] = j
            # token t of o_j is predicted at position P-1 (t = 0) or start+t-1 (t > 0)
            row_idx += [r] * n
            pos_idx += [P - 1] + list(range(start, start + n - 1))
            target += ids
            sample += [i] * n
            step += list(range(n))
            start += n
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))  # [T, T]
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]  # [R, T, 1], [R, 1, T]
    allowed = causal & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))  # [R, T, T]
    allowed |= torch.eye(width, dtype=torch.bool)  # pad queries attend to themselves: no empty softmax rows
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return PackedBatch(input_ids, position_ids, allowed[:, None], as_long(row_idx), as_long(pos_idx), as_long(target),
                       as_long(sample), as_long(step), sum(lengths), min(pos_idx, default=0))


def packed_logprobs(model, packed: PackedBatch, num_samples: int, length: int, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [num_samples, length] (zeros past each output's end) from packed rows."""
    impl = model.config._attn_implementation
    if impl not in MASK_ATTENTION:
        raise ValueError("train.context_packing_impl=mask needs an attention kernel that takes a 4-D mask "
                         f"({', '.join(MASK_ATTENTION)}); "
                         f"the model runs attn_implementation={impl}. Use train.context_packing_impl=kv")
    mask = packed.attention_mask
    if impl == "eager":
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(~mask, torch.finfo(model.dtype).min)
    first = packed.first
    # full logits here: a prefix's last position predicts the first token of every output behind it
    with compute_precision(model):
        logits = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                       logits_to_keep=packed.input_ids.shape[1] - first, use_cache=False).logits  # [R, T - first, V]
    picked = logits[packed.row, packed.pos - first]  # [M, V]
    if temperature != 1.0:
        picked = at_least_fp32(picked) / temperature
    flat = logprobs_from_logits(picked, packed.target)  # [M]
    logp = flat.new_zeros(num_samples, length).index_put((packed.sample, packed.step), flat)  # [n, L]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = flat.new_zeros(num_samples, length).index_put((packed.sample, packed.step),
                                                                     entropy_from_logits(picked))
    return logp, entropy
