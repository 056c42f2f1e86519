"""Linears that read the same input, as one matmul: a graph pass of ``model.compile``'s layers.

A decoder layer projects its normed hidden states three times (q, k, v) and the MLP's input twice (gate, up):
seven matmuls forward, fourteen in backward, each one launch (and on CPU a handful of nested ops). ``fusing``
wraps a compile backend so that each layer's Dynamo graph is rewritten first (``fuse_linears``): the linears that
share an input become one linear over their weights concatenated on the output dimension, split after it.
Autograd then derives one matmul for the input's gradient and one for the weights' (split back into each
parameter's own), so a layer runs four matmuls forward and eight in backward.

Only the graph changes: the parameters, their gradients, the state dict and checkpoints are the model's own. The
concatenated weight is one copy per call, cheap next to the matmul it feeds (at Qwen3-4B's width and 24k tokens a
micro-batch, about 1% of the layer's time). It is marked to be recomputed in backward (AOTAutograd's partitioner
reads the mark), so no second copy of the weights waits from forward to backward. The sums run in another order
than the separate matmuls', so values agree to rounding.

Linears are fused only where it changes nothing else: the same input node, bias on all or none, 2-D weights of
one dtype and static shapes, no autocast or grad-mode switch between them, every weight defined before the first.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

_LINEAR = torch._C._nn.linear  # torch.nn.functional.linear, as Dynamo records it
_SWITCHES = {torch.amp._enter_autocast, torch.amp._exit_autocast, torch._C._set_grad_enabled}


def fusing(backend):
    """A Dynamo backend: ``backend`` (a name or a backend) compiling each graph after ``fuse_linears``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_fused(gm: GraphModule, example_inputs):
        for graph in list(gm.modules()):  # the graph, and a checkpoint's body (``bicc.kernels.compile._recomputed``)
            if isinstance(graph, GraphModule):
                fuse_linears(graph)
        return inner(gm, example_inputs)

    return compile_fused


def fuse_linears(gm: GraphModule) -> int:
    """Rewrite ``gm`` in place: each group of linears sharing an input (the rules above) becomes one linear and a
    split. Returns how many linears were folded into others (0: the graph is untouched)."""
    groups, order, region = {}, {}, 0
    for i, node in enumerate(gm.graph.nodes):
        order[node] = i
        if node.op != "call_function":
            continue
        if node.target in _SWITCHES:
            region += 1
        elif node.target is _LINEAR and (key := _key(node, region)) is not None:
            groups.setdefault(key, []).append(node)
    folded = 0
    for linears in groups.values():
        first = linears[0]
        if len(linears) > 1 and all(order[p] < order[first] for n in linears for p in _params(n)):
            _fuse(gm, linears)
            folded += len(linears) - 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _args(node: Node):
    """(input, weight, bias) of a linear node; bias None when it has none."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], args[1], node.kwargs.get("bias", args[2])


def _params(node: Node) -> list:
    _, weight, bias = _args(node)
    return [weight] + ([bias] if bias is not None else [])


def _key(node: Node, region: int):
    """What linears must share to be fused; None where ``node`` cannot be (unknown or dynamic weight shape)."""
    x, weight, bias = _args(node)
    w = weight.meta.get("example_value") if isinstance(weight, Node) else None
    if not isinstance(x, Node) or w is None or w.dim() != 2 or not all(isinstance(s, int) for s in w.shape):
        return None
    if bias is not None and not isinstance(bias, Node):
        return None
    return x, region, w.dtype, w.shape[1], bias is None


def _fuse(gm: GraphModule, linears: list[Node]) -> None:
    """One linear over the concatenated weights (and biases) in place of ``linears``, before the first of them;
    each old linear's users read their slice of its output."""
    x = _args(linears[0])[0]
    weights = [_args(n)[1] for n in linears]
    biases = [_args(n)[2] for n in linears]
    sizes = [w.meta["example_value"].shape[0] for w in weights]
    graph = gm.graph
    with graph.inserting_before(linears[0]):
        weight = graph.call_function(torch.cat, (weights, 0))
        bias = None if biases[0] is None else graph.call_function(torch.cat, (biases, 0))
        out = graph.call_function(_LINEAR, (x, weight, bias))
        parts = graph.call_function(torch.split, (out, sizes, -1))
        pieces = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(linears))]
    where = {k: v for k, v in linears[0].meta.items() if k in ("nn_module_stack", "stack_trace")}
    for node in (weight, bias, out, parts, *pieces):
        if node is not None:
            node.meta.update(where)
    for node in (weight, bias):  # backward concatenates again rather than keep a copy of the weights
        if node is not None:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    for old, piece in zip(linears, pieces):
        old.replace_all_uses_with(piece)
        graph.erase_node(old)
