"""BiCC's forwards under transformers' flash_attention_2 code path, on CPU.

flash-attn cannot run here, so the kernel is replaced by a small PyTorch one with flash-attn's contract
(ragged sequences given by cumulative lengths; causal masking aligned to the bottom-right corner when
there are fewer queries than keys). Everything else is transformers' own flash-attention plumbing: the
2-D mask, unpadding, the query slice under a cache, the no-padding shortcut. That plumbing is where
packed rows could go silently wrong (a 4-D mask is not a padding mask), so these tests check that the
prefix-cache packing (``train.context_packing_impl=kv``) gives the one-row-per-output log-probs and gradients
under it, and that mask packing refuses to run. The padding-free layout (``bicc.kernels.packing.padding_free``: prefixes
and completions laid end to end, ``cu_seq_lens_*`` kwargs) is checked the same way, and that it embeds exactly
the real tokens. ``tests/test_gpu.py`` repeats the check with the real kernel on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from bicc.kernels.packing import pack, packed_logprobs
from bicc.model.logprobs import make_token_batch
from tests.helpers import prefix_cache_case, prefix_cache_logprobs, tiny, unpacked

CALLS = {"varlen": 0, "dense": 0}


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                     softmax_scale=None, causal=False):
    """flash_attn_varlen_func: q [total_q, H, D], k/v [total_k, Hkv, D]; sequence b is rows
    cu[b]:cu[b+1]. Causal: query i of a sequence with sq queries and sk keys sees keys j <= i + sk - sq."""
    CALLS["varlen"] += 1
    assert dropout_p == 0.0
    # flash-attn's contract: int32 cumulative lengths, one more than the sequences, ending at the token count
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
    out = []
    for b in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]  # [sq, H, D]
        ks = k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]  # [sk, Hkv, D]
        vs = v[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]
        sq, sk = qs.shape[0], ks.shape[0]
        groups = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        mask = torch.arange(sk)[None] <= torch.arange(sq)[:, None] + (sk - sq) if causal else None  # [sq, sk]
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask,
                                           scale=softmax_scale)  # [H, sq, D]
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def reference_dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func: q [B, Sq, H, D], k/v [B, Sk, Hkv, D], no padding."""
    CALLS["dense"] += 1
    B, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    cu = lambda n: torch.arange(B + 1, dtype=torch.int32) * n  # noqa: E731
    out = reference_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(sq), cu(sk), sq, sk, dropout_p,
                           softmax_scale, causal)
    CALLS["varlen"] -= 1
    return out.view(B, sq, *q.shape[2:])


@pytest.fixture
def reference_kernel(monkeypatch):
    """transformers' flash-attention path runs the reference kernels above."""
    import transformers.modeling_flash_attention_utils as fa

    monkeypatch.setattr(fa, "_lazy_imports",
                        lambda *args, **kwargs: (reference_dense, reference_varlen, None, fa._pad_input, fa._unpad_input))
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    monkeypatch.setitem(CALLS, "varlen", 0)
    monkeypatch.setitem(CALLS, "dense", 0)


@pytest.fixture
def flash_model(reference_kernel):
    """(tiny model on transformers' flash_attention_2 path with the reference kernel, SDPA twin, tokenizer)."""
    flash, tok = tiny("flash_attention_2")
    sdpa, _ = tiny("sdpa")
    return flash, sdpa, tok


def test_plain_rows_match_sdpa(flash_model):
    """The harness itself: padded rows (left-padded prompt, right-padded output) agree with SDPA."""
    flash, sdpa, tok = flash_model
    prefixes, _, _, completions = prefix_cache_case()
    with torch.no_grad():
        a, batch = unpacked(flash, tok, prefixes, completions)
        b, _ = unpacked(sdpa, tok, prefixes, completions)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    assert CALLS["varlen"] > 0  # the flash path really ran


@pytest.mark.parametrize("padding_free", [True, False])
def test_prefix_cache_packing_matches_unpacked_sdpa(flash_model, padding_free):
    flash, sdpa, tok = flash_model
    flash.bicc_padding_free = padding_free
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    a, _ = prefix_cache_logprobs(flash, distinct, prefix_of, completions, 9, tok.pad_token_id)
    b, batch = unpacked(sdpa, tok, prefixes, completions)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m].detach(), b[m].detach(), atol=1e-5, rtol=0)
    assert CALLS["varlen"] > 0
    assert all(torch.equal(p, q) for p, q in zip(flash.parameters(), sdpa.parameters()))  # same seed, same weights
    assert_gradients_match_pair(flash, sdpa, a, b, batch.completion_mask)


@pytest.mark.parametrize("padding_free", [True, False])
def test_kv_reuse_through_the_head_equals_full_vocab_logits(flash_model, padding_free):
    """The log-prob head under KV reuse (padded or padding-free rows) against full [B, T, V] logits and an fp32
    log-softmax over one padded row per output, at T 0.7: values and gradients."""
    from tests.helpers import full_vocab_logprobs

    flash, sdpa, tok = flash_model
    flash.bicc_padding_free = padding_free
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    a, _ = prefix_cache_logprobs(flash, distinct, prefix_of, completions, 9, tok.pad_token_id, temperature=0.7)
    batch = make_token_batch(prefixes, completions, tok.pad_token_id)
    b = full_vocab_logprobs(sdpa, batch, 0.7)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m].detach(), b[m].detach(), atol=1e-5, rtol=0)
    assert_gradients_match_pair(flash, sdpa, a, b, batch.completion_mask)


def assert_gradients_match_pair(model_a, model_b, a, b, mask):
    weights = torch.randn(*a.shape, generator=torch.Generator().manual_seed(1))
    m = mask.float()
    grads_a = torch.autograd.grad((a * weights * m).sum(), list(model_a.parameters()))
    grads_b = torch.autograd.grad((b * weights * m).sum(), list(model_b.parameters()))
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-4, rtol=0)


def test_prefix_cache_packing_without_padding(flash_model):
    """Padded layout, one prefix, one full-length output: transformers drops the all-ones mask and FA's
    causal alignment alone must place the output's queries after the cached prefix."""
    flash, sdpa, tok = flash_model
    flash.bicc_padding_free = False
    prefix, completion = list(range(5, 17)), list(range(20, 29))
    with torch.no_grad():
        a, _ = prefix_cache_logprobs(flash, [prefix], [0], [completion], 9, tok.pad_token_id)
        b, _ = unpacked(sdpa, tok, [prefix], [completion])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert CALLS["dense"] > 0


def test_mask_packing_refuses_flash(flash_model):
    flash, _, tok = flash_model
    prefixes, keys, completions = prefix_cache_case()[0], [0, 1, 0, 1, 0], prefix_cache_case()[3]
    packed = pack(prefixes, keys, completions, max_len=1000, pad_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="packing_impl=kv"):
        packed_logprobs(flash, packed, len(completions), 9)


def test_config_rejects_mask_packing_where_flash_runs(monkeypatch):
    """On a machine where flash-attn 2 would run, the config check stops mask packing before any load."""
    import bicc.model.load
    from bicc.trainer.validation import validate
    from tests.conftest import compose_cfg

    monkeypatch.setattr(bicc.model.load, "resolve_attn_implementation", lambda name: name)
    flash = ["bicc=on", "model.attn_implementation=flash_attention_2", "sft.cache_dir=/tmp/x"]
    with pytest.raises(ValueError, match="train.context_packing_impl"):
        validate(compose_cfg([*flash, "train.context_packing_impl=mask"]))
    validate(compose_cfg([*flash, "train.context_packing_impl=kv"]))
    validate(compose_cfg(["bicc=on", "train.context_packing_impl=mask", "sft.cache_dir=/tmp/x"]))  # SDPA: fine


def embedded_tokens(model):
    """A list that collects the token count of every forward of ``model``, and the hook's handle."""
    seen = []
    return seen, model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))


def test_padding_free_embeds_only_real_tokens(flash_model):
    """Two prefixes (12 and 7 tokens), five outputs of 5, 9, 1, 6 and 4 tokens. Padded: the prefixes
    left-padded to 12 (2 x 12 = 24), the outputs less their last token right-padded to 8 (5 x 8 = 40).
    Padding-free: 12 + 7 = 19, then 4 + 8 + 0 + 5 + 3 = 20, the same log-probs."""
    flash, _, tok = flash_model
    _, distinct, prefix_of, completions = prefix_cache_case()
    out = {}
    for padding_free in (False, True):
        flash.bicc_padding_free = padding_free
        seen, hook = embedded_tokens(flash)
        with torch.no_grad():
            out[padding_free], _ = prefix_cache_logprobs(flash, distinct, prefix_of, completions, 9, tok.pad_token_id)
        hook.remove()
        assert seen == ([19, 20] if padding_free else [24, 40])
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=0)


def test_padding_free_micro_batches_by_real_tokens(flash_model):
    """The update's path on a padding-free model: contexts once, length-aware micro-batches planned on real
    tokens (no padding cap), each micro-batch one varlen forward, a backward per micro-batch and one through
    the contexts, in train mode under activation checkpointing: the log-probs and gradient of one SDPA
    forward over every [context; output] row. Outputs of 11, 2, 7, 3, 9, 1, 7 and 3 tokens under a
    16-token budget: 11 | 9 + 7 | 7 + 3 + 3 + 2 + 1 (a padded plan cuts six micro-batches,
    tests/test_batching.py); embedded: the contexts 12 + 9 + 7, then 10 | 8 + 6 | 6 + 2 + 2 + 1 + 0."""
    from bicc.kernels.batching import micro_batches
    from bicc.model.logprobs import batch_logprobs, make_token_batch
    from tests.helpers import kv_case

    flash, sdpa, _ = flash_model
    numerator, _, outputs = kv_case()
    flash.gradient_checkpointing_enable()
    flash.train()
    plan = micro_batches(torch.arange(8), numerator, 8, 16, flash)
    assert [mb.tolist() for mb in plan] == [[0], [4, 2], [6, 3, 7, 1, 5]]
    weights = torch.randn(8, 11, generator=torch.Generator().manual_seed(2))
    seen, hook = embedded_tokens(flash)
    got = torch.zeros(8, 11)
    with numerator.contexts_once(flash, torch.arange(8)):
        for rows in plan:
            logp, _ = numerator.logprobs(flash, rows, 1.0)
            got[rows] = logp.detach()
            (logp * weights[rows]).sum().backward()
    hook.remove()
    assert seen[:4] == [28, 10, 14, 11]  # then the checkpointed layers' replays, which do not embed
    batch = make_token_batch(numerator.contexts.prompt_ids, outputs, 0)
    logp, _ = batch_logprobs(sdpa, batch, 1.0)
    torch.testing.assert_close(got, (logp * batch.completion_mask).detach(), atol=1e-5, rtol=0)
    (logp * batch.completion_mask * weights).sum().backward()
    for p, q in zip(flash.parameters(), sdpa.parameters()):
        assert q.grad.abs().max() > 0
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=0)


def test_paper_steps_padding_free_equal_sdpa(reference_kernel, tmp_path, monkeypatch):
    """What a GPU user runs, on the flash path: two ``rl_step`` calls of the paper's BiCC + RCC (pi_old and
    pi_ref on q, delta from the update) with micro-batches planned by tokens, activation checkpointing in
    train mode, the policy and the reference padding-free; the same rewards, correction, loss and weights
    as the same steps under SDPA (the rollout stays on SDPA in both, so the samples are the same)."""
    import bicc.kernels.prefix_cache
    from bicc.config import StepConfig
    from bicc.model.load import build_tiny
    from bicc.trainer.state import build_rl_state
    from bicc.trainer.step import rl_step
    from tests.conftest import compose_cfg
    from tests.helpers import ARCH, CoinTask

    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = compose_cfg(["bicc=on", "rcc=on", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
                       "rollout.group_size=4", "rollout.max_new_tokens=16", "bicc.min_attempt_tokens=2",
                       "train.micro_batch_tokens=48", "train.micro_batch_size=8", "diag.every=0",
                       "model.gradient_checkpointing=true", "optim.warmup_steps=0", "optim.lr=1e-3"])
    ragged = []  # every padding-free forward builds its cu_seq_lens here
    real = bicc.kernels.prefix_cache._ragged
    monkeypatch.setattr(bicc.kernels.prefix_cache, "_ragged", lambda *a: ragged.append(1) or real(*a))
    runs = {}
    for impl in ("sdpa", "flash_attention_2"):
        s = build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"))
        s.task = CoinTask(s.task)
        generate = s.engine.generate

        def on_sdpa(*args, _models=(s.model, s.ref_model), **kwargs):  # sample on SDPA, score on ``impl``
            for m in _models:
                m.config._attn_implementation = "sdpa"
            try:
                return generate(*args, **kwargs)
            finally:
                for m in _models:
                    m.config._attn_implementation = impl

        s.engine.generate = on_sdpa
        for m in (s.model, s.ref_model):
            m.config._attn_implementation = impl
        CALLS["varlen"], ragged[:] = 0, []
        records = [rl_step(s, StepConfig.of(cfg))[0] for _ in range(2)]
        assert (CALLS["varlen"] > 0) == (len(ragged) > 0) == (impl != "sdpa")
        runs[impl] = records, [p.detach().clone() for p in s.model.parameters()]
    (sdpa, weights_sdpa), (flash, weights_flash) = runs["sdpa"], runs["flash_attention_2"]
    for a, b in zip(sdpa, flash):
        assert a["reward/mean"] == b["reward/mean"] and a["bicc/samples_conditioned_share"] > 0
        assert a["rcc/cov"] == pytest.approx(b["rcc/cov"], abs=1e-5)
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), weights_sdpa))
    apart = max((p - q).abs().max().item() for p, q in zip(weights_sdpa, weights_flash))
    # AdamW divides by sqrt(v): a weight whose gradient is near zero moves by float noise scaled up towards lr
    # (the padded flash path is as far from SDPA: 1.6e-5 of a 2.0e-3 move)
    assert moved > 1e-3 and apart < 1e-2 * moved


def test_start_up_line_says_how_forwards_are_laid_out():
    """``[rl] forwards: ...``: a run that asked for flash-attn and fell back to SDPA (flash-attn not installed)
    says so at start-up, as does one whose rows cannot go padding-free."""
    from bicc.trainer.banner import forward_layout
    from tests.conftest import compose_cfg

    flash, _ = tiny("flash_attention_2")
    sdpa, _ = tiny("sdpa")
    paper = compose_cfg(["bicc=on", "rcc=on", "sft.cache_dir=/tmp/x"])
    assert forward_layout(flash, paper.bicc, paper.train) == "padding-free (flash_attention_2)"
    assert forward_layout(sdpa, paper.bicc, paper.train).startswith(
        "each micro-batch padded to its longest row (attn_implementation=sdpa")
    plain = compose_cfg(["bicc=off", "train.share_prompts=false", "sft.cache_dir=/tmp/x"])
    unshared = forward_layout(flash, plain.bicc, plain.train)
    assert unshared.startswith("padding-free (flash_attention_2) but the rows on q, padded")
    unpacked = compose_cfg(["bicc=on", "train.context_packing=false", "sft.cache_dir=/tmp/x"])
    assert "but BiCC's rows, padded" in forward_layout(flash, unpacked.bicc, unpacked.train)
    flash.bicc_padding_free = False  # model.padding_free=false
    assert forward_layout(flash, paper.bicc, paper.train).startswith("each micro-batch padded")


@pytest.mark.parametrize("completions", [[[5], [], [9]], [[5, 6, 7], [], [9], [8, 4]]])
def test_padding_free_short_and_empty_outputs(flash_model, completions):
    """A 1-token output is predicted by its prefix's last position alone, an empty one has nothing to
    predict: with only those there is no completion forward at all (one forward embeds 12 + 7 tokens)."""
    flash, sdpa, tok = flash_model
    distinct = prefix_cache_case()[1]
    prefix_of = [0, 1, 0, 1][: len(completions)]
    seen, hook = embedded_tokens(flash)
    with torch.no_grad():
        a, _ = prefix_cache_logprobs(flash, distinct, prefix_of, completions, 4, tok.pad_token_id)
        b, batch = unpacked(sdpa, tok, [distinct[k] for k in prefix_of], completions)
    hook.remove()
    assert seen[0] == 19 and len(seen) == (1 if max(map(len, completions)) == 1 else 2)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[:, : m.shape[1]][m], b[m], atol=1e-5, rtol=0)
    assert (a[:, : m.shape[1]][~m] == 0).all() and (a[:, m.shape[1]:] == 0).all()


@pytest.mark.parametrize("padding_free", [True, False])
def test_one_token_outputs_of_a_sharded_model_still_run_every_layer(flash_model, padding_free, monkeypatch):
    """A micro-batch whose outputs are all one token needs only the prefixes' last logits; it skipped the model
    forward, so under FSDP2 that rank gathered (and reduce-scattered) no layer while the others did: collectives
    out of step. A sharded model now runs every layer forward and backward, and the log-probs are unchanged.
    (Unsharded, the forward is still skipped: ``test_padding_free_short_and_empty_outputs``.)"""
    import bicc.kernels.prefix_cache

    monkeypatch.setattr(bicc.kernels.prefix_cache, "is_sharded", lambda model: True)
    flash, sdpa, tok = flash_model
    flash.bicc_padding_free = padding_free
    layers = flash.model.layers
    calls = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in layers]
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    ones = [c[:1] for c in completions]
    try:
        a, _ = prefix_cache_logprobs(flash, distinct, prefix_of, ones, 9, tok.pad_token_id)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 2 * len(layers)  # the prefixes' forward, then the outputs' (a stand-in token)
    a.sum().backward()
    assert all(p.grad is not None for p in layers[-1].parameters())
    b, _ = unpacked(sdpa, tok, prefixes, ones)
    torch.testing.assert_close(a[:, 0].detach(), b[:, 0].detach(), atol=1e-5, rtol=0)
    assert (a[:, 1:] == 0).all()
