"""How a step's rows are cut into micro-batches, and each micro-batch padded only to its own longest row.

Two plans (``plan_micro_batches``):
- fixed (``train.micro_batch_tokens = 0``): ``train.micro_batch_size`` rows at a time, in order;
- length-aware (``train.micro_batch_tokens > 0``): rows sorted by real length (prompt + output, longest
  first) and cut greedily so that each micro-batch's padded size, rows x its longest row, stays within
  ``micro_batch_tokens`` (and at most ``micro_batch_size`` rows) and within ``1 + MAX_PADDING`` times its
  real tokens. Rows of similar length then share a micro-batch and little is spent on padding; the long
  tail of a reasoning-length batch goes in small micro-batches.

Padding-free forwards (``bicc.kernels.packing.padding_free``: the prefix-cache rows under a varlen kernel) compute a
micro-batch's real tokens only; their plan (``ragged``) counts those against ``micro_batch_tokens`` and has no
padding cap.

Either way a micro-batch is computed on its own columns only (``trim_rows``): the prompt columns that are
padding in all of its rows and the output columns past its longest output are cut before the forward, and
the log-probs come back on the step's [n, L] grid with zeros past each output. The loss normalisers are the
whole minibatch's (``StepTotals``), so the gradient does not depend on the plan (tests/test_batching.py).
"""

from __future__ import annotations

import torch

from bicc.kernels.packing import padding_free
from bicc.machine.ranks import Ranks
from bicc.model.logprobs import TokenBatch, on_device

MAX_PADDING = 0.1  # length-aware micro-batches: padded tokens at most 10% above the real ones


def plan_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, size: int, tokens: int = 0,
                       ragged: bool = False) -> list[torch.Tensor]:
    """``rows`` [n] (indices into the step) cut into micro-batches. ``lengths``: every step row's real length,
    [N] tokens, or [N, 2] (prompt, output) tokens, since a micro-batch is as wide as its longest prompt plus
    its longest output (``trim_rows``). ``tokens = 0``: fixed slices of
    ``size`` rows; else the length-aware cut above (a row longer than ``tokens`` gets a micro-batch alone).
    ``ragged``: the forwards are padding-free, a micro-batch costs its real tokens."""
    if size < 1:
        raise ValueError(f"train.micro_batch_size must be >= 1, got {size}")
    if tokens <= 0:
        return list(rows.split(size))
    parts = (lengths if lengths.dim() == 2 else lengths[:, None]).tolist()  # [N][k], planned in Python: no tensor ops
    order = sorted(rows.tolist(), key=lambda r: -sum(parts[r]))  # longest first, ties in order (a stable sort)
    plan, current = [], []
    for r in order:
        if current:
            padded, real = _size(current + [r], parts)
            padded = real if ragged else padded
            if len(current) == size or padded > tokens or padded > (1 + MAX_PADDING) * real:
                plan.append(torch.tensor(current, dtype=torch.long))
                current = []
        current.append(r)
    if current:
        plan.append(torch.tensor(current, dtype=torch.long))
    return plan


def _size(rows: list[int], parts: list[list[int]]) -> tuple[int, int]:
    """(padded, real) tokens of a micro-batch of ``rows``: rows x the sum of each part's longest, and the sum."""
    widest = [max(column) for column in zip(*(parts[r] for r in rows))]
    return len(rows) * sum(widest), sum(sum(parts[r]) for r in rows)


def trim_rows(batch: TokenBatch, widths=None) -> TokenBatch:
    """``batch`` without the prompt columns that are padding in every row and the output columns past its
    longest output (at least one output column is kept). ``widths``: (longest prompt, longest output) of its rows
    when the caller knows them on the host; else read from ``batch`` (a sync where it lives on a GPU)."""
    length = batch.completion_len
    width = batch.input_ids.shape[1] - length
    if widths is not None:
        prompt, out = widths[0], max(1, widths[1])
    elif batch.input_ids.shape[0]:
        prompt, out = int(batch.attention_mask[:, :width].sum(-1).max()), max(1, int(batch.completion_mask.sum(-1).max()))
    else:
        prompt, out = 0, 1
    cols = slice(width - prompt, width + out)
    return TokenBatch(batch.input_ids[:, cols], batch.attention_mask[:, cols], batch.position_ids[:, cols],
                      batch.completion_mask[:, :out])


def to_grid(x: torch.Tensor | None, mask: torch.Tensor, length: int) -> torch.Tensor | None:
    """[B, l] per-token values back on a [B, length] grid: zeros past each output (``mask`` [B, l])."""
    if x is None:
        return None
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.nn.functional.pad(x, (0, length - x.shape[1]))


def micro_batches(rows: torch.Tensor, inputs, size: int, tokens: int, model, ranks: Ranks = Ranks()) -> list[torch.Tensor]:
    """``rows`` cut into micro-batches (fixed, or by length under ``train.micro_batch_tokens``, on real tokens where
    ``inputs`` go padding-free), as many on every rank as ``ranks`` needs (``Ranks.micro_batches``: the extra ones
    empty, no-op forwards)."""
    plan = plan_micro_batches(rows, inputs.lengths, size, tokens, ragged=inputs.kv and padding_free(model))
    return ranks.micro_batches(plan, model)


@torch.no_grad()
def logprobs_no_grad(model, inputs, num_rows: int, micro_batch_size: int, temperature: float, ranks: Ranks = Ranks(),
                     micro_batch_tokens: int = 0) -> torch.Tensor:
    """Per-token log-probs [N, L] in micro-batches (``micro_batches``), no graph kept (old and reference
    policies). ``inputs``: the rows to score (``bicc.kernels.rows``), on q or on x^c."""
    was_training = model.training
    model.eval()
    out = None
    with inputs.contexts_once(model, torch.arange(num_rows)):
        for rows in micro_batches(torch.arange(num_rows), inputs, micro_batch_size, micro_batch_tokens, model, ranks):
            if len(rows) == 0:  # keeps this rank's collectives in step with the others
                ranks.no_op(model, inputs, temperature)
                continue
            logp = inputs.logprobs(model, rows, temperature)[0]
            if out is None:
                out = logp.new_zeros(num_rows, logp.shape[1])
            out[on_device(rows, out.device)] = logp
    model.train(was_training)
    return out
