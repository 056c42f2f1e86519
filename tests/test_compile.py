"""Compiled decoder layers (``model.compile``, ``bicc.kernels.compile``): the same update as eager under activation
checkpointing and KV reuse, a fallback to eager when compilation fails, generation left eager, copies that run
their own weights. Dynamo runs for real here; the backend is AOTAutograd over eager kernels (``aot_eager``: the
graphs, the joint forward/backward and the checkpoint's replay of them, without Inductor's C++ build, which a slow
test runs end to end)."""

import copy
import dataclasses
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.testing import CompileCounterWithBackend

from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.compile import (
    _at_offset_0,
    compile_layers,
    decoder_layers,
    should_compile,
)
from bicc.kernels.compiled_loss import _CompiledLoss, loss_function
from bicc.kernels.rows import QueryRows, query_rows
from bicc.method.losses import LOSSES, StepTotals
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.state import RLState
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, compiled_layers, graph_code, graph_nodes, rows, run_train
from tests.losses.helpers import LOSS_OF, VARIANTS, random_case

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def checkpointed_pair():
    """Two equal fp64 tiny models in train mode with activation checkpointing: (eager, to be compiled)."""
    models = [build_tiny(ARCH, seed=0)[0].double() for _ in range(2)]
    for m in models:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return models


def update(model, share: bool, one_pass: bool = False):
    """Two epochs x two minibatches of three prompts x four outputs, micro-batches of 5 rows and by tokens (so their
    shapes vary), SGD: the weights after it are the gradients' sum. ``one_pass``: one micro-batch of all 12 rows."""
    shapes = (["train.micro_batch_size=12"] if one_pass else
              ["train.minibatches_per_rollout=2", "train.epochs_per_rollout=2", "train.micro_batch_size=5",
               "train.micro_batch_tokens=40"])
    cfg = compose_cfg([*shapes, "rollout.max_new_tokens=9", "optim.clip_grad=1e9"])
    prompts, completions = rows()
    prompts = [prompts[i // 4] for i in range(12)]
    batch = make_token_batch(prompts, completions, 0)
    numerator = query_rows(batch, prompts, completions, share, 0, torch.device("cpu"))
    old = logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0)
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = RLState(model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 0, 100, 1.0))
    metrics, _ = update_policy(state, batch, numerator, old, None, adv, cfg, step_seed=7)
    return metrics


def test_every_layer_runs_the_same_graphs_under_kv_reuse():
    """A deeper model compiles no more graphs: each layer is handed its own layer of the KV-reuse cache. (Indexing
    the cache by the layer's number inside the graph made Dynamo specialise on it, a graph per layer: 12 at 2
    layers, 21 at 4, and minutes of Inductor per layer at Qwen3-4B's width.)"""
    frames = []
    for layers in (2, 4):  # (at one layer, one graph fewer)
        torch._dynamo.reset()
        model = build_tiny(dataclasses.replace(ARCH, num_hidden_layers=layers), seed=0)[0].double()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        counter = CompileCounterWithBackend("aot_eager")
        compile_layers(model, backend=counter)
        update(model, share=True, one_pass=True)
        assert compiled_layers(model) == layers
        frames.append(counter.frame_count)
    assert frames[0] == frames[1] > 0, frames


def test_a_no_grad_pass_compiles_one_graph_for_all_its_layers():
    """Under activation checkpointing HF makes the embeddings' output require grad even under no_grad (an input
    hook), so in the no-grad passes (pi_old, pi_ref) the first layer's input required grad and the others' did
    not: Dynamo guards on that, and each of those passes compiled every layer twice (two of a run's eight layer
    graphs on a GPU's cold start). The no-grad passes give the layers an input that does not require grad."""
    layer_graphs = []

    def backend(gm, example_inputs):
        if "scaled_dot_product_attention" in graph_code(gm):
            layer_graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    eager, model = checkpointed_pair()
    compile_layers(model, backend=backend)
    prompts, completions = rows()
    batch = make_token_batch(prompts[:2], completions[:2], 0)
    got = logprobs_no_grad(model, QueryRows(batch), 2, 2, 1.0)
    assert len(layer_graphs) == 1, len(layer_graphs)  # every layer, its input requiring grad or not
    torch.testing.assert_close(got, logprobs_no_grad(eager, QueryRows(batch), 2, 2, 1.0), atol=1e-12, rtol=0)
    assert compiled_layers(model) == ARCH.num_hidden_layers


def test_the_prefix_pass_runs_compiled_and_the_floats_are_constants():
    """Under KV reuse the prompts' prefix pass (which records each layer's keys/values for the completions) runs
    the compiled layers as the completions' pass does: no decoder layer's eager forward runs in the update, its
    checkpointed replays included. And a layer's Python floats (its norms' eps, the attention's scale) are
    constants of its graphs, not inputs: Dynamo's default lifts each into a 0-d tensor on every call
    (``aten::lift_fresh``), and on CUDA Inductor's wrapper reads each back with ``.item()`` (7,506 of an update's
    131,665 ops on an H200 at 28 layers). Each layer's graph runs four matmuls forward, not seven (``bicc.kernels.fuse``:
    q, k and v one, gate and up one). The base model's final norm and rotary embedding, outside the layers, run
    their compiled graphs once per model forward, their floats (the norm's eps, the rotary's scaling) constants
    too; generation leaves them eager (``test_generation_stays_eager_and_a_copy_runs_its_own_weights``)."""
    graphs, linears, glue = [], [], {"norm": 0, "rotary": 0}

    def backend(gm, example_inputs):
        run = lookup_backend("aot_eager")(gm, example_inputs)
        scalars = [x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()]
        code = graph_code(gm)
        if "scaled_dot_product_attention" in code:  # a layer's graph (the loss's takes the step's totals)
            graphs.append(len(scalars))
            linears.append(sum(n.target is torch._C._nn.linear for n in graph_nodes(gm)))
        elif ".cos()" in code or "rsqrt" in code:  # the rotary embedding's or the final norm's
            graphs.append(len(scalars))
            kind = "rotary" if ".cos()" in code else "norm"
            return lambda *args: glue.__setitem__(kind, glue[kind] + 1) or run(*args)
        return run

    model = checkpointed_pair()[1]
    compile_layers(model, backend=backend)
    cls = type(decoder_layers(model)[0])
    eager, forward, forwards = [], cls.forward, []

    def counted(self, *args, **kwargs):
        if not torch.compiler.is_compiling():  # run, not traced (a checkpoint's body traced into the graph)
            eager.append(type(kwargs.get("past_key_values")).__name__)
        return forward(self, *args, **kwargs)

    cls.forward = counted
    model.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        update(model, share=True)
    finally:
        cls.forward = forward
    assert compiled_layers(model) == ARCH.num_hidden_layers and eager == [], eager
    assert graphs and set(graphs) == {0}, graphs  # no graph takes a float scalar as an input
    assert set(linears) == {4}, linears
    assert glue["norm"] == glue["rotary"] == len(forwards) > 0, (glue, len(forwards))
    assert torch._dynamo.config.specialize_float is False  # the setting is the layers' own, not the process's


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_compiled_loss_is_the_registered_one(variant):
    """Each preset's loss through ``torch.compile`` (aot_eager: Dynamo's trace and AOT autograd's backward) gives
    the registered loss's value, metrics and gradient in fp64, on two micro-batches of other shapes and step
    totals, with the sampler's weights; in one graph (no break), which the second call reuses: the totals are
    the graph's inputs, not constants that would recompile it every step."""
    fn = LOSSES.get(LOSS_OF[variant])
    if getattr(fn, "micro_batch_statistics", False):  # data-dependent selection runs as registered
        model = build_tiny(ARCH, seed=0)[0]
        compile_layers(model, backend="aot_eager")
        assert loss_function(model, LOSS_OF[variant]) is fn and isinstance(loss_function(model, "grpo"), _CompiledLoss)
        return
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _CompiledLoss(fn, counter)
    torch._dynamo.utils.counters.clear()
    frames = []
    for seed, n, length in ((0, 8, 6), (1, 5, 9)):
        logp, old, ref, adv, mask = random_case(seed, n, length)
        weight = 0.5 + torch.rand(n, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        totals = StepTotals.of(mask, 12)
        ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        got, got_metrics = compiled(ours, old, ref, adv, mask, VARIANTS[variant], totals, is_weight=weight)
        want, want_metrics = fn(theirs, old, ref, adv, mask, VARIANTS[variant], totals, is_weight=weight)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
        assert got_metrics.keys() == want_metrics.keys()
        for name, value in want_metrics.items():
            torch.testing.assert_close(got_metrics[name], value, atol=1e-12, rtol=0, msg=name)
        frames.append(counter.frame_count)
    assert compiled.ok and frames[0] > 0 and frames[1] == frames[0]  # the second call compiled nothing
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_under_inductor_is_the_registered_one(dtype):
    """The loss as ``model.compile`` runs it (Inductor's generated kernels, not only the trace): DAPO's (token-mean,
    clip-higher, importance weights) value and gradient equal the registered loss's in fp32, and from bf16
    log-probs (a GPU's compute dtype; the head hands the loss fp32) to bf16's precision."""
    fn = LOSSES.get("grpo")
    compiled = _CompiledLoss(fn, "inductor")
    logp, old, ref, adv, mask = (t.to(dtype) for t in random_case(3, n=6, length=7))
    weight = (0.5 + torch.rand(6, 7, generator=torch.Generator().manual_seed(3))).to(dtype)
    totals = StepTotals.of(mask, 7)
    ours, theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    got, got_metrics = compiled(ours, old, ref, adv, mask, VARIANTS["dapo"], totals, is_weight=weight)
    want, want_metrics = fn(theirs, old, ref, adv, mask, VARIANTS["dapo"], totals, is_weight=weight)
    got.backward()
    want.backward()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert compiled.ok
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(ours.grad, theirs.grad, **tol)
    for name, value in want_metrics.items():
        torch.testing.assert_close(got_metrics[name].to(value.dtype), value, **tol, msg=name)


def test_the_loss_is_compiled_where_the_layers_are():
    """``loss_function``: the registered loss for an eager model, one compiled form per loss and backend where the
    layers run compiled; and a loss whose compilation fails warns once and gives the registered loss's value."""
    model = build_tiny(ARCH, seed=0)[0]
    assert loss_function(model, "grpo") is LOSSES.get("grpo")

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler on this host")

    compile_layers(model, backend=broken)
    compiled = loss_function(model, "grpo")
    assert isinstance(compiled, _CompiledLoss) and loss_function(model, "grpo") is compiled
    logp, old, ref, adv, mask = random_case(0)
    totals = StepTotals.of(mask, 6)
    with pytest.warns(UserWarning, match="the loss grpo_loss did not compile.*no compiler on this host"):
        got, _ = compiled(logp, old, ref, adv, mask, VARIANTS["grpo"], totals)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: eager from then on
        again, _ = compiled(logp, old, ref, adv, mask, VARIANTS["grpo"], totals)
    want, _ = LOSSES.get("grpo")(logp, old, ref, adv, mask, VARIANTS["grpo"], totals)
    assert not compiled.ok and got.item() == want.item() == again.item()


def test_a_layer_that_fails_to_compile_runs_eagerly():
    """A backend that raises: one warning naming the error per compiled module (each layer, the final norm, the
    rotary embedding, the log-prob head), every one eager from then on, the eager update."""
    eager, compiled = checkpointed_pair()

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler on this host")

    compile_layers(compiled, backend=broken)
    expected = update(eager, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = update(compiled, True)
    messages = [str(w.message) for w in caught if "model.compile" in str(w.message)]
    # the layers fell back in the old policy's pass, before the update: its loss is the registered one, eager
    modules = sorted(m.split()[1] for m in messages if "log-prob head" not in m)
    assert modules == ["Qwen3DecoderLayer"] * ARCH.num_hidden_layers + ["Qwen3RMSNorm", "Qwen3RotaryEmbedding"]
    assert sum("the log-prob head did not compile" in m for m in messages) == 1
    assert all("no compiler on this host" in m for m in messages)
    assert compiled_layers(compiled) == 0
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


def test_adapted_layers_compile_to_the_eager_update_and_pi_ref_runs_them_off():
    """model.lora with model.compile: the adapters train through the compiled layers (their update equals eager's,
    the frozen base untouched), and pi_ref's pass, the same compiled layers with the adapters off, is the base's
    log-probs."""
    from bicc.model.lora import AdaptersOff, add_adapters, module_of

    lora = SimpleNamespace(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    eager, compiled = checkpointed_pair()
    base = copy.deepcopy(eager)
    for m in (eager, compiled):
        add_adapters(m, lora, torch.float64)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B off zero, so that the adapters change the policy
            for name, p in m.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    counter = CompileCounterWithBackend("aot_eager")
    compile_layers(compiled, backend=counter)
    frozen = {n: p.clone() for n, p in compiled.named_parameters() if not p.requires_grad}
    adapters = {n: p.clone() for n, p in compiled.named_parameters() if p.requires_grad}
    expected, got = update(eager, True, one_pass=True), update(compiled, True, one_pass=True)
    assert counter.frame_count > 0 and compiled_layers(compiled) == ARCH.num_hidden_layers
    assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-12)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    prompts, completions = rows()
    batch = make_token_batch(prompts[:2], completions[:2], 0)
    with module_of(AdaptersOff(compiled)) as module:
        off = logprobs_no_grad(module, QueryRows(batch), 2, 2, 1.0)
    on = logprobs_no_grad(compiled, QueryRows(batch), 2, 2, 1.0)
    torch.testing.assert_close(off, logprobs_no_grad(base, QueryRows(batch), 2, 2, 1.0), atol=1e-12, rtol=0)
    assert not torch.allclose(on, off)
    assert all(not torch.equal(p, adapters[n]) for n, p in compiled.named_parameters() if n in adapters)  # they trained


def test_generation_stays_eager_and_a_copy_runs_its_own_weights():
    """HF generate (its own growing cache) never enters the compiled graphs; a deep copy of a compiled model (the
    HF sampler beside FSDP2, ``bicc.model.load.compute_copy``) computes with the copy's weights, not the original's."""
    model, tok = build_tiny(ARCH, seed=0)
    counter = CompileCounterWithBackend("eager")
    compile_layers(model, backend=counter)
    ids = torch.tensor([[5, 6, 7, 8]])
    model.eval().generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert counter.frame_count == 0
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.model.layers.parameters():
            p.mul_(0.5)
        out, out_copy = model(ids, use_cache=False).logits, copied(ids, use_cache=False).logits  # as the log-prob passes
    assert counter.frame_count >= 1 and compiled_layers(copied) == ARCH.num_hidden_layers
    assert not torch.allclose(out, out_copy)
    fresh = build_tiny(ARCH, seed=0)[0].eval()
    with torch.no_grad():
        torch.testing.assert_close(out, fresh(ids, use_cache=False).logits)


def test_model_compile_setting():
    assert compose_cfg([]).model.compile == "off"
    assert compose_cfg(["model.compile=auto"]).model.compile == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [should_compile(s, cpu) for s in ("off", "on", "auto")] == [False, True, False]
    assert [should_compile(s, cuda) for s in ("off", "on", "auto")] == [False, True, True]


@pytest.mark.parametrize("policies,steps", [
    (("full",), 1),
    pytest.param(("full", "recompute_mlp"), 2, marks=pytest.mark.slow),
    pytest.param(("save_attention",), 2, marks=pytest.mark.slow)],
    ids=["full", "full-then-recompute_mlp", "save_attention"])
def test_the_headline_form_trains_compiled_under_torchrun_and_fsdp2(tmp_path, policies, steps):
    """What ``make gpu-check ARGS=--compile`` runs on a GPU, on this CPU: ``torchrun --nproc_per_node=1 train.py``
    (a process group, FSDP2 with bf16 parameters over fp32 master weights) with ``model.compile=on`` (Inductor's
    compiled layers and loss), the headline form (DAPO, BiCC + RCC, KV reuse, checkpointing, recomputing all of a
    layer, keeping its attention or its attention block: ``model.checkpoint_policy``), both evaluations. ``make
    test`` trains one step and saves it (a compiled process costs minutes of Dynamo on a slow CPU); the slow forms
    train two. With two policies, in two legs as the check runs them (step 1 and a checkpoint; a new process
    resuming from it, which compiles again, for step 2), the second under the second policy and with its first
    layer alone checkpointed (``model.checkpoint_layers=1``: what a layer keeps for its backward is no part of the
    run's state)."""
    run_dir = tmp_path / "run"
    args = ["model.compile=on", "model.gradient_checkpointing=true",
            "algo=dapo", "bicc=on", "rcc=on",
            "dist.strategy=fsdp2", "dist.param_dtype=bfloat16", "sft.steps=5", "sft.batch_size=8",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=16",
            "bicc.min_attempt_tokens=4", "data.reward=tests.rewards:first_of_group", "data.reward_batched=true",
            "eval.num_problems=4", "eval.samples_per_problem=1", "eval.max_new_tokens=16",
            f"hydra.run.dir={run_dir}", "logger.wandb_mode=disabled", "logger.progress=false"]
    resumed = len(policies) == 2
    legs = ([["train.steps=1", "train.save_every=1"], ["train.steps=2", "resume=auto", "model.checkpoint_layers=1"]]
            if resumed else [[f"train.steps={steps}", f"train.save_every={steps}"]])
    procs = [run_train([*args, f"model.checkpoint_policy={policy}", *leg], tmp_path, torchrun=1, timeout=600)
             for policy, leg in zip(policies, legs)]
    for proc in procs:
        assert "[dist] rank 0/1" in proc.stdout and "decoder layers compiled" in proc.stdout
        assert "did not compile" not in proc.stdout + proc.stderr  # no layer fell back to eager
    assert not resumed or "resumed from" in procs[1].stdout and "at step 1" in procs[1].stdout
    trained = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    assert any(r["train/grad_norm"] > 0 for r in trained), "no gradient: every group was degenerate"
    saved = run_dir / "checkpoints" / f"step_{1 if resumed else steps}"
    assert (saved / "optim_dcp").is_dir()  # FSDP2's sharded optimizer state
    # the first step compiles the run's graphs (layers, norm, rotary, head, loss), the second a new shape at most;
    # a resumed process compiles them all again
    graphs = [r["perf/compiled_graphs"] for r in trained]
    assert graphs[0] >= 8 and (steps == 1 or (graphs[1] >= 8 if resumed else graphs[1] < graphs[0])), graphs
    assert "final" in json.loads((run_dir / "results.json").read_text())


def test_the_heads_first_call_sees_its_tensors_at_offset_0():
    """``_at_offset_0`` (the head's first compiled call): a slice of a chunked tensor comes back at storage offset 0
    with its values and strides (a stride of 2: the log-probs' gradient is a column of [n, 2]); an expanded slice
    (a stride of 0), whose strides no copy can keep, comes back contiguous, where copying into its strides raised."""
    base = torch.arange(40.0).view(20, 2)
    column = base[8:14, 0]  # offset 16, stride 2
    got = _at_offset_0(column)
    assert column.storage_offset() == 16 and got.storage_offset() == 0
    assert got.stride() == (2,) and torch.equal(got, column)
    expanded = torch.arange(4.0)[:, None].expand(4, 5)[1:, 1:]  # offset 1, strides (1, 0)
    got = _at_offset_0(expanded)
    assert got.storage_offset() == 0 and got.is_contiguous() and torch.equal(got, expanded)
