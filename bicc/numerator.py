"""What the trainable numerator pi_theta(o_i | .) is evaluated on.

Base variants use the plain prompt q. BiCC uses the conditioned prompt x^c, either one row per output
or packed behind shared prefixes (``bicc.packing``). Old and reference log-probs never come from here:
they stay on q. Both classes offer ``logprobs(model, rows, temperature, with_entropy)`` returning
[len(rows), L] log-probs (and entropies) aligned with the plain batch's completion grid, and
``tokens``: how many tokens one forward over all rows processes.
"""

from __future__ import annotations

import torch

from bicc.conditioning import ConditionedPrompts
from bicc.logprobs import TokenBatch, batch_logprobs, make_token_batch
from bicc.packing import pack, packed_logprobs


class PlainNumerator:
    def __init__(self, batch: TokenBatch):
        self.batch = batch
        self.tokens = int(batch.attention_mask.sum())

    def logprobs(self, model, rows, temperature: float, with_entropy: bool = False):
        return batch_logprobs(model, self.batch.rows(rows), temperature, with_entropy)


class ConditionedNumerator:
    def __init__(self, contexts: ConditionedPrompts, completion_ids: list[list[int]], length: int, bicc_cfg,
                 pad_id: int, device: torch.device):
        self.contexts, self.completion_ids, self.length = contexts, completion_ids, length
        self.packing, self.max_packed_len = bicc_cfg.packing, bicc_cfg.max_packed_len
        self.pad_id, self.device = pad_id, device
        completion_tokens = sum(map(len, completion_ids))
        if self.packing:  # each distinct prefix once (ignoring splits of over-long packs)
            prefixes = {k: len(p) for k, p in zip(contexts.context_key, contexts.prompt_ids)}
            self.tokens = sum(prefixes.values()) + completion_tokens
        else:
            self.tokens = sum(map(len, contexts.prompt_ids)) + completion_tokens

    def logprobs(self, model, rows, temperature: float, with_entropy: bool = False):
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        prefixes = [self.contexts.prompt_ids[r] for r in rows]
        completions = [self.completion_ids[r] for r in rows]
        if self.packing:
            keys = [self.contexts.context_key[r] for r in rows]
            packed = pack(prefixes, keys, completions, self.max_packed_len, self.pad_id).to(self.device)
            return packed_logprobs(model, packed, len(rows), self.length, temperature, with_entropy)
        batch = make_token_batch(prefixes, completions, self.pad_id, length=self.length).to(self.device)
        return batch_logprobs(model, batch, temperature, with_entropy)
