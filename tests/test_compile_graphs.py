"""How many graphs ``model.compile`` makes (``bicc.kernels.compile``): each is Dynamo, AOTAutograd and Inductor's time at a
run's start (minutes on a GPU at a preset's width), and one that first turns up mid-run stalls that step. The
micro-batches' shapes must not add graphs where the math is the same: rows and lengths vary, a micro-batch may hold
one row, FSDP2 hands the layers views, and a token count may equal a width of the model."""

import json
import subprocess
import sys

import pytest
import torch
import torch.fx.experimental._config
from torch._dynamo.backends.registry import lookup_backend

from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.compile import compile_layers
from bicc.kernels.rows import QueryRows
from bicc.model.load import build_tiny
from bicc.model.logprobs import batch_logprobs, make_token_batch
from tests.helpers import ARCH, ROOT, graph_code, graph_nodes, rows

pytestmark = pytest.mark.compile


def kind_of(gm) -> str:
    """Which compiled function a graph is of, from where its ops come from."""
    where, code = " ".join(n.meta.get("stack_trace") or "" for n in graph_nodes(gm)), graph_code(gm)
    return ("head" if "bicc/model/head.py" in where else "loss" if "bicc/method/losses" in where else
            "layer" if "scaled_dot_product_attention" in code else "rotary" if ".cos()" in code else
            "norm" if "rsqrt" in code else "other")


UNDER_FSDP2 = """
import json
import torch
import torch.fx.experimental._config
from torch._dynamo.backends.registry import lookup_backend
from bench.update_vs_bare import fsdp_one_rank
from bicc.kernels.compile import compile_layers
from bicc.model.logprobs import install_logprob_head, make_token_batch
from bicc.model.load import build_tiny
from bicc.kernels.rows import query_rows
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, rows
from tests.test_compile_graphs import kind_of
from tests.test_update import sgd_state

graphs = []

def backend(gm, example_inputs):
    graphs.append(kind_of(gm))
    return lookup_backend("aot_eager")(gm, example_inputs)

# two minibatches of six rows in micro-batches of five: one of five rows, one of a single row, each
cfg = compose_cfg(["algo=grpo", "train.minibatches_per_rollout=2", "train.micro_batch_size=5",
                   "rollout.max_new_tokens=12", "optim.clip_grad=1e9", "train.logprob_chunk_tokens=4"])
prompts, completions = rows()
prompts = [prompts[i // 4] for i in range(12)]
batch = make_token_batch(prompts, completions, 0)
numerator = query_rows(batch, prompts, completions, True, 0, torch.device("cpu"))  # KV reuse
adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
weights = []
for compiled in (False, True):
    model = build_tiny(ARCH, seed=0)[0].double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_layers(model, backend=backend)
    model = fsdp_one_rank(model, cfg, torch.device("cpu"), None)
    install_logprob_head(model, cfg.train.logprob_chunk_tokens)
    update_policy(sgd_state(model), batch, numerator, None, None, adv, cfg, step_seed=7)
    weights.append([p.full_tensor() for p in model.parameters()])
moved = max((p - q).abs().max().item() for p, q in zip(build_tiny(ARCH, seed=0)[0].double().parameters(), weights[0]))
diff = max((p - q).abs().max().item() for p, q in zip(*weights))
print(json.dumps({"graphs": {k: graphs.count(k) for k in set(graphs)}, "moved": moved, "diff": diff}))
"""


def test_an_update_under_fsdp2_compiles_a_graph_per_kind_of_pass():
    """An update under FSDP2 (a one-rank process group, a process of its own) with checkpointing and KV reuse, its
    micro-batches of five rows and of one: the layers make three graphs (the prompts' pass, which records their
    keys and values; the completions' pass reading them; and that pass for a single row, which Dynamo specialises),
    the final norm and the rotary embedding one each (called on the micro-batch's tokens as one row), the log-prob
    head (chunks of 4 tokens) a forward and a backward for a micro-batch within one chunk (its softmax kept for the
    backward) and a pair for those that span several. Before, they made 8, 2, 3 and 4: FSDP2 hands a layer its
    input as a view and the checkpoint's replay a plain tensor (Dynamo guards on a view's base), the completions'
    positions were a slice of a wider tensor, the head's chunks slices of the micro-batch, and one row specialised
    the norm and the rotary embedding. The head made 6: a chunk of one token (a micro-batch's tail) specialised, and
    the backward's first call, the last chunk's, was traced at a storage offset that the first chunk's failed. The
    weights after the update are the eager update's."""
    out = subprocess.run([sys.executable, "-c", UNDER_FSDP2], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    graphs = got["graphs"]
    assert {k: graphs.get(k, 0) for k in ("layer", "norm", "rotary", "head")} == \
        {"layer": 3, "norm": 1, "rotary": 1, "head": 4}, graphs
    assert got["moved"] > 1e-3  # the update did something
    assert got["diff"] <= 1e-12, got


def test_a_token_count_equal_to_a_width_compiles_no_graph_of_its_own():
    """Dynamo gives two sizes that are equal on the first call one symbol (duck sizing): a micro-batch 16 tokens
    long, the tiny model's head dimension, made the layers' graph a graph for 16 tokens alone, and one of 2 x 16
    tokens, its hidden width, did the same to the final norm's (which sees the tokens as one row). The next
    micro-batch then compiled again. The compiled calls turn duck sizing off."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(kind_of(gm))
        return lookup_backend("aot_eager")(gm, example_inputs)

    model = build_tiny(ARCH, seed=0)[0].double()
    compile_layers(model, backend=backend)
    assert ARCH.head_dim == 16 and ARCH.hidden_size == 32
    gen = torch.Generator().manual_seed(0)
    for n, prompt, output in ((2, 8, 8), (3, 5, 6)):  # 2 rows x 16 tokens, then 3 x 11
        prompts = [torch.randint(4, 90, (prompt,), generator=gen).tolist() for _ in range(n)]
        outputs = [torch.randint(4, 90, (output,), generator=gen).tolist() for _ in range(n)]
        batch = make_token_batch(prompts, outputs, 0)
        assert batch.input_ids.shape == (n, prompt + output)
        logprobs_no_grad(model, QueryRows(batch), n, n, 1.0)
    assert sorted(graphs) == ["head", "layer", "norm", "rotary"], graphs
    assert torch.fx.experimental._config.use_duck_shape is True  # the setting is the compiled calls', not the process's


def test_the_rotary_embedding_compiles_one_graph_with_grad_or_without():
    """Dynamo guards on the grad mode a function is called in, so the passes without grad (pi_old, pi_ref) and the
    update compile their own graphs. The rotary embedding's cos and sin depend on the positions alone (HF computes
    them under no_grad), so it is called under no_grad in both: one graph where it made two. The final norm, with
    its weight's gradient, makes two; the update's gradients are the eager model's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(kind_of(gm))
        return lookup_backend("aot_eager")(gm, example_inputs)

    eager, model = (build_tiny(ARCH, seed=0)[0].double() for _ in range(2))
    compile_layers(model, backend=backend)
    prompts, completions = rows()
    batch = make_token_batch(prompts[:4], completions[:4], 0)
    old = logprobs_no_grad(model, QueryRows(batch), 4, 4, 1.0)
    for m in (eager, model):
        logp = batch_logprobs(m, batch)[0]
        ((logp - old).exp() * batch.completion_mask).sum().backward()
    assert graphs.count("rotary") == 1 and graphs.count("norm") == 2, graphs
    for p, q in zip(model.parameters(), eager.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0)
