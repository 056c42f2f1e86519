"""Packed shared-prefix log-probs equal the one-row-per-sample forward, values and gradients."""

import pytest
import torch

from bicc.kernels.packing import pack, packed_logprobs, plan_rows
from tests.helpers import packing_case, prefix_cache_case, tiny, unpacked


def assert_gradients_match(model, a, b, mask):
    """Gradients of the same weighted sum of two [5, 9] log-prob tensors agree to 1e-4."""
    weights = torch.randn(5, 9, generator=torch.Generator().manual_seed(1))
    m = mask.float()
    grads_a = torch.autograd.grad((a * weights * m).sum(), list(model.parameters()))
    grads_b = torch.autograd.grad((b * weights * m).sum(), list(model.parameters()))
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_len", [1000, 20])
def test_packed_equals_unpacked(attn, max_len):
    model, tok = tiny(attn)
    prefixes, keys, completions = packing_case()
    packed = pack(prefixes, keys, completions, max_len=max_len, pad_id=tok.pad_token_id)
    assert packed.input_ids.shape[0] == (2 if max_len == 1000 else len(plan_rows(prefixes, keys, completions, 20)))
    with torch.no_grad():
        a, _ = packed_logprobs(model, packed, len(completions), 9)
        b, batch = unpacked(model, tok, prefixes, completions)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    assert torch.all(a[~m] == 0)


def test_packed_gradients_equal_unpacked():
    model, tok = tiny()
    prefixes, keys, completions = packing_case()
    packed = pack(prefixes, keys, completions, max_len=1000, pad_id=tok.pad_token_id)
    a, _ = packed_logprobs(model, packed, 5, 9)
    b, batch = unpacked(model, tok, prefixes, completions)
    assert_gradients_match(model, a, b, batch.completion_mask)


def test_mask_isolates_outputs():
    prefixes, keys, completions = packing_case()
    packed = pack(prefixes, keys, completions, max_len=1000, pad_id=0)
    # row of prefix A (12 tokens) holds samples 0, 2, 4 of lengths 5, 1, 4 at 12..16, 17, 18..21
    row = [r for r in range(2) if packed.input_ids[r, :12].tolist() == prefixes[0]][0]
    mask = packed.attention_mask[row, 0]
    assert mask[13, 12] and mask[13, 0] and not mask[12, 13]  # output 0: prefix + causal
    assert not mask[17, 12] and mask[17, 11] and mask[17, 17]  # output 1 never sees output 0
    assert packed.position_ids[row, 17].item() == 12 and packed.position_ids[row, 18].item() == 12
    # every output restarts at the prefix's length, also after a longer one: 0..11 | 12..16 | 12 | 12..15
    assert packed.position_ids[row, :22].tolist() == [*range(12), *range(12, 17), 12, *range(12, 16)]
    assert mask[20, :12].all() and mask[20, 18:21].all() and not mask[20, 12:18].any() and not mask[20, 21]
    # prefixes counted once: 12 + 7 prefix tokens + 25 output tokens
    assert packed.num_tokens == 12 + 7 + sum(map(len, completions))


def test_entropy_is_returned_where_asked():
    model, tok = tiny()
    prefixes, keys, completions = packing_case()
    packed = pack(prefixes, keys, completions, max_len=1000, pad_id=tok.pad_token_id)
    with torch.no_grad():
        _, entropy = packed_logprobs(model, packed, 5, 9, with_entropy=True)
    assert entropy[0, :5].gt(0).all() and entropy[2, 1:].eq(0).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prefix_cache_equals_unpacked(attn):
    from tests.helpers import prefix_cache_logprobs

    model, tok = tiny(attn)
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    with torch.no_grad():
        a, ent = prefix_cache_logprobs(model, distinct, prefix_of, completions, 9, tok.pad_token_id, with_entropy=True)
        b, batch = unpacked(model, tok, prefixes, completions)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    assert torch.all(a[~m] == 0) and torch.all(ent[m] > 0)


def test_the_completions_sdpa_mask_is_the_one_transformers_builds():
    """Under SDPA the completions' pass hands the layers its own 4-D mask; it must be the one transformers makes
    of the 2-D key mask: left-padded prefixes (W = 5) then right-padded completions, each query causal."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask

    from bicc.kernels.prefix_cache import _ReadLayer
    from bicc.model.logprobs import reading_mask as _reading_mask

    model, _ = tiny()
    prefix = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    completion = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    keys = torch.cat([prefix, completion], 1)
    cache = DynamicCache()
    cache.layers = [_ReadLayer(torch.zeros(3, 1, 5, 4), torch.zeros(3, 1, 5, 4), torch.arange(3))]
    theirs = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(3, 4, 8), attention_mask=keys,
                                past_key_values=cache, position_ids=torch.arange(4)[None].expand(3, -1))
    ours = _reading_mask(keys, 5)
    assert ours.shape == (3, 1, 4, 9) and torch.equal(ours, theirs)
    # row 0, query 1 (its second completion token): prefix keys 2-4 and completion keys 5-6
    assert ours[0, 0, 1].tolist() == [False, False, True, True, True, True, True, False, False]


def test_prefix_cache_gradients_equal_unpacked():
    from tests.helpers import prefix_cache_logprobs

    model, tok = tiny()
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    a, _ = prefix_cache_logprobs(model, distinct, prefix_of, completions, 9, tok.pad_token_id)
    b, batch = unpacked(model, tok, prefixes, completions)
    assert_gradients_match(model, a, b, batch.completion_mask)


def test_prefix_cache_under_activation_checkpointing_in_train_mode():
    """The presets' combination: KV-reuse packing, activation checkpointing, train mode. transformers drops a
    layer's cache under checkpointing (it crashed with 'NoneType' has no attribute 'batch_select_indices');
    here values and gradients equal one row per output without checkpointing."""
    from tests.helpers import prefix_cache_logprobs

    model, tok = tiny()
    reference, _ = tiny()
    model.gradient_checkpointing_enable()
    model.train(), reference.train()
    prefixes, distinct, prefix_of, completions = prefix_cache_case()
    a, _ = prefix_cache_logprobs(model, distinct, prefix_of, completions, 9, tok.pad_token_id)
    b, batch = unpacked(reference, tok, prefixes, completions)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0)
    weights = torch.randn(5, 9, generator=torch.Generator().manual_seed(1)) * m
    grads_a = torch.autograd.grad((a * weights).sum(), list(model.parameters()))
    grads_b = torch.autograd.grad((b * weights).sum(), list(reference.parameters()))
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-4, rtol=0)
    # the layers' flag is restored: transformers' own cache dropping still applies outside the packing call
    assert not any(hasattr(layer, "_can_checkpoint_with_cache") and "_can_checkpoint_with_cache" in vars(layer)
                   for layer in model.model.layers)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)], ids=["eager", "compiled"])
def test_the_prefix_backward_holds_one_replayed_layer_at_a_time(compiled):
    """Under checkpointing the backward through the prefix forward replays each layer, top layer first. A replay's
    keys/values (and the graph behind them: the layer's norms and projections) must be gone once its layer's
    backward is done: the cache recorded them again on replay and held every layer's to the end of the backward,
    a recomputed K/V branch per layer at once (0.6 GiB a layer at Qwen3-4B's width, bench.memory_tracker).
    Compiled layers (``model.compile``) hand their keys/values out of the graph, and the same rule keeps them."""
    import weakref

    from bicc.kernels.compile import compile_layers
    from bicc.kernels.prefix_cache import _RecordLayer, encode_prefixes

    model, tok = tiny()  # two layers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    torch._dynamo.reset()
    if compiled:
        compile_layers(model, backend="aot_eager")
    _, distinct, _, _ = prefix_cache_case()
    states = encode_prefixes(model, distinct, tok.pad_token_id, detach=True)
    for leaf in states.leaves():
        leaf.grad = torch.ones_like(leaf)
    replayed, alive_at_layer_0 = [], []
    record = _RecordLayer.update

    def watch(self, key_states, value_states, *args, **kwargs):
        replayed.append(weakref.ref(key_states))
        return record(self, key_states, value_states, *args, **kwargs)

    def at_layer_0(module, args, kwargs):  # the bottom layer's replay: every layer above is done by now
        alive_at_layer_0.append(sum(r() is not None for r in replayed))

    handle = model.model.layers[0].register_forward_pre_hook(at_layer_0, with_kwargs=True)
    try:
        _RecordLayer.update = watch
        states.backward()
    finally:
        _RecordLayer.update = record
        handle.remove()
    # layer 1 was replayed, and its keys are gone; compiled, the replay hands none out: the checkpoint's early stop
    # ends it inside the graph's call, once its saved tensors are back
    assert len(replayed) == (0 if compiled else 2) and alive_at_layer_0 == [0]
