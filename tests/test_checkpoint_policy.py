"""``model.checkpoint_policy=save_attention``: the checkpointed layers keep their attention's output from the forward,
so a backward's recompute runs every op but attention. The update is the full recompute's (fp64, eager and
compiled), attention runs once per layer call fewer, the memory model counts what is kept, the config reaches it."""

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from bicc.compile import compile_layers, decoder_layers
from bicc.fit import run_of
from bicc.memory import QWEN3_4B, Run, phases
from bicc.models import _keep_attention, build_tiny, checkpoint_kwargs, load_pretrained
from tests.conftest import compose_cfg
from tests.helpers import ARCH, graph_code
from tests.test_compile import update


class CountAttention(TorchDispatchMode):
    """Counts the attention kernel's forwards that run (a kept output, replayed by the checkpoint, never gets here)."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.forwards += "scaled_dot_product" in name and "backward" not in name
        return func(*args, **(kwargs or {}))


def checkpointed(policy: str):
    model = build_tiny(ARCH, seed=0)[0].double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy))
    return model


@pytest.mark.parametrize("share", [True, False], ids=["kv-reuse", "one-row-per-output"])
def test_keeping_attention_gives_the_full_recompute_update_with_fewer_attention_forwards(share):
    """Four SGD steps over micro-batches of varying shapes: the same loss and weights to the last bit, and the
    backward replays no attention: attention runs as often as in a model without checkpointing, where the full
    recompute runs it again for every layer call with grad."""
    runs = {}
    for policy in ("full", "save_attention", None):
        model, counter = (checkpointed(policy) if policy else build_tiny(ARCH, seed=0)[0].double()), CountAttention()
        with counter:
            metrics = update(model, share)
        runs[policy] = metrics["train/loss"], [p.detach().clone() for p in model.parameters()], counter.forwards
    (loss_full, weights_full, full), (loss_kept, weights_kept, kept) = runs["full"], runs["save_attention"]
    assert loss_kept == loss_full
    assert all(torch.equal(a, b) for a, b in zip(weights_kept, weights_full))
    assert kept == runs[None][2] < full


def test_keeping_attention_works_through_compiled_layers():
    """Compiled (a counting aot_eager backend): every layer call, the checkpoint's recompute included, runs the
    compiled graph under the selective checkpoint, and the update is the eager full recompute's."""
    eager, compiled = checkpointed("full"), checkpointed("save_attention")
    graph_runs, calls = [0], [0]

    def backend(gm, example_inputs):
        run = lookup_backend("aot_eager")(gm, example_inputs)
        if "scaled_dot_product_attention" not in graph_code(gm):
            return run
        return lambda *args: graph_runs.__setitem__(0, graph_runs[0] + 1) or run(*args)

    expected = update(eager, True)
    assert compile_layers(compiled, backend=backend) == ARCH.num_hidden_layers
    for layer in decoder_layers(compiled):
        for name in ("_bicc_compiled", "_bicc_recomputed"):
            inner = getattr(layer, name)
            setattr(layer, name, lambda *a, _inner=inner, **k: calls.__setitem__(0, calls[0] + 1) or _inner(*a, **k))
    got = update(compiled, True)
    assert graph_runs[0] == calls[0] > 0
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)


def test_the_policy_keeps_attention_forwards_only():
    aten = torch.ops.aten
    kept = [aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention.default]
    recomputed = [aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, aten.mul.Tensor]
    assert all(_keep_attention(None, op) == CheckpointPolicy.MUST_SAVE for op in kept)
    assert all(_keep_attention(None, op) == CheckpointPolicy.PREFER_RECOMPUTE for op in recomputed)
    assert "context_fn" not in checkpoint_kwargs("full") and "context_fn" in checkpoint_kwargs("save_attention")
    with pytest.raises(ValueError, match="model.checkpoint_policy"):
        checkpoint_kwargs("attention")


def test_the_config_reaches_the_checkpointed_layers(tmp_path):
    """``load_pretrained`` checkpoints each layer with the policy's context (the one ``train.py`` loads through)."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    class ModelCfg:
        dtype, attn_implementation, gradient_checkpointing, padding_free = "float32", "sdpa", True, False
        checkpoint_policy = "save_attention"

    loaded, _ = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    layer = decoder_layers(loaded)[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords["context_fn"].args == (_keep_attention,)
    ModelCfg.checkpoint_policy = "full"
    loaded, _ = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    assert "context_fn" not in decoder_layers(loaded)[0]._gradient_checkpointing_func.keywords


def test_the_memory_model_counts_the_kept_attention():
    """Per GPU at the Qwen3-4B preset (micro-batch 8 x 2,048 outputs, BiCC: 16,384 tokens; 16 contexts of 300 +
    819 tokens): each layer keeps 32 x 128 bf16 values and 32 fp32 log-sum-exps a token, 8,320 bytes; 36 layers."""
    full, kept = phases(QWEN3_4B, Run()), phases(QWEN3_4B, Run(save_attention=True))
    per_token = 32 * 128 * 2 + 4 * 32
    assert per_token == 8_320
    for phase in ("update: layers backward", "update: head backward"):
        assert kept[phase]["kept attention outputs (model.checkpoint_policy)"] == 36 * 8 * 2048 * per_token
        assert "kept attention outputs (model.checkpoint_policy)" not in full[phase]
    contexts = "BiCC contexts (inputs, K/V, K/V gradient)"
    extra = kept["update: layers backward"][contexts] - full["update: layers backward"][contexts]
    assert extra == 16 * (300 + 819) * 36 * per_token
    cfg = compose_cfg(["experiment=paper_qwen3_4b", "model.checkpoint_policy=save_attention"])
    assert run_of(cfg, 4, True, 80.0, 300).save_attention
    assert not run_of(compose_cfg(["experiment=paper_qwen3_4b"]), 4, True, 80.0, 300).save_attention
