"""Linears that share an input, fused into one matmul in a Dynamo graph (``bicc.kernels.fuse``): the rewritten graph gives
the eager values and gradients (fp64), and fuses only where nothing else changes. Dynamo runs for real; the
backend is AOTAutograd over eager kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

from bicc.kernels.fuse import fusing


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def through_graph(fn, *inputs):
    """``fn(*inputs)`` compiled with ``fusing``, every input after the first static in shape as parameters are
    (the pass fuses static weights only): (its outputs, how many linears each graph kept after the pass)."""
    kept = []
    for t in inputs[1:]:
        torch._dynamo.mark_static(t)

    def backend(gm, example_inputs):
        kept.append(sum(n.target is torch._C._nn.linear for n in gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)

    return torch.compile(fn, backend=fusing(backend), dynamic=True)(*inputs), kept


def leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def assert_same(fn, inputs, kept_linears):
    """The compiled (fused) ``fn`` keeps ``kept_linears`` linears and gives eager's outputs and input gradients."""
    got, kept = through_graph(fn, *inputs)
    want = fn(*inputs)
    assert kept == [kept_linears]
    got, want = [got] if torch.is_tensor(got) else list(got), [want] if torch.is_tensor(want) else list(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)
    # a weighting per output element, so that every output (and each slice of the fused one) counts differently
    probe = lambda outs: sum((o.double() * torch.linspace(0.5, 2, o.numel(), dtype=torch.float64).view(o.shape)).sum()  # noqa: E731
                             for o in outs)
    grads = torch.autograd.grad(probe(got), inputs, allow_unused=True)
    expected = torch.autograd.grad(probe(want), inputs, allow_unused=True)
    for g, w in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_q_k_v_sharing_an_input_become_one_linear():
    """Three projections of one input (output sizes 5, 3, 2) fold into one; the output projection, reading another
    input, stays its own: 4 linears -> 2, values and every weight's gradient as eager."""

    def attention_like(x, wq, wk, wv, wo):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)  # [2, 3, 5], [2, 3, 3], [2, 3, 2]
        return F.linear(q * k.sum(-1, keepdim=True), wo) + v.mean(-1, keepdim=True)

    assert_same(attention_like, leaves((2, 3, 4), (5, 4), (3, 4), (2, 4), (4, 5)), kept_linears=2)


def test_biases_fuse_with_their_weights_and_never_half():
    def both(x, w1, b1, w2, b2):
        return F.linear(x, w1, b1), F.linear(x, w2, b2)

    def one(x, w1, b1, w2, b2):
        return F.linear(x, w1, b1), F.linear(x, w2)

    inputs = leaves((3, 4), (2, 4), (2,), (6, 4), (6,))
    assert_same(both, inputs, kept_linears=1)
    torch._dynamo.reset()
    assert_same(one, inputs, kept_linears=2)


def test_no_fusion_across_an_autocast_switch():
    """One linear inside autocast and one outside compute in different dtypes: fused they would share one."""

    def mixed(x, w1, w2):
        a = F.linear(x, w1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = F.linear(x, w2)
        return a, b.double()

    x, w1, w2 = [t.detach().float().requires_grad_() for t in leaves((3, 4), (2, 4), (5, 4))]
    got, kept = through_graph(mixed, x, w1, w2)
    assert kept == [2]
    torch.testing.assert_close(got[0], mixed(x, w1, w2)[0], atol=0, rtol=0)


def test_no_fusion_of_a_weight_computed_from_the_first_linear():
    """The second weight depends on the first linear's output: the one linear would need it before it exists."""

    def dependent(x, w1, w2):
        a = F.linear(x, w1)
        return a, F.linear(x, w2 * a.mean())

    assert_same(dependent, leaves((3, 4), (2, 4), (5, 4)), kept_linears=2)


def test_backward_concatenates_again_rather_than_keep_a_copy_of_the_weights():
    """The concatenated weight [7, 4] is recomputed in backward from the parameters (kept anyway), not saved from
    forward: saved, it would hold a second copy of every fused weight from forward to backward. AOTAutograd's
    min-cut partitioner (Inductor's) decides what backward receives."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    received = []

    def backward(gm, example_inputs):
        received.extend(tuple(x.shape) for x in example_inputs if torch.is_tensor(x))
        return make_boxed_func(gm)

    def two(x, w1, w2):
        return F.linear(x, w1) * F.linear(x, w2).sum(-1, keepdim=True)

    x, w1, w2 = leaves((3, 4), (2, 4), (5, 4))
    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm), bw_compiler=backward,
                           partition_fn=min_cut_rematerialization_partition)
    for t in (w1, w2):
        torch._dynamo.mark_static(t)
    out = torch.compile(two, backend=fusing(backend))(x, w1, w2)
    grads = torch.autograd.grad(out.sum(), (x, w1, w2))
    assert received and (7, 4) not in received and (2, 4) in received and (5, 4) in received, received
    for g, w in zip(grads, torch.autograd.grad(two(x, w1, w2).sum(), (x, w1, w2))):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_in_bf16_the_fused_graph_is_as_close_to_fp64_as_eager():
    """bf16 weights, as FSDP2's compute copies are: the fused q/k/v's values and every gradient stay within bf16's
    tolerance of the fp64 computation on the same bf16 numbers, as eager's do (one matmul accumulates over the
    fused outputs in fp32 where eager adds three rounded products in x's gradient)."""

    def attention_like(x, wq, wk, wv):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        return q * k + v

    exact = leaves((4, 6, 64), (48, 64), (48, 64), (48, 64), seed=1)
    low = [t.detach().bfloat16().requires_grad_() for t in exact]
    exact = [t.detach().double().requires_grad_() for t in low]  # the same numbers, in fp64
    fused, kept = through_graph(attention_like, *low)
    assert kept == [1] and fused.dtype == torch.bfloat16
    eager = attention_like(*low)
    want = attention_like(*exact)
    weights = torch.linspace(0.5, 2, want.numel(), dtype=torch.float64).view(want.shape)
    wanted = torch.autograd.grad((want * weights).sum(), exact)
    for got in (fused, eager):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())
        grads = torch.autograd.grad((got.double() * weights).sum(), low)
        for g, w in zip(grads, wanted, strict=True):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=1e-2 * w.abs().max().item())
