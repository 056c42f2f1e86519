"""``model.checkpoint_layers``: activation checkpointing on the first N decoder layers only (``all``, N, or ``auto``: the
fewest that fit the memory budget). The update is the fully checkpointed one (fp64, eager and compiled), only the
checkpointed layers run their forward again, what a layer left out keeps is what ``bicc.machine.memory.saved_per_token``
counts, the memory model and ``auto`` follow it, and the config reaches the layers."""

import dataclasses

import pytest
import torch

from bicc.kernels.compile import compile_layers, decoder_layers
from bicc.machine.memory import GIB, QWEN3_4B, Arch, Run, peak, phases, saved_per_token
from bicc.model.load import build_tiny, checkpointed_layers, enable_checkpointing, load_pretrained
from bicc.trainer.fit import checkpoint_setting, knob, launch_check, resolve_checkpoint_layers
from tests.conftest import compose_cfg, run_of
from tests.helpers import ARCH, compiled_layers
from tests.test_compile import update


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def partly_checkpointed(layers):
    model = build_tiny(ARCH, seed=0)[0].double()
    enable_checkpointing(model, "full", layers)
    return model


def count_forwards(model) -> list[int]:
    """Per decoder layer, how often its forward runs with grad (the forward's and the checkpoint's recompute's)."""
    counts = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        def pre_hook(module, args, kwargs, i=i):
            counts[i] += torch.is_grad_enabled()
        layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return counts


@pytest.mark.parametrize("share", [True, False], ids=["kv-reuse", "one-row-per-output"])
def test_checkpointing_the_first_layer_only_gives_the_same_update(share):
    """Four SGD steps over micro-batches of varying shapes: every layer checkpointed, none, and the first of the two
    only give the same loss and weights (fp64); the first layer's forward runs twice per call with grad (its
    recompute), the second's once, as without checkpointing."""
    runs = {}
    for layers in ("all", "0", "1"):
        model = partly_checkpointed(layers)
        counts = count_forwards(model)
        runs[layers] = update(model, share), model, counts
    (expected, full, full_counts) = runs["all"]
    for layers in ("0", "1"):
        metrics, model, _ = runs[layers]
        assert metrics["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
        for p, q in zip(model.parameters(), full.parameters()):
            torch.testing.assert_close(p, q, atol=1e-10, rtol=0)
    none, first = runs["0"][2], runs["1"][2]
    assert none[0] == none[1] > 0 and full_counts == [2 * none[0]] * 2
    assert first == [2 * none[0], none[1]], (first, none)


@pytest.mark.compile
def test_compiled_only_the_checkpointed_layers_take_the_recompute_form():
    """Compiled (aot_eager), the checkpointed first layer traces its recompute into its graph and the second compiles
    its plain forward; the update (one micro-batch of every row, so fewer graphs to compile) is the eager one. make
    test-heavy: the eager form is test_checkpointing_the_first_layer_only_gives_the_same_update."""
    eager = partly_checkpointed("1")
    expected = update(eager, False, one_pass=True)
    model = partly_checkpointed("1")
    assert compile_layers(model, backend="aot_eager") == ARCH.num_hidden_layers
    first, second = decoder_layers(model)
    assert hasattr(first, "_bicc_recomputed") and not hasattr(second, "_bicc_recomputed")
    got = update(model, False, one_pass=True)
    assert compiled_layers(model) == ARCH.num_hidden_layers
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)


def saved_bytes(model, dtype, autocast, rows, tokens) -> tuple[int, int]:
    """(bytes the first layer's forward saves for its backward, bytes of the rotary cos and sin it is handed): each
    storage once, the parameters and the generator's uint8 state left out."""
    layer = decoder_layers(model)[0]
    x = torch.randn(rows, tokens, ARCH.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens).expand(rows, tokens)
    cos, sin = model.model.rotary_emb(x, positions)
    params, seen, kept = {p.data_ptr() for p in model.parameters()}, set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if t.data_ptr() not in params and t.dtype != torch.uint8 and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kept[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
    return kept[0], cos.nbytes + sin.nbytes


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "autocast"])
def test_a_layer_outside_the_checkpoint_keeps_what_the_memory_model_counts(dtype, autocast, compiled):
    """What an uncheckpointed layer keeps for its backward, per token, at two tokens counts (what does not grow with
    them, autocast's bf16 weight copies, cancels): ``saved_per_token`` for its dtype and form, beside the rotary
    cos and sin it is handed (shared by every layer). bf16 is FSDP2's form (bf16 parameters), autocast one
    process's (fp32 weights)."""
    model = build_tiny(ARCH, seed=0)[0].to(dtype).train()
    if compiled:
        compile_layers(model, backend="aot_eager")
    (short, _), (long, rotary) = saved_bytes(model, dtype, autocast, 3, 5), saved_bytes(model, dtype, autocast, 3, 11)
    b = 2 if autocast or dtype == torch.bfloat16 else 4
    arch = Arch(hidden=ARCH.hidden_size, layers=1, heads=ARCH.num_attention_heads, kv_heads=ARCH.num_key_value_heads,
                head_dim=ARCH.head_dim, intermediate=ARCH.intermediate_size, vocab=100, tied=True)
    per_token = (long - short) / (3 * 6) - rotary / (3 * 11)
    assert per_token == saved_per_token(arch, b, compiled, autocast), (per_token, saved_per_token(arch, b, compiled, autocast))


def test_the_memory_model_counts_each_layer_left_out():
    """At Qwen3-4B's preset shape: each layer out of the checkpoint adds its saved activations and drops its input,
    tokens x (saved - H b), for the micro-batch and for the contexts held through the minibatch. The layers'
    backward peaks at the top layer's (outside the checkpoint: every such layer's activations held, and its
    gradients, half a recomputed layer's count) or at the first checkpointed layer's recompute (the layers above
    it done): with one layer out, the latter. ``auto`` picks the fewest checkpointed layers under 90% of the budget; a run
    without ``model.gradient_checkpointing`` counts every layer's activations."""
    run = Run(compiled=True)
    tokens, h = run.micro_batch * run.output_tokens, QWEN3_4B.hidden
    update = {n: phases(QWEN3_4B, dataclasses.replace(run, checkpoint_layers=n))["update: layers backward"]
              for n in (36, 35, 34, 30)}
    total = {n: sum(parts.values()) for n, parts in update.items()}
    assert update[36] == phases(QWEN3_4B, run)["update: layers backward"]
    context = run.contexts * (run.prompt_tokens + int(run.context_ratio * run.output_tokens))
    saved, slack = saved_per_token(QWEN3_4B, 2, True), 1 + run.fragmentation
    assert total[30] - total[34] == pytest.approx(4 * (tokens + context) * (saved - 2 * h) * slack)
    recomputed = update[36]["one layer's recomputed activations"]
    assert update[34]["an uncheckpointed layer's gradients"] == recomputed / 2
    assert "one layer's recomputed activations" not in update[34]
    assert update[30]["uncheckpointed layers' activations (model.checkpoint_layers)"] == 6 * tokens * 109_864
    assert tokens * saved < recomputed / 2  # one layer out: the checkpointed layer below it recomputing is the peak
    assert update[35]["one layer's recomputed activations"] == recomputed
    assert "uncheckpointed layers' activations (model.checkpoint_layers)" not in update[35]
    assert total[35] - total[36] == pytest.approx((context * (saved - 2 * h) - tokens * 2 * h) * slack)
    peaks = {n: peak(QWEN3_4B, dataclasses.replace(run, checkpoint_layers=n))[1] for n in range(37)}
    assert all(peaks[n] >= peaks[n + 1] for n in range(36)) and peaks[19] > peaks[20]  # (then another phase's)
    budget = (peaks[20] + peaks[19]) / 2 / GIB / 0.9  # 20 fit 90% of it, 19 do not
    assert resolve_checkpoint_layers(QWEN3_4B, run, budget) == 20
    assert resolve_checkpoint_layers(QWEN3_4B, run, 1.0) == 36  # none fits: every layer (the check then refuses)
    assert "model.checkpoint_layers" in knob("update: layers backward", dataclasses.replace(run, checkpoint_layers=20))
    assert "model.checkpoint_layers" not in knob("update: layers backward", run)
    cfg = compose_cfg([])
    assert not cfg.model.gradient_checkpointing and checkpoint_setting(cfg.model) == 0
    assert run_of(cfg, 1, False, 80.0, 40).checkpoint_layers == 0
    for setting, counted in (("all", None), ("auto", None), ("3", 3)):
        cfg = compose_cfg(["model.gradient_checkpointing=true", f"model.checkpoint_layers={setting}"])
        assert run_of(cfg, 1, False, 80.0, 40).checkpoint_layers == counted


def test_what_bounds_auto_in_the_presets_is_counted_by_hand():
    """``bench.memory_model.auto_bounds`` at the Qwen3-4B preset: the fewest checkpointed layers that fit (compiled),
    6 + 1.5 FLOPs per layer parameter and token for each checkpointed one, and at the peak the two terms that grow
    with each layer kept, by hand: the 16 contexts of 300 + 819 tokens (held through the minibatch) and the
    micro-batch's 8 x 2,048 tokens, each kept layer 109,864 bytes a token. A smaller micro-batch or fewer contexts
    held never checkpoint more layers."""
    from bench.memory_model import auto_bounds

    run = Run()
    bounds = auto_bounds(QWEN3_4B, run)
    n, compiled = bounds["checkpointed"], dataclasses.replace(run, compiled=True)
    assert n == resolve_checkpoint_layers(QWEN3_4B, compiled, 80.0)
    assert peak(QWEN3_4B, dataclasses.replace(compiled, checkpoint_layers=n))[1] <= 0.9 * 80 * GIB
    assert peak(QWEN3_4B, dataclasses.replace(compiled, checkpoint_layers=n - 1))[1] > 0.9 * 80 * GIB
    assert bounds["flops"] == 6 + 1.5 * n / 36
    kept, context_tokens = 36 - n, 16 * (300 + 819)
    context_kv = context_tokens * 36 * 2 * 8 * 128 * 2  # K and V of every layer, bf16
    contexts = context_tokens * (n * 2560 * 2 + kept * 109_864) + 2 * context_kv
    assert bounds["contexts"] * GIB == pytest.approx(contexts)
    assert bounds["micro-batch"] * GIB == pytest.approx(8 * 2048 * kept * 109_864)
    fewer = [auto_bounds(QWEN3_4B, Run(micro_batch=m))["checkpointed"] for m in (8, 4, 2, 1)]
    assert fewer == sorted(fewer, reverse=True) and fewer[0] == n
    assert auto_bounds(QWEN3_4B, Run(contexts=2))["checkpointed"] < fewer[-1]


def test_the_setting_reaches_the_layers(tmp_path):
    """``model.checkpoint_layers`` through ``load_pretrained`` (the policy, the reference), checked at composition
    and at load, each error naming the field; ``all`` in every preset."""
    from bicc.trainer.validation import validate

    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for setting, flags in (("all", [True, True]), ("auto", [True, True]), ("1", [True, False]), ("0", [False, False])):
        cfg = compose_cfg(["model.gradient_checkpointing=true", f"model.checkpoint_layers={setting}"])
        loaded, _ = load_pretrained(str(tmp_path), cfg.model, torch.device("cpu"))
        assert [layer.gradient_checkpointing for layer in decoder_layers(loaded)] == flags, setting
    for preset in ("tiny", "qwen3_4b_instruct", "phi4_mini", "smollm2_135m"):
        assert compose_cfg([f"model={preset}"]).model.checkpoint_layers == "all"
    with pytest.raises(ValueError, match="model.checkpoint_layers.*from 0 to 2"):
        checkpointed_layers("3", 2)
    with pytest.raises(ValueError, match="'model.checkpoint_layers'.*half"):
        validate(compose_cfg(["model.checkpoint_layers=half"]))


def test_auto_resolves_at_launch_from_the_budget(tmp_path):
    """``bicc.trainer.fit.launch_check`` with ``auto`` and a budget between two layer counts' peaks: the config names the
    count before the model loads, and its line says so; more layers than the model has are refused."""
    from bicc.data import build_task
    from bicc.trainer.fit import predicted_run

    overrides = ["model.gradient_checkpointing=true", "model.checkpoint_layers=auto", "train.memory_check=true"]
    cfg = compose_cfg(overrides)
    task, tokenizer = build_task(cfg.data), build_char_tokenizer_for(cfg)
    arch, run = predicted_run(cfg, task, tokenizer, 1, False, 80.0)
    peaks = [peak(arch, dataclasses.replace(run, checkpoint_layers=n))[1] for n in range(arch.layers + 1)]
    cfg = compose_cfg([*overrides, f"train.memory_gib={(peaks[1] + peaks[2]) / 2 / GIB / 0.9}"])  # auto fills 90%
    line = launch_check(cfg.train, cfg.model, lambda gib: predicted_run(cfg, task, tokenizer, 1, False, gib), torch.device("cpu"))
    assert cfg.model.checkpoint_layers == "2" and f"model.checkpoint_layers=auto: 2 of {arch.layers}" in line
    cfg = compose_cfg(["model.gradient_checkpointing=true", f"model.checkpoint_layers={arch.layers + 1}",
                       "train.memory_gib=100"])
    with pytest.raises(ValueError, match="'model.checkpoint_layers'"):
        launch_check(cfg.train, cfg.model, lambda gib: predicted_run(cfg, task, tokenizer, 1, False, gib), torch.device("cpu"))


def build_char_tokenizer_for(cfg):
    from bicc.model.load import tokenizer_and_positions

    return tokenizer_and_positions(cfg.model)[0]
