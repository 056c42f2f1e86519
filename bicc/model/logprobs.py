"""Per-token log-probs of target tokens under a causal LM, from explicit positions and masks.

Rows [prompt; output] go through ``token_logprobs``: the caller supplies ``position_ids`` and either a 2-D
padding mask ``[B, T]`` or a prepared 4-D mask ``[B, 1, T, T]`` (bool: True = attend, or additive float).
BiCC's KV-reuse packing calls ``forward_logprobs`` on outputs behind cached context keys/values
(``bicc.kernels.packing``); both go through the chunked head below.

Memory: the output projection never materialises [B, T, V] logits: inside ``head_targets`` the model's
``lm_head`` is the chunked log-prob head of ``bicc.model.head`` (entropies only when asked for).

Mixed precision: a policy held in fp32 master weights with a lower compute dtype carries
``bicc_compute_dtype``; ``compute_precision(model)`` is the autocast every forward of it runs under.

Layout convention (``TokenBatch``): prompts are left-padded to a common width P and completions are
right-padded to a common length L, so every completion starts at column P and only the last L+1
positions' logits are needed (``logits_to_keep``), which saves the vocab projection over the prompt.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from bicc.model.head import DEFAULT_CHUNK_TOKENS, LogprobHead, head_targets, install_logprob_head  # noqa: F401 (re-exported)


@dataclass
class TokenBatch:
    """Prompt + completion rows ready for a forward pass.

    input_ids:        [N, P+L]  left-padded prompts, then right-padded completions
    attention_mask:   [N, P+L]  1 on real tokens
    position_ids:     [N, P+L]  0.. counted over real tokens only
    completion_mask:  [N, L]    1 on completion tokens (EOS included)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, index) -> "TokenBatch":
        return TokenBatch(self.input_ids[index], self.attention_mask[index], self.position_ids[index],
                          self.completion_mask[index])

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(on_device(t, device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                           self.completion_mask)))


def on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``, without the host waiting for the GPU. A plain copy from host memory to CUDA synchronises
    the stream: the GPU drains its queue and then idles while the host prepares its next launch (a micro-batch's
    inputs, the forward's prologue). From pinned memory the copy is queued behind the GPU's work instead. A tensor the
    caller pinned itself is read where it lies, once the GPU gets to the copy: it must not change until then (any
    other is copied to pinned memory first, and may)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_tensor(data, device, dtype=torch.long) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` built on the host and sent to ``device`` without a sync (``on_device``)."""
    return on_device(torch.tensor(data, dtype=dtype), device)


def make_token_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                     length: int | None = None) -> TokenBatch:
    """Rows [left-padded prompt; right-padded completion]; completions padded to ``length`` if given."""
    n = len(prompt_ids)
    width = max(len(p) for p in prompt_ids)
    length = length or max(1, max(len(c) for c in completion_ids))
    input_ids = torch.full((n, width + length), pad_id, dtype=torch.long)  # [N, P+L]
    attention_mask = torch.zeros((n, width + length), dtype=torch.long)  # [N, P+L]
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, width - len(p) : width] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p) : width] = 1
        if c:
            input_ids[i, width : width + len(c)] = torch.tensor(c, dtype=torch.long)
            attention_mask[i, width : width + len(c)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [N, P+L]
    completion_mask = attention_mask[:, width:].clone()  # [N, L]
    return TokenBatch(input_ids, attention_mask, position_ids, completion_mask)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Low-precision logits upcast to fp32 for the softmax; fp64 kept (the probe's exact checks)."""
    return x if x.dtype == torch.float64 else x.float()


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] without materialising the full log-softmax. [..., V], [...] -> [...]"""
    logits = at_least_fp32(logits)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position. [..., V] -> [...]"""
    logits = at_least_fp32(logits)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def compute_precision(model):
    """The autocast a policy with fp32 master weights computes under (``bicc_compute_dtype``); a no-op
    for a model that computes in its parameters' dtype."""
    dtype = getattr(model, "bicc_compute_dtype", None)
    if dtype is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=dtype)


def forward_logprobs(model, targets: torch.Tensor, temperature: float, with_entropy: bool, **inputs):
    """``model(**inputs)`` whose kept positions predict ``targets`` [B, T']: (log-probs [B, T'],
    entropies [B, T'] or None), chunked through ``LogprobHead`` (or from full logits as a fallback)."""
    with compute_precision(model), head_targets(model, targets, temperature, with_entropy) as chunked:
        out = model(**inputs, use_cache=False).logits
    if chunked:
        return out[..., 0], (out[..., 1] if with_entropy else None)
    logits = at_least_fp32(out) / temperature if temperature != 1.0 else out
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logprobs_from_logits(logits, targets), entropy


def reading_mask(keys: torch.Tensor, width: int) -> torch.Tensor:
    """SDPA's bool mask [n, 1, q, W + q] (True: attend) of queries that follow ``width`` cached prefix positions:
    query i reads key j where ``keys[:, j]`` (a real prefix or completion token) and j <= width + i (causal). It is
    the mask transformers builds from the 2-D ``keys`` mask (``create_causal_mask``, which passes a 4-D mask
    through), in a few ops instead of its few dozen per forward."""
    q = keys.shape[1] - width
    causal = torch.ones(q, keys.shape[1], dtype=torch.bool, device=keys.device).tril(width)  # [q, W + q]
    return keys.bool()[:, None, None, :] & causal


def sdpa_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's bool mask [B, 1, T, T] (True: attend) of rows whose real tokens ``attention_mask`` [B, T] marks: query i
    reads every real key j <= i (``reading_mask`` after no cached positions), and itself (a padding query then reads
    one key, never none). transformers builds the same from the 2-D mask, after reading the mask's values to see
    whether it may skip it (on a GPU, a sync in every forward); a 4-D mask it takes as it is."""
    eye = torch.eye(attention_mask.shape[1], dtype=torch.bool, device=attention_mask.device)
    return reading_mask(attention_mask, 0) | eye


def attention_input(model, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask ``model`` is given for rows with a 2-D ``attention_mask`` [B, T], such that transformers reads none of
    its values (on a GPU a read is a sync, in every forward): under SDPA its 4-D form (``sdpa_padding_mask``), else
    as it is. (Without a mask transformers would read the positions instead, to detect packed rows.)"""
    if attention_mask.dim() == 2 and model.config._attn_implementation == "sdpa":
        return sdpa_padding_mask(attention_mask)
    return attention_mask


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_targets: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last ``num_targets`` tokens of each row, and optionally the entropies there.

    input_ids, position_ids: [B, T]; attention_mask: [B, T] or [B, 1, T, T]. Returns [B, num_targets].
    Logits are divided by the sampling temperature so the ratio compares like with like.
    """
    targets = input_ids[:, -num_targets:]  # [B, num_targets]
    # the kept positions are the last num_targets + 1; the last one predicts nothing (its target: a dummy)
    padded = torch.cat([targets, targets[:, :1]], dim=1)  # [B, num_targets + 1]
    logp, entropy = forward_logprobs(model, padded, temperature, with_entropy, input_ids=input_ids,
                                     attention_mask=attention_input(model, attention_mask), position_ids=position_ids,
                                     logits_to_keep=num_targets + 1)
    return logp[:, :-1], (entropy[:, :-1] if entropy is not None else None)


def batch_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    return token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                          batch.completion_len, temperature, with_entropy)
