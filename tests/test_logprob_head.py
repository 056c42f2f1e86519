"""The chunked log-prob head: equal to full logits in value and gradient whatever the chunk size, never
materialising [B, T, V]; and mixed precision (fp32 master weights, bf16 compute) actually moves the weights
at the paper's learning rate."""

import pytest
import torch

from bicc.config import TinyArchConfig
from bicc.model.load import build_tiny
from bicc.model.logprobs import LogprobHead, entropy_from_logits, install_logprob_head, logprobs_from_logits, token_logprobs

ARCH = TinyArchConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)


def inputs():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (3, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos


def reference_logprobs(model, ids, mask, pos, k, temperature):
    """The slow way: full [B, T, V] logits, then log-softmax."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -k - 1 : -1]
    logits = logits.float() / temperature
    return logprobs_from_logits(logits, ids[:, -k:]), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 5, 29, 4096])  # 29: 29 + 1 positions, one chunk of 30
def test_chunked_head_equals_full_logits(chunk):
    model, _ = build_tiny(ARCH, seed=0)
    ref, _ = build_tiny(ARCH, seed=0)
    assert install_logprob_head(model, chunk) and isinstance(model.lm_head, LogprobHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives the class swap
    ids, mask, pos = inputs()
    a, ent_a = token_logprobs(model, ids, mask, pos, 9, temperature=0.7, with_entropy=True)
    b, ent_b = reference_logprobs(ref, ids, mask, pos, 9, 0.7)
    # fp32: a few ulps of log-probs near -4.6, whose last bits depend on the CPU's vector width (AVX-512, AVX2, none)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-6)
    torch.testing.assert_close(ent_a, ent_b, atol=1e-6, rtol=2e-6)
    w = torch.randn(3, 9, generator=torch.Generator().manual_seed(2))
    for ga, gb in zip(torch.autograd.grad((a * w).sum(), list(model.parameters())),
                      torch.autograd.grad((b * w).sum(), list(ref.parameters()))):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)  # fp32 summation order
    # outside a log-prob request the head is the plain projection (generation, SFT's callers)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert out.shape == (3, 14, model.config.vocab_size)


@pytest.mark.parametrize("chunk", [5, 4096])
def test_bf16_compute_head_equals_full_logits(chunk):
    """fp32 master weights computing in bf16 (the presets' policy): the head's log-probs, entropies and gradients
    equal full bf16 logits upcast to an fp32 log-softmax, the matmuls in bf16 both ways (a chunk kept or
    recomputed)."""
    from bicc.model.logprobs import make_token_batch
    from tests.helpers import full_vocab_logprobs

    model, _ = build_tiny(ARCH, seed=0)
    ref, _ = build_tiny(ARCH, seed=0)
    for m in (model, ref):
        m.bicc_compute_dtype = torch.bfloat16
    install_logprob_head(model, chunk)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (5, 3, 7)]
    outputs = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (9, 4, 6)]
    batch = make_token_batch(prompts, outputs, 0)
    a, ent_a = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, 9, temperature=0.7,
                              with_entropy=True)
    b = full_vocab_logprobs(ref, batch, 0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the entropy of the same bf16 logits, upcast
        _, ent_b = reference_logprobs(ref, batch.input_ids, batch.attention_mask, batch.position_ids, 9, 0.7)
    m = batch.completion_mask
    assert a.dtype == ent_a.dtype == torch.float32
    torch.testing.assert_close(a * m, b, atol=1e-5, rtol=0)
    # fp32 sums over the vocabulary (autocast would run a dot product in bf16: 5e-3 off here)
    torch.testing.assert_close(ent_a * m, ent_b * m, atol=1e-5, rtol=0)
    w = torch.randn(3, 9, generator=torch.Generator().manual_seed(2)) * m
    for ga, gb in zip(torch.autograd.grad((a * w).sum(), list(model.parameters())),
                      torch.autograd.grad((b * w).sum(), list(ref.parameters()))):
        assert ga.dtype == torch.float32
        # one chunk: the same bf16 matmuls, bit for bit; several: each chunk's bf16 partial sum rounded apart, well
        # within bf16's own distance from fp32 (about 1% of a tensor's largest gradient here)
        tol = 1e-6 if chunk > 30 else 0.01 * gb.abs().max().item()
        torch.testing.assert_close(ga, gb, atol=tol, rtol=0)


@pytest.mark.launch
@pytest.mark.parametrize("chunk,bf16", [(4096, False), (5, True)], ids=["kept-fp32", "recomputed-bf16-compute"])
def test_the_compiled_head_equals_full_logits(chunk, bf16, monkeypatch):
    """The head's chunks as ``model.compile`` runs them (Inductor's generated kernels: the forward's reductions and
    the backward's one-pass dz with the onehot as a comparison): log-probs and entropies equal the full logits' at
    temperature 0.7, a chunk kept in fp32, chunks recomputed in bf16 compute over fp32 weights (a GPU's path: the
    presets' micro-batches span several chunks); the gradients equal the full logits' in fp32 and the eager head's
    in bf16 (both round each chunk's bf16 partial sums: the full logits' gradient rounds once). The compiled forward
    and backward both ran, their outputs the compiled head's (the eager functions never ran), and nothing fell back.
    One graph each: the backward's first call is the last chunk's, whose tensors sit at a storage offset >= 2, and a
    graph traced there guards on it (Dynamo specialises offsets 0 and 1), so the first chunk's compiled a third."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import bicc.kernels.compile
    import bicc.model.head

    eager_calls = []  # the eager path's calls on the compiled model's head (the compiled pair holds the originals)
    for name in ("chunk_forward", "chunk_backward"):
        fn = getattr(bicc.model.head, name)
        monkeypatch.setattr(bicc.model.head, name, lambda *a, _fn=fn, _name=name:
                            (a[1] is model.lm_head.weight and eager_calls.append(_name)) or _fn(*a))

    torch._dynamo.reset()
    bicc.kernels.compile._HEADS.clear()
    model, eager, ref = (build_tiny(ARCH, seed=0)[0] for _ in range(3))
    for m in (model, eager, ref):
        m.bicc_compute_dtype = torch.bfloat16 if bf16 else None
    counter = CompileCounterWithBackend("inductor")
    for m in (model, eager):
        install_logprob_head(m, chunk)
    bicc.kernels.compile.compile_head(model, counter)
    ids, mask, pos = inputs()
    a, ent_a = token_logprobs(model, ids, mask, pos, 9, temperature=0.7, with_entropy=True)
    c, _ = token_logprobs(eager, ids, mask, pos, 9, temperature=0.7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # full logits in the compute dtype, upcast
        b, ent_b = reference_logprobs(ref, ids, mask, pos, 9, 0.7)
    tol = dict(atol=1e-5, rtol=0) if bf16 else dict(atol=1e-6, rtol=2e-6)
    torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(ent_a, ent_b, **tol)
    w = torch.randn(3, 9, generator=torch.Generator().manual_seed(2))
    grads = zip(torch.autograd.grad((a * w).sum(), list(model.parameters())),
                torch.autograd.grad(((c if bf16 else b) * w).sum(), list((eager if bf16 else ref).parameters())))
    for ga, gb in grads:
        assert ga.dtype == torch.float32
        torch.testing.assert_close(ga, gb, atol=1e-5 * max(1.0, gb.abs().max().item()), rtol=0)
    assert model.lm_head._bicc_compile_ok and not eager_calls, eager_calls
    assert counter.frame_count == 2, counter.frame_count  # the forward (with entropies) and the backward
    torch._dynamo.reset()


def test_entropy_is_computed_only_when_asked():
    """The entropy's own [n, V] work (the softmax's numerator in a buffer of its own, its dot with the logits)
    runs only for a caller that asks; without it the numerator is exponentiated in the logits' buffer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, _ = build_tiny(ARCH, seed=0)
    install_logprob_head(model, 4096)
    ids, mask, pos = inputs()
    V, seen = model.config.vocab_size, []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() and args[0].shape[-1] == V and func.__name__ in (
                    "exp.default", "mul.Tensor", "linalg_vecdot.default"):
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watch():
        _, none = token_logprobs(model, ids, mask, pos, 9)
    assert none is None and seen == []
    with torch.no_grad(), Watch():
        _, entropy = token_logprobs(model, ids, mask, pos, 9, with_entropy=True)
    assert entropy is not None and "exp.default" in seen


def test_chunked_head_never_builds_the_whole_logits():
    """Peak size of any [*, V] tensor created in the head: one chunk's, not B x T's."""
    model, _ = build_tiny(ARCH, seed=0)
    install_logprob_head(model, 4)
    ids, mask, pos = inputs()
    V, H, biggest = model.config.vocab_size, model.config.hidden_size, []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == V and t.shape != (H, V):
                    biggest.append(t.numel() // V)  # rows of a V-wide activation (the weight's transpose aside)
            return out

    with Watch():
        logp, _ = token_logprobs(model, ids, mask, pos, 9)
        logp.sum().backward()
    assert biggest and max(biggest) <= 4  # rows of V-wide tensors: at most one chunk of 4 tokens (27 kept here)


@pytest.mark.parametrize("chunk,calls,sizes", [(30, 1, [30]), (4096, 1, [30]), (28, 4, [28, 2]), (10, 6, [10] * 3),
                                               (29, 2, [30])])
def test_head_recomputes_only_when_a_forward_spans_several_chunks(chunk, calls, sizes, monkeypatch):
    """The head sees 30 positions (3 rows x (9 outputs + 1)): within one chunk it runs once (its logits kept for
    the backward); across k chunks each runs twice (forward, recomputed in backward): 2 chunks -> 4 calls, 3 -> 6.
    A tail of one token joins the chunk before it (compiled, a chunk of one token is a graph of its own): 29 + 1 is
    one chunk of 30, recomputed (its forward spans more than ``chunk``), where 28 + 2 stay two."""
    import bicc.model.head

    model, _ = build_tiny(ARCH, seed=0)
    install_logprob_head(model, chunk)
    seen, inner = [], bicc.model.head._logits
    monkeypatch.setattr(bicc.model.head, "_logits", lambda h, *a: seen.append(h.shape[0]) or inner(h, *a))
    ids, mask, pos = inputs()
    logp, _ = token_logprobs(model, ids, mask, pos, 9)
    logp.sum().backward()
    assert len(seen) == calls and sum(seen) == (30 if calls == 1 else 60)
    assert seen[: len(sizes)] == sizes


def test_bf16_policy_with_fp32_master_moves_at_lr_1e6(tmp_path):
    """At lr 1e-6 a bf16 parameter rounds most updates away (weights near 1, e.g. RMSNorm, never move);
    the policy holds fp32 master weights and computes in bf16, so one AdamW step changes most weights."""
    from omegaconf import OmegaConf

    from bicc.config import ModelConfig
    from bicc.model.load import load_policy
    from bicc.trainer.checkpoint import save_hf
    from bicc.trainer.optim import build_optimizer

    model, tok = build_tiny(ARCH, seed=0)
    save_hf(model, tok, tmp_path)
    cfg = OmegaConf.structured(ModelConfig(name="t", path=str(tmp_path), dtype="bfloat16"))
    policy, _ = load_policy(str(tmp_path), cfg, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = build_optimizer(policy, 1e-6, (0.9, 0.999), 0.01)
    ids, mask, pos = inputs()
    logp, _ = token_logprobs(policy, ids, mask, pos, 9)
    assert logp.dtype == torch.float32
    (-logp.mean()).backward()
    optimizer.step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(policy.parameters(), before))
    total = sum(b.numel() for b in before)
    assert changed / total > 0.5, changed / total
    # the compute ran in bf16: log-probs differ from an fp32 forward by bf16 rounding, not by 0
    fp32, _ = build_tiny(ARCH, seed=0)
    exact, _ = token_logprobs(fp32, ids, mask, pos, 9)
    with torch.no_grad():
        policy_logp, _ = token_logprobs(policy, ids, mask, pos, 9)
    assert 0 < (policy_logp - exact).abs().max() < 0.1
