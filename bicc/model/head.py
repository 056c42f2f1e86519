"""The output projection as a log-prob head: per-token log-probs of given targets (and entropies, only when asked),
computed over chunks of tokens, never materialising [B, T, V] logits.

``install_logprob_head`` class-swaps the model's ``nn.Linear`` output projection to ``LogprobHead`` (same weight,
same name, same state dict, tying kept). While ``head_targets`` sets a request, its forward returns [..., 2]
(log-prob of the requested target, entropy or 0) per kept position instead of [..., V] logits; otherwise it is
the plain projection (generation, SFT). It runs inside the model's own forward, so FSDP2's gathered root
parameters and activation checkpointing apply unchanged.

Each chunk of ``chunk_tokens`` positions (a tail of one token joins the chunk before it: compiled, a size of one
would be a graph of its own) is one autograd function (``ChunkLogprobs``) whose cost is its matmul:

- forward: logits z = h W^T / T in fp32 (the compute dtype's matmul, upcast once), shifted by their maximum and
  exponentiated in place: e = exp(z - max), s = sum e, log p(target) = z[target] - max - log s. The entropy
  H = log s - sum e (z - max) / s only when asked (a metric: no gradient flows through it; it needs one more
  [n, V] buffer);
- backward: d log p / dz = onehot(target) - softmax(z), so dz = g (onehot - e / s) / T, built in place in e's
  buffer, then the two matmuls dh = dz W and dW = dz^T h in the forward's compute dtype.

Memory: with one chunk (a micro-batch of at most ``chunk_tokens`` tokens) e is kept for the backward (the same peak
as recomputing the logits there, one matmul and one exp fewer); with several, each chunk keeps only its inputs and
log-sum-exp and recomputes exp(z - lse) in the backward, so the peak stays one chunk's [chunk, V].

Compiled (``model.compile``, ``bicc.kernels.compile.compile_head``): the same two functions through ``torch.compile``.
Eager, the [n, V] work between the matmuls is a dozen ops, each a pass over the chunk (the upcast, max, shift, exp,
sum; in the backward the scale, the scatter, the downcast), about 46 bytes read and written per logit in bf16
compute. Compiled, the forward's is one fused reduction over the matmul's output, and the backward's dz one pass
that writes it in the compute dtype (the onehot as a comparison with the column index, which Inductor fuses, where
a scatter would stop the fusion). The values are the eager head's (tests hold both to the full logits).
"""

from __future__ import annotations

import contextlib

import torch

DEFAULT_CHUNK_TOKENS = 1024


def _logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """[n, H] -> [n, V] fp32 logits over the temperature (fp64 kept: the probe's exact checks), from the matmul in
    the compute dtype (bf16 under autocast or bf16 parameters)."""
    z = torch.nn.functional.linear(hidden, weight, bias)
    z = z if z.dtype == torch.float64 else _as(z, torch.float32)
    return z.div_(temperature) if temperature != 1.0 else z


def chunk_forward(hidden, weight, bias, targets, temperature: float, keep: bool, entropy: bool):
    """A chunk's forward: (log p [n], entropy [n] or zeros, log-sum-exp [n], and for a kept chunk the softmax's
    numerator e [n, V] and its sum [n, 1], else None twice)."""
    z = _logits(hidden, weight, bias, temperature)  # [n, V]
    top = z.amax(-1, keepdim=True)  # [n, 1]
    picked = z.gather(-1, targets[:, None]) - top  # [n, 1]
    z.sub_(top)  # shifted logits, in place
    e = torch.exp(z) if entropy else z.exp_()  # [n, V] unnormalised softmax
    total = e.sum(-1, keepdim=True)  # [n, 1]
    log_total = total.log()
    logp = (picked - log_total)[:, 0]
    # sum e z as a product and a sum, in fp32: autocast runs a dot product (linalg.vecdot) in bf16
    ent = (log_total - (e * z).sum(-1, keepdim=True) / total)[:, 0] if entropy else torch.zeros_like(logp)
    lse = (top + log_total)[:, 0]
    return logp, ent, lse, (e if keep else None), (total if keep else None)


def chunk_backward(hidden, weight, bias, targets, lse, e, total, grad_logp, temperature: float,
                   dtype: torch.dtype, needs: tuple, fused: bool):
    """A chunk's backward: (d hidden, d weight, d bias), each None where ``needs`` says no. dz = g (onehot(target) -
    softmax(z)) / T from the kept numerator (its buffer becomes the gradient's) or recomputed from the log-sum-exp;
    the two matmuls in ``dtype``, the forward's. ``fused``: the onehot as a comparison with the column index, so
    that Inductor builds dz in one pass over [n, V] (eager, a scatter of n values is cheaper than that pass)."""
    if e is None:
        z = _logits(hidden, weight, bias, temperature)
        g = _as(grad_logp, z.dtype)[:, None]
        grad = z.sub_(lse[:, None].to(z.dtype)).exp_().mul_(-g)  # -g softmax(z)
    else:
        g = _as(grad_logp, e.dtype)[:, None]
        grad = e * (-g / total) if fused else e.mul_(-g / total)  # -g softmax(z); compiled, e is an input: unwritten
    if fused:
        columns = torch.arange(grad.shape[-1], device=grad.device)
        grad = grad + torch.where(columns == targets[:, None], g, 0.0)
    else:
        grad.scatter_add_(-1, targets[:, None], g)  # + g at the target
    if temperature != 1.0:
        grad.div_(temperature)
    grad = _as(grad, dtype)
    grad_hidden = _as(grad @ _as(weight, grad.dtype), hidden.dtype) if needs[0] else None
    grad_weight = _as(grad.T @ _as(hidden, grad.dtype), weight.dtype) if needs[1] else None
    grad_bias = _as(grad.sum(0), bias.dtype) if bias is not None and needs[2] else None
    return grad_hidden, grad_weight, grad_bias


class ChunkLogprobs(torch.autograd.Function):
    """(hidden [n, H], weight [V, H], bias [V] | None, targets [n]) -> (log-probs [n], entropies [n] or zeros);
    ``head``: the ``LogprobHead`` whose compiled math runs it (``model.compile``), or None for eager."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, keep: bool, entropy: bool, head=None):
        ctx.compute_dtype = _matmul_dtype(hidden, weight)
        args = (hidden, weight, bias, targets, temperature, keep, entropy)
        logp, ent, lse, e, total = _compiled(head, 0, args) or chunk_forward(*args)
        ctx.mark_non_differentiable(ent)
        ctx.temperature, ctx.head = temperature, head
        # kept: the softmax's numerator and its sum (the backward needs no exp); else the inputs, recomputed
        ctx.save_for_backward(hidden, weight, bias, targets, lse, e, total)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        """Once per forward (the kept softmax's buffer becomes the gradient's); the matmuls in the forward's dtype."""
        args = (*ctx.saved_tensors, grad_logp, ctx.temperature, ctx.compute_dtype, tuple(ctx.needs_input_grad[:3]))
        grads = _compiled(ctx.head, 1, (*args, True)) or chunk_backward(*args, False)
        return *grads, None, None, None, None, None


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``linear(hidden, weight)`` computes in: autocast's (fp32 master weights, bf16 compute) or the
    inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _compiled(head, which: int, args):
    """``chunk_forward`` (``which`` 0) or ``chunk_backward`` (1) as ``bicc.kernels.compile.compile_head`` compiled them for
    ``head``; None where ``head`` is eager or its compilation failed (it then runs eagerly)."""
    if head is None or not getattr(head, "_bicc_compile_ok", False):
        return None
    return head._bicc_compiled(head, which, args)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself where it is already (a no-op cast is still an op the host launches)."""
    return t if t.dtype == dtype else t.to(dtype)


class LogprobHead(torch.nn.Linear):
    """An ``nn.Linear`` output projection that, while ``request`` is set (``head_targets``), returns
    [..., 2] = (log-prob of the requested target, entropy or 0) per position instead of [..., V] logits."""

    request = None  # (targets [B, T'], temperature, chunk_tokens, with_entropy)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return super().forward(hidden)
        targets, temperature, chunk, entropy = self.request
        shape = hidden.shape[:-1]  # [B, T']
        flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        # one chunk: its softmax is kept for the backward; a no-grad pass keeps nothing (compiled, nor writes it)
        keep = flat_h.shape[0] <= chunk and torch.is_grad_enabled()
        head = self if getattr(self, "_bicc_compile_ok", False) else None  # model.compile (bicc.kernels.compile)
        bounds = [*range(0, flat_h.shape[0], chunk), flat_h.shape[0]]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:  # a one-token tail joins the chunk before it: compiled,
            del bounds[-2]  # a chunk of one token would be a graph of its own (Dynamo specialises a size of 1)
        parts = [ChunkLogprobs.apply(flat_h[a:b], self.weight, self.bias, flat_t[a:b], temperature, keep, entropy, head)
                 for a, b in zip(bounds, bounds[1:])]
        if not parts:
            empty = flat_h.new_zeros(0, dtype=torch.float32)
            parts = [(empty, empty)]
        logp, ent = parts[0] if len(parts) == 1 else (torch.cat([p[i] for p in parts]) for i in (0, 1))
        return torch.stack([logp.view(shape), ent.view(shape)], dim=-1)  # a fresh tensor, not a view


def install_logprob_head(model, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> bool:
    """Turn the model's ``nn.Linear`` output projection into a ``LogprobHead`` (same parameters and state
    dict); False when the head is of another kind (log-probs then come from full logits)."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = LogprobHead
    if not isinstance(head, LogprobHead):
        return False
    head.chunk_tokens = chunk_tokens
    return True


@contextlib.contextmanager
def head_targets(model, targets: torch.Tensor, temperature: float, with_entropy: bool = True):
    """While inside, the model's forward returns [B, T', 2] (log-prob of ``targets`` [B, T'], entropy, or 0 without
    ``with_entropy``) in place of logits for the positions it keeps. Yields False (and changes nothing) for heads
    that cannot."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead) and not install_logprob_head(model):
        yield False
        return
    head.request = (targets, temperature, head.chunk_tokens, with_entropy)
    try:
        yield True
    finally:
        head.request = None
