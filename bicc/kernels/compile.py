"""Regional compilation: each decoder layer's ``forward`` through ``torch.compile`` (``model.compile``).

An HF decoder layer launches about a hundred small ops per forward (norms in fp32, rotary, SwiGLU, views and
casts), and its checkpointed recompute and backward as many again: on a GPU the host's launches, not the
matmuls, set the update's pace (``docs/performance.md``). Compiled, a layer's forward and backward are a few
fused kernels around its matmuls and attention; and the linears that share an input are one matmul (``bicc.kernels.fuse``:
q, k and v one, gate and up one), four a layer forward where there were seven.

What is compiled, and what is not:

- each layer's ``forward`` only: the module's ``__call__`` (FSDP2's all-gather and reshard hooks) stays eager
  around it, so sharding works as it does uncompiled. Under activation checkpointing a call with grad whose cache
  is none or read-only compiles the checkpoint with the forward (``_recomputed``, ``model.checkpoint_in_graph``):
  the layer's backward graph recomputes what it reads, and the MLP's down projection is not run again. The
  prefix pass's recording cache keeps transformers' eager checkpoint, which replays the compiled forward;
- the base model's final norm and rotary embedding, which run once per forward outside the layers, in the
  passes where the layers run compiled: the base model's forward tells them (``_Switch``), as they see no cache.
  The embeddings stay eager;
- the chunked log-prob head's forward and backward math (``compile_head``), in every pass that asks it
  for log-probs: one fused pass over each chunk's [n, V] logits where eager makes a dozen;
- the update's loss (``bicc.kernels.compiled_loss``: the registered loss with its metrics, forward and backward) where the
  layers run compiled (eager, a hundred small ops per micro-batch). Its algo config goes in as plain values and
  the step's totals as floats (inputs: they change every step, and a constant would recompile it);
- only the log-prob forwards (``bicc.model.logprobs``, ``bicc.kernels.prefix_cache``): a call with no cache, with the
  completions' read-only KV-reuse cache (marked ``bicc_compile``), or with the prefix pass's recording cache
  (``bicc_record``: the graph hands each layer's keys/values out, and the cache keeps them after the call,
  outside the graph, only outside a checkpoint's replay, which Dynamo could not tell inside it). Generation (HF's
  growing cache) runs eagerly;
- with dynamic shapes from the first call (``dynamic=True``): micro-batches differ in rows and length, and one
  graph per kind of pass serves them (``tests/test_compile_graphs.py``). No shape adds one for the same math:
  views go in as tensors of their own (``_own``: Dynamo guards on a view's base, and FSDP2 hands a layer a view
  where a checkpoint's replay hands it a plain tensor); the final norm and the rotary embedding see the tokens as
  one row (one row would specialise); duck sizing is off (a length equal to a width on the first call made a graph
  for that length alone). One row still specialises a layer's graph. Under KV reuse a layer is handed its own
  layer of the cache (``bicc.kernels.prefix_cache.OneLayer``), not the cache and its number, which made a graph per layer.
  The head's two functions are first traced at storage offset 0 (``_at_offset_0``), which then takes any chunk;
- with the layer's Python floats (norm eps, attention scale) as constants of the graph (Dynamo's
  ``specialize_float``, set for the layers' calls alone): by default Dynamo lifts each into a 0-d tensor input
  on every call, which Inductor's CUDA wrapper reads back with ``.item()``. Every layer has the same floats, so
  they still share their graphs;
- Dynamo's most-recently-used choice among a frame's graphs is turned off (graphs are tried in the order they
  were made): under activation checkpointing the recompute must run the very graph the forward ran, and with
  two graphs that match the MRU order could pick the other (pytorch/pytorch#166926; torchtitan's workaround).

The compiled function takes the layer as an argument, so a copy of the model (``bicc.model.load.compute_copy``)
runs its own weights. Fallback: a layer (or loss) whose compilation fails (Dynamo or the backend raising) runs
eagerly from then on, with one warning naming the error; a run never stops for it. ``torch.compile`` needs a C++
compiler on CPU and Triton on CUDA.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import torch
import torch.fx.experimental._config as _shapes
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from bicc.kernels.fuse import fusing
from bicc.kernels.prefix_cache import OneLayer, Recorder
from bicc.model.head import chunk_backward, chunk_forward


def should_compile(setting: str, device: torch.device) -> bool:
    """``model.compile``: on | off | auto (CUDA only)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def decoder_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model, backend: str = "inductor", checkpoint_in_graph: bool = True) -> int:
    """Compile every decoder layer's ``forward`` of ``model`` in place, and its base model's final norm and rotary
    embedding, each keeping its eager fallback; returns how many layers were wrapped. ``checkpoint_in_graph``
    (``model.checkpoint_in_graph``): a checkpointed layer's recompute is traced into its compiled backward."""
    import torch._dynamo

    layers = decoder_layers(model)
    torch._C._dynamo.eval_frame._set_lru_cache(False)
    limit = 4 * len(layers) + 8  # room for shape specialisations (a few graphs, whatever the depth)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    compiled = {}

    def wrap(module, forward):
        cls = type(module)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=True, backend=fusing(backend))
        module._bicc_compiled = compiled[cls]
        module._bicc_compile_ok = True
        module._bicc_backend = backend  # the loss's too (``bicc.kernels.compiled_loss``)
        module.forward = types.MethodType(forward, module)  # bound to each copy of the module by deepcopy

    for layer in layers:
        wrap(layer, _forward)
        eager = getattr(layer, "_gradient_checkpointing_func", None)
        keywords = dict(getattr(eager, "keywords", {}))
        if checkpoint_in_graph and getattr(layer, "gradient_checkpointing", False) and not keywords.get("use_reentrant", True):
            if "recomputed" not in compiled:
                compiled["recomputed"] = torch.compile(_recomputed, dynamic=True, backend=fusing(backend))
            layer._bicc_recomputed, layer._bicc_checkpoint_kwargs = compiled["recomputed"], keywords
            layer._bicc_eager_checkpoint, layer._bicc_in_graph = eager, False
            layer._gradient_checkpointing_func = types.MethodType(_checkpoint, layer)
    compile_head(model, backend)  # the log-prob head's chunks, in every pass that asks for log-probs
    base = getattr(model, "base_model", None)
    glue = {name: getattr(base, name, None) for name in ("norm", "rotary_emb")}
    glue = {name: m for name, m in glue.items() if isinstance(m, torch.nn.Module)}
    if glue:
        switch = _Switch()  # one per model: a deep copy copies it with the modules
        base._bicc_switch = switch
        base.forward = types.MethodType(_base_forward, base)
        for name, module in glue.items():
            wrap(module, _glue_forward)
            module._bicc_switch = switch
            module._bicc_no_grad = name == "rotary_emb"  # cos, sin of positions: one graph, with grad or without
    return len(layers)


def compile_head(model, backend) -> None:
    """Run the chunks of ``model``'s log-prob head (``bicc.model.head``) through ``torch.compile`` with ``backend``: the
    forward's [n, V] work in one fused reduction after its matmul, the backward's dz in one pass before its two,
    where eager launches a dozen ops over [n, V]."""
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):  # a LogprobHead, or the Linear it becomes (its attributes stay)
        if backend not in _HEADS:
            _HEADS[backend] = _HeadCalls(backend)
        head._bicc_compiled, head._bicc_compile_ok = _HEADS[backend], True


class _HeadCalls:
    """The head's ``chunk_forward`` and ``chunk_backward`` compiled (dynamic shapes), called as ``bicc.model.head``
    asks: the outputs, or None after a failed compilation (the head then runs eagerly)."""

    def __init__(self, backend):
        self.fns = tuple(torch.compile(fn, dynamic=True, backend=backend) for fn in (chunk_forward, chunk_backward))
        self.traced = [False, False]

    def __call__(self, head, which: int, args):
        # a chunk is a slice of the micro-batch's tokens, whose shape (one row or several) Dynamo would guard on
        args = tuple(_own(a) if isinstance(a, torch.Tensor) else a for a in args)
        if not self.traced[which]:  # each function traced at storage offset 0 (``_at_offset_0``)
            self.traced[which] = True
            args = tuple(_at_offset_0(a) if isinstance(a, torch.Tensor) and a.storage_offset() else a for a in args)
        ok, out = _compiled_call(head, self.fns[which], args, {}, "the log-prob head")
        return out if ok else None


_HEADS: dict = {}  # backend -> its _HeadCalls: one compiled pair per process, whatever the number of heads


def _forward(self, *args, **kwargs):
    """A layer's forward: compiled for the log-prob forwards (no cache, or a cache marked ``bicc_compile`` or
    ``bicc_record``), eager for the rest and after a failed compilation."""
    cache = kwargs.get("past_key_values")
    record = getattr(cache, "bicc_record", False)
    if self._bicc_compile_ok and _compiled_pass(cache):
        if args and not torch.is_grad_enabled() and args[0].requires_grad:
            # under checkpointing HF's input hook makes the embeddings' output require grad even under no_grad: the
            # first layer's input would differ from the others' in what Dynamo guards on, two graphs where one does
            args = (args[0].detach(), *args[1:])
        elif args:
            # FSDP2 hands a layer its input as a view (its post-backward hook), a checkpoint's replay as a plain
            # tensor: Dynamo guards on a view's base, two graphs (and two compilations) where one does
            args = (_own(args[0]), *args[1:])
        index = getattr(getattr(self, "self_attn", None), "layer_idx", None)
        one = None if cache is None or index is None else (Recorder if record else OneLayer)(cache, index)
        fn = self._bicc_recomputed if getattr(self, "_bicc_in_graph", False) else self._bicc_compiled
        ok, out = _compiled_call(self, fn, (self, *args),
                                 kwargs if one is None else {**kwargs, "past_key_values": one}, type(self).__name__)
        if ok:
            if isinstance(one, Recorder):
                one.keep()
            return out
    if getattr(self, "_bicc_in_graph", False):  # the call skipped the eager checkpoint (``_checkpoint``)
        return checkpoint(type(self).forward, self, *args, **self._bicc_checkpoint_kwargs, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _checkpoint(self, fn, *args):
    """A compiled layer's activation checkpoint (transformers calls it with the module's call, FSDP2's hooks
    included): where the call runs compiled with grad and its cache is none or read-only, the checkpoint goes
    inside the compiled function (``_recomputed``); else (the prefix pass's recording cache, a fallen-back layer)
    the eager checkpoint replays the call."""
    cache = getattr(fn, "keywords", {}).get("past_key_values")
    if self._bicc_compile_ok and torch.is_grad_enabled() and (cache is None or getattr(cache, "bicc_compile", False)):
        self._bicc_in_graph = True
        try:
            return fn(*args)
        finally:
            self._bicc_in_graph = False
    return self._bicc_eager_checkpoint(fn, *args)


def _recomputed(layer, *args, **kwargs):
    """A layer's forward under a non-reentrant checkpoint, traced by Dynamo into the graph (a higher-order op):
    AOTAutograd's partitioner saves the checkpoint's inputs (and what its policy keeps) and recomputes, inside the
    layer's compiled backward, only what that backward reads: not the MLP's down projection, whose output nothing
    in the backward needs, and without a pack hook per saved tensor."""
    return checkpoint(type(layer).forward, layer, *args, **layer._bicc_checkpoint_kwargs, **kwargs)


def _compiled_pass(cache) -> bool:
    """Whether a forward with ``cache`` is a log-prob forward, which runs compiled."""
    return cache is None or getattr(cache, "bicc_record", False) or getattr(cache, "bicc_compile", False)


class _Switch:
    """Whether the base model's forward now running is a compiled pass (read by its final norm, rotary embedding)."""

    on = False


def _base_forward(self, *args, **kwargs):
    """The base model's forward, telling its final norm and rotary embedding whether this pass runs compiled."""
    switch, prior = self._bicc_switch, self._bicc_switch.on
    switch.on = _compiled_pass(kwargs.get("past_key_values"))
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        switch.on = prior


def _glue_forward(self, *args, **kwargs):
    """The final norm's or the rotary embedding's forward: once per model forward, outside the layers (eager, a
    few dozen small ops each with the norm's backward); compiled in the passes the layers run compiled."""
    if self._bicc_compile_ok and self._bicc_switch.on:
        rows = _rows(args, kwargs)
        with torch.no_grad() if self._bicc_no_grad else contextlib.nullcontext():
            ok, out = _compiled_call(self, self._bicc_compiled, (self, *_one_row(args, rows)),
                                     dict(zip(kwargs, _one_row(kwargs.values(), rows))), type(self).__name__)
        if ok and rows:  # back to [B, T, ...]
            out = _own(out.view(*rows, *out.shape[2:])) if torch.is_tensor(out) else \
                tuple(_own(t.view(*rows, *t.shape[2:])) for t in out)
        if ok:
            return out
    return type(self).forward(self, *args, **kwargs)


def _rows(args, kwargs):
    """[B, T] where every tensor input is [B, T, ...], else None. The final norm and the rotary embedding work per
    token, so they are called on the tokens as one row: a micro-batch of one row would specialise (Dynamo's 0/1
    specialisation), a second graph for the same math."""
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    rows = tensors[0].shape[:2] if tensors and tensors[0].dim() >= 2 else None
    return rows if rows and all(t.shape[:2] == rows for t in tensors) else None


def _one_row(values, rows) -> list:
    """Each tensor of ``values`` [B, T, ...] as [1, B T, ...] (a tensor of its own) where ``rows``."""
    return [_own(t.reshape(1, -1, *t.shape[2:])) if rows and torch.is_tensor(t) else t for t in values]


def _at_offset_0(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` at storage offset 0, its strides kept. Dynamo specialises offsets (and strides) 0 and 1: a
    head's graph traced on a later chunk (the backward's first call is the last chunk's) guards its offset >= 2,
    and the first chunk's compiles another; one traced at offset 0 takes any. An expanded ``t`` (a stride of 0)
    cannot keep its strides in a copy: it is copied contiguous."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t.clone(memory_format=torch.contiguous_format)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own where it is a view (Dynamo guards on a view's base), sharing its storage."""
    if not t._is_view():
        return t
    return _Plain.apply(t) if t.requires_grad and torch.is_grad_enabled() else t.detach()


def _compiled_call(owner, fn, args, kwargs, what: str) -> tuple[bool, object]:
    """(True, ``fn`` (a compiled function of ``owner``) on the inputs), Python floats constants of the graph, duck
    sizing off (see the module's docstring); (False, None) where compilation failed: it warns once, naming
    ``what`` did not compile, and ``owner`` runs eagerly from then on."""
    dynamo = torch._dynamo.config
    prior = dynamo.specialize_float, _shapes.use_duck_shape
    dynamo.specialize_float, _shapes.use_duck_shape = True, False
    try:
        return True, fn(*args, **kwargs)
    except compile_errors() as error:
        owner._bicc_compile_ok = False
        warnings.warn(f"model.compile: {what} did not compile ({compile_error_cause(error)}); it runs eagerly from here on",
                      stacklevel=3)
        return False, None
    finally:
        dynamo.specialize_float, _shapes.use_duck_shape = prior


class _Plain(torch.autograd.Function):
    """``x`` as a tensor of its own (no view's base), sharing its storage; the gradient passes through."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def compile_errors() -> tuple:
    """What a failed compilation raises (Dynamo's errors, the backend's wrapped in them, Inductor's)."""
    import torch._dynamo
    import torch._inductor.exc

    return torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError


def compile_error_cause(error: Exception) -> str:
    """A compilation error as a warning names it: its type, the backend's own error and its first line."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    return f"{type(error).__name__}, {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:300]}"


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (``model.compile``): one that turns up mid-run is a step
    that paid for its compilation."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
