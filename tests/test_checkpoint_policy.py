"""``model.checkpoint_policy=save_attention``: the checkpointed layers keep their attention's output from the forward,
so a backward's recompute runs every op but attention. The update is the full recompute's (fp64, eager and
compiled), attention runs once per layer call fewer, the memory model counts what is kept, the config reaches it."""

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from bicc.kernels.compile import compile_layers, decoder_layers
from bicc.machine.memory import QWEN3_4B, Run, kept_per_token, phases
from bicc.model.load import _keep_attention, _KeepAttentionBlock, build_tiny, checkpoint_kwargs, load_pretrained
from tests.conftest import compose_cfg, run_of
from tests.helpers import ARCH, graph_code
from tests.test_compile import update


class CountAttention(TorchDispatchMode):
    """Counts the attention kernel's forwards and the matmuls that run (a kept output, replayed by the checkpoint,
    never gets here)."""

    def __init__(self):
        super().__init__()
        self.forwards = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.forwards += "scaled_dot_product" in name and "backward" not in name
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def checkpointed(policy: str):
    model = build_tiny(ARCH, seed=0)[0].double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy))
    return model


@pytest.mark.parametrize("share", [True, False], ids=["kv-reuse", "one-row-per-output"])
def test_keeping_attention_gives_the_full_recompute_update_with_fewer_attention_forwards(share):
    """Four SGD steps over micro-batches of varying shapes: the same loss and weights to the last bit, and the
    backward replays no attention: attention runs as often as in a model without checkpointing, where the full
    recompute runs it again for every layer call with grad. Keeping the attention block (``recompute_mlp``) also
    keeps its four matmuls (q, k, v, output): of the six the full recompute runs (the checkpoint stops before the
    down projection, whose output no backward reads), two remain (gate, up)."""
    runs = {}
    for policy in ("full", "save_attention", "recompute_mlp", None):
        model, counter = (checkpointed(policy) if policy else build_tiny(ARCH, seed=0)[0].double()), CountAttention()
        with counter:
            metrics = update(model, share)
        runs[policy] = (metrics["train/loss"], [p.detach().clone() for p in model.parameters()], counter.forwards,
                        counter.matmuls)
    loss_full, weights_full, full, full_mm = runs["full"]
    plain_mm = runs[None][3]
    for policy in ("save_attention", "recompute_mlp"):
        loss_kept, weights_kept, kept, kept_mm = runs[policy]
        assert loss_kept == loss_full
        assert all(torch.equal(a, b) for a, b in zip(weights_kept, weights_full))
        assert kept == runs[None][2] < full
    assert runs["save_attention"][3] == full_mm > plain_mm
    assert (runs["recompute_mlp"][3] - plain_mm) * 6 == (full_mm - plain_mm) * 2, (runs["recompute_mlp"][3], full_mm, plain_mm)


@pytest.mark.compile
def test_keeping_attention_works_through_compiled_layers():
    """Compiled (a counting aot_eager backend) with the eager checkpoint replaying the compiled forward (the prefix
    pass's form; every pass's under ``model.checkpoint_in_graph=false``): every layer call, the recompute included,
    runs the compiled graph under the selective checkpoint, and the update is the eager full recompute's. (With the
    checkpoint in the graph: ``tests/test_recompute_in_graph.py``.)"""
    eager, compiled = checkpointed("full"), checkpointed("save_attention")
    graph_runs, calls = [0], [0]

    def backend(gm, example_inputs):
        run = lookup_backend("aot_eager")(gm, example_inputs)
        if "scaled_dot_product_attention" not in graph_code(gm):
            return run
        return lambda *args: graph_runs.__setitem__(0, graph_runs[0] + 1) or run(*args)

    expected = update(eager, True)
    assert compile_layers(compiled, backend=backend, checkpoint_in_graph=False) == ARCH.num_hidden_layers
    for layer in decoder_layers(compiled):
        inner = layer._bicc_compiled
        layer._bicc_compiled = lambda *a, _inner=inner, **k: calls.__setitem__(0, calls[0] + 1) or _inner(*a, **k)
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


def test_keeping_the_attention_block_keeps_the_matmuls_up_to_the_output_projection():
    """``recompute_mlp``'s policy, one per checkpointed call: the matmuls before attention (q, k, v separately, or
    fused into one), attention and the first matmul after it are kept, the MLP's recomputed; the forward and the
    recompute each count their own way through the layer."""
    aten, keep, again = torch.ops.aten, CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    attention, mm, mul = aten._scaled_dot_product_flash_attention_for_cpu.default, aten.mm.default, aten.mul.Tensor

    class Ctx:
        is_recompute = False

    def decisions(ops, policy):
        return [policy(Ctx, op) for op in ops]

    unfused = [mm, mm, mm, mul, attention, mm, mul, mm, mm, mul, mm]  # q k v, attention, o, gate up, down
    want = [keep, keep, keep, again, keep, keep, again, again, again, again, again]
    policy = _KeepAttentionBlock()
    assert decisions(unfused, policy) == want
    Ctx.is_recompute = True  # the recompute starts its own count
    assert decisions(unfused, policy) == want
    fused = [aten.addmm.default, attention, mm, mm, mm]  # q/k/v with a bias, attention, o, gate/up, down
    assert decisions(fused, _KeepAttentionBlock()) == [keep, keep, keep, again, again]
    contexts = checkpoint_kwargs("recompute_mlp")["context_fn"]
    assert contexts.args[1] is _KeepAttentionBlock and contexts() is not contexts()  # a fresh policy per call


def test_the_config_reaches_the_checkpointed_layers(tmp_path):
    """``load_pretrained`` checkpoints each layer with the policy's context (the one ``train.py`` loads through)."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    class ModelCfg:
        dtype, attn_implementation, gradient_checkpointing, padding_free = "float32", "sdpa", True, False
        checkpoint_policy, checkpoint_layers = "save_attention", "all"

    loaded, _ = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    layer = decoder_layers(loaded)[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords["context_fn"].args[1] is _keep_attention
    ModelCfg.checkpoint_policy = "recompute_mlp"
    loaded, _ = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    assert decoder_layers(loaded)[0]._gradient_checkpointing_func.keywords["context_fn"].args[1] is _KeepAttentionBlock
    ModelCfg.checkpoint_policy = "full"
    loaded, _ = load_pretrained(str(tmp_path), ModelCfg, torch.device("cpu"))
    assert "context_fn" not in decoder_layers(loaded)[0]._gradient_checkpointing_func.keywords


def test_the_memory_model_counts_the_kept_attention():
    """Per GPU at the Qwen3-4B preset (micro-batch 8 x 2,048 outputs, BiCC: 16,384 tokens; 16 contexts of 300 +
    819 tokens): each layer keeps 32 x 128 bf16 values and 32 fp32 log-sum-exps a token, 8,320 bytes; 36 layers."""
    full, kept = phases(QWEN3_4B, Run()), phases(QWEN3_4B, Run(checkpoint_policy="save_attention"))
    per_token = 32 * 128 * 2 + 4 * 32
    assert per_token == 8_320
    for phase in ("update: layers backward", "update: head backward"):
        assert kept[phase]["kept activations (model.checkpoint_policy)"] == 36 * 8 * 2048 * per_token
        assert "kept activations (model.checkpoint_policy)" not in full[phase]
    contexts = "BiCC contexts (inputs, K/V, K/V gradient)"
    extra = kept["update: layers backward"][contexts] - full["update: layers backward"][contexts]
    assert extra == 16 * (300 + 819) * 36 * per_token
    block = phases(QWEN3_4B, Run(checkpoint_policy="recompute_mlp"))["update: layers backward"]
    per_block_token = per_token + (32 * 128 + 2 * 8 * 128 + 2560) * 2  # q/k/v and the output projection's outputs
    assert per_block_token == 25_728 and kept_per_token(QWEN3_4B, 2, "recompute_mlp") == per_block_token
    assert block["kept activations (model.checkpoint_policy)"] == 36 * 8 * 2048 * per_block_token
    assert block[contexts] - full["update: layers backward"][contexts] == 16 * (300 + 819) * 36 * per_block_token
    # compiled, the contexts' pass is the eager checkpoint's replay of the compiled forward: its policy sees attention
    # (a fallback kernel) but not Inductor's matmuls, so the contexts keep attention alone
    compiled = phases(QWEN3_4B, Run(checkpoint_policy="recompute_mlp", compiled=True))["update: layers backward"]
    assert compiled[contexts] == kept["update: layers backward"][contexts]
    assert compiled["kept activations (model.checkpoint_policy)"] == block["kept activations (model.checkpoint_policy)"]
    cfg = compose_cfg(["experiment=paper_qwen3_4b", "model.checkpoint_policy=save_attention"])
    assert run_of(cfg, 4, True, 80.0, 300).checkpoint_policy == "save_attention"
    assert run_of(compose_cfg(["experiment=paper_qwen3_4b"]), 4, True, 80.0, 300).checkpoint_policy == "full"
