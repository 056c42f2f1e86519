"""``model.checkpoint_in_graph`` (``bicc.kernels.compile._recomputed``): a compiled, checkpointed layer's recompute traced
into its compiled backward. The update is the eager one (fp64), each such call runs one matmul fewer than the
eager checkpoint's replay of the compiled forward (the MLP's down projection, whose output no backward reads), the
prefix pass keeps the replay, a policy (``model.checkpoint_policy``) applies inside the graph, and a layer whose
checkpointed graph fails to compile still recomputes, eagerly."""

import warnings

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from bicc.kernels.compile import compile_layers, decoder_layers
from tests.conftest import compose_cfg
from tests.helpers import ARCH, compiled_layers, graph_code
from tests.test_compile import checkpointed_pair, update

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def matmul_counting_backend(ran: list, runs: dict | None = None):
    """AOTAutograd over eager kernels (aot_eager's partitioner) whose compiled forwards and backwards add the matmuls
    their graph holds to ``ran[0]`` on every run; ``runs`` counts each Dynamo graph's runs by what it computes, told
    by its inputs' names: a decoder layer's, the log-prob head's, the loss's, or the glue (norm, rotary)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, example_inputs):
        matmuls = sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)
        run = make_boxed_func(gm)

        def counted(args):
            ran[0] += matmuls
            return run(args)
        counted._boxed_call = True
        return counted

    aot = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)
    if runs is None:
        return aot

    def backend(gm, example_inputs):
        code, run = graph_code(gm), aot(gm, example_inputs)
        kind = ("layer" if "scaled_dot_product_attention" in code else "head" if "L_targets_" in code
                else "loss" if "L_logp_" in code else "glue")

        def counted(*args):
            runs[kind] += 1
            return run(*args)
        return counted
    return backend


def counted_update(model, share, in_graph):
    """(the update's metrics, matmuls its compiled graphs ran, the calls of each compiled form of the layers: the
    in-graph checkpoint's (True) and the plain forward's (False), each as (its cache's type, grad on), and the runs
    of the compiled graphs by kind)."""
    ran, calls, runs = [0], {True: [], False: []}, dict.fromkeys(("layer", "head", "loss", "glue"), 0)
    compile_layers(model, backend=matmul_counting_backend(ran, runs), checkpoint_in_graph=in_graph)
    for layer in decoder_layers(model):
        for name, form in (("_bicc_recomputed", True), ("_bicc_compiled", False)):
            if hasattr(layer, name):
                inner = getattr(layer, name)

                def spy(*a, _inner=inner, _form=form, **k):
                    calls[_form].append((type(k.get("past_key_values")).__name__, torch.is_grad_enabled()))
                    return _inner(*a, **k)
                setattr(layer, name, spy)
    return update(model, share), ran[0], calls, runs


@pytest.mark.parametrize("share,policies", [
    (True, ("full",)), pytest.param(False, ("full",), marks=pytest.mark.slow),
    pytest.param(True, ("full", "save_attention", "recompute_mlp"), marks=pytest.mark.slow)],
    ids=["kv-reuse", "one-row-per-output", "kv-reuse-policies"])
def test_the_recompute_in_the_graph_gives_the_eager_update_with_fewer_matmuls(share, policies):
    """Four SGD steps: eager, compiled with the eager checkpoint replaying the compiled forward, and compiled with
    the checkpoint inside the graph. The same loss and weights (fp64); every layer stays compiled, and every call to
    a compiled layer ran its graph, the head's and the loss's graphs ran too. Dynamo's recompile limit is 1: the
    shapes of the micro-batches and passes (cache or none) need more graphs than that, so a shape guard in a graph
    would send the frame to eager. The in-graph form runs one matmul fewer for each layer call it took (the fused
    q/k/v, the output projection and the fused gate/up are recomputed, the down projection is not), and the replay
    form takes none. It takes the completions' passes with grad alone: the prefix pass (its recording cache keeps
    what the forward saw) is the eager checkpoint's replay, and the no-grad passes need no checkpoint. Under KV
    reuse, a policy applies inside the graph too (AOTAutograd's partitioner): keeping attention skips no matmul
    (its inputs are recomputed), keeping the attention block (``recompute_mlp``) two a call (the fused q/k/v and
    the output projection), each the eager update (a slow form: each policy compiles the update again)."""
    from tests.test_checkpoint_policy import checkpointed

    eager = checkpointed_pair()[0]
    expected = update(eager, share)
    results = {}
    for in_graph, policy in [(False, "full"), *((True, p) for p in policies)]:
        torch._dynamo.reset()
        model = checkpointed(policy)
        with torch._dynamo.config.patch(recompile_limit=1):
            metrics, matmuls, calls, runs = counted_update(model, share, in_graph)
        assert compiled_layers(model) == ARCH.num_hidden_layers
        assert runs["layer"] == len(calls[True]) + len(calls[False]) > 0, (runs, calls)
        assert runs["head"] > 0 and runs["loss"] > 0, runs  # bicc.kernels.compile.compile_head, bicc.kernels.compiled_loss
        assert metrics["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, atol=1e-10, rtol=0)
        results[in_graph, policy] = matmuls, calls
    (replay_mm, replay_calls), (graph_mm, graph_calls) = results[False, "full"], results[True, "full"]
    taken = len(graph_calls[True])
    assert not replay_calls[True] and taken > 0
    assert replay_mm - graph_mm == taken, (replay_mm, graph_mm, taken)
    in_graph = "OneLayer" if share else "NoneType"
    assert set(graph_calls[True]) == {(in_graph, True)}
    plain = set(graph_calls[False])
    assert all(not grad for cache, grad in plain if cache != "Recorder")
    assert (("Recorder", True) in plain) == share
    for policy, fewer in (("save_attention", 0), ("recompute_mlp", 2)):
        if policy in policies:
            assert graph_mm - results[True, policy][0] == fewer * taken, (policy, graph_mm, results[True, policy][0])


def test_a_checkpointed_graph_that_fails_to_compile_still_recomputes():
    """A backend that raises on the in-graph checkpoint's graphs alone: each layer warns once and runs eagerly from
    its first call with grad, which the eager checkpoint still recomputes (the layer's forward runs again in the
    backward, as in the eager model); the update is the eager one."""
    eager, model = checkpointed_pair()

    def broken(gm, example_inputs):
        if "wrap_body" in graph_code(gm):
            raise RuntimeError("no higher-order ops here")
        return lookup_backend("aot_eager")(gm, example_inputs)

    forwards = {"eager": 0, "compiled": 0}
    cls, forward = type(decoder_layers(model)[0]), type(decoder_layers(model)[0]).forward

    def counted(self, *args, **kwargs):
        if not torch.compiler.is_compiling() and torch.is_grad_enabled():
            forwards[counting[0]] += 1
        return forward(self, *args, **kwargs)

    counting = ["eager"]
    cls.forward = counted
    try:
        expected = update(eager, False)
        compile_layers(model, backend=broken)
        counting[0] = "compiled"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = update(model, False)
    finally:
        cls.forward = forward
    messages = [str(w.message) for w in caught if "Qwen3DecoderLayer did not compile" in str(w.message)]
    assert len(messages) == ARCH.num_hidden_layers and all("no higher-order ops here" in m for m in messages)
    assert compiled_layers(model) == 0
    assert forwards["compiled"] == forwards["eager"] > 0
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)


def test_the_config_chooses_the_form(tmp_path):
    """``model.checkpoint_in_graph`` reaches ``compile_layers`` (``bicc.trainer.state``): true by default in every preset;
    false leaves the eager checkpoint in place; an uncheckpointed model gets no in-graph form."""
    from bicc.model.load import build_tiny
    from bicc.trainer.state import build_rl_state

    assert compose_cfg([]).model.checkpoint_in_graph is True
    for preset in ("qwen3_4b_instruct", "phi4_mini", "smollm2_135m"):
        assert compose_cfg([f"model={preset}"]).model.checkpoint_in_graph is True
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for in_graph in (True, False):
        cfg = compose_cfg(["model.compile=on", "model.gradient_checkpointing=true",
                           f"model.checkpoint_in_graph={str(in_graph).lower()}"])
        state = build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"))
        assert all(hasattr(layer, "_bicc_recomputed") == in_graph for layer in decoder_layers(state.model))
    model = checkpointed_pair()[1]
    eager_checkpoint = decoder_layers(model)[0]._gradient_checkpointing_func
    compile_layers(model, backend="aot_eager", checkpoint_in_graph=False)
    layer = decoder_layers(model)[0]
    assert layer._gradient_checkpointing_func is eager_checkpoint and not hasattr(layer, "_bicc_recomputed")
    plain = checkpointed_pair()[1]
    plain.gradient_checkpointing_disable()
    compile_layers(plain, backend="aot_eager")
    assert not hasattr(decoder_layers(plain)[0], "_bicc_recomputed")


@pytest.mark.parametrize("policy", ["full", "save_attention", "recompute_mlp"])
def test_a_compiled_layer_keeps_what_the_memory_model_counts(policy):
    """What one checkpointed layer call with the checkpoint in its graph keeps for its backward, beside the
    parameters: its inputs (hidden states, the rotary cos and sin: the full recompute's) and, per token, what
    ``bicc.machine.memory.kept_per_token`` counts for ``model.checkpoint_policy`` (fp32 here: 4 bytes a value). The generator's
    state kept for attention's recompute (a few KiB of uint8, whatever the tokens) is left out."""
    from bicc.machine.memory import Arch, kept_per_token
    from tests.test_checkpoint_policy import checkpointed

    model = checkpointed(policy).float()
    compile_layers(model, backend="aot_eager")
    layer, (rows, tokens) = decoder_layers(model)[0], (3, 11)
    x = torch.randn(rows, tokens, ARCH.hidden_size, requires_grad=True)
    positions = torch.arange(tokens).expand(rows, tokens)
    cos, sin = model.model.rotary_emb(x, positions)
    params, kept = {p.data_ptr() for p in model.parameters()}, []

    def pack(t):
        if t.data_ptr() not in params and t.dtype != torch.uint8:
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
    assert layer._bicc_compile_ok
    arch = Arch(hidden=ARCH.hidden_size, layers=1, heads=ARCH.num_attention_heads, kv_heads=ARCH.num_key_value_heads,
                head_dim=ARCH.head_dim, intermediate=ARCH.intermediate_size, vocab=100, tied=True)
    inputs = 4 * rows * tokens * (ARCH.hidden_size + 2 * ARCH.head_dim)
    assert sum(kept) == inputs + rows * tokens * kept_per_token(arch, 4, policy), (kept, inputs)
