"""Per-token log-probs of target tokens under a causal LM, from explicit positions and masks.

Every forward in training goes through ``token_logprobs``: the caller supplies ``position_ids`` and
either a 2-D padding mask ``[B, T]`` or a prepared 4-D mask ``[B, 1, T, T]`` (bool: True = attend, or
additive float), so packed rows with a shared prefix use the same code as plain padded rows.

Layout convention (``TokenBatch``): prompts are left-padded to a common width P and completions are
right-padded to a common length L, so every completion starts at column P and only the last L+1
positions' logits are needed (``logits_to_keep``), which saves the vocab projection over the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                    self.completion_mask)))


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


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] without materialising the full log-softmax. [B, L, V], [B, L] -> [B, L]"""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position. [B, L, V] -> [B, L]"""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


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
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_targets + 1,
        use_cache=False,
    ).logits[:, :-1]  # [B, num_targets, V]
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -num_targets:]  # [B, num_targets]
    logp = logprobs_from_logits(logits, targets)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logp, entropy


def batch_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    return token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                          batch.completion_len, temperature, with_entropy)
