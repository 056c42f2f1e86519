"""The policy update against a hand-sequenced loop, and which log-probs feed it for every BiCC form.

The paper preset runs micro-batches of 8 inside a 64-row step with several minibatches; the loss
normalisers are the whole minibatch's, so how rows are cut into micro-batches must not change the update
(computing them per micro-batch, then summing, would). And pi_old / pi_ref / the KL's reference are checked
by value: bicc=on (the paper) evaluates pi_old on q, bicc=stable on x^c."""

import pytest
import torch
from omegaconf import OmegaConf

from bicc.config import StepConfig
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import ContextRows, QueryRows
from bicc.method.conditioning import ConditionedPrompts
from bicc.method.losses import LOSSES, StepTotals
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.plan import StepPlan, step_logprobs
from bicc.trainer.state import RLState
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, rows

LR = 0.1


def sgd_state(model):
    """Plain SGD at a constant LR: the weights after a step are the gradient itself, so an error of scale in a
    normaliser shows (Adam's steps, about lr x sign(g), would hide it)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return RLState(model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 0, 100, 1.0))


def hand_loop(model, batch, old_logp, adv, cfg, step_seed, ref_logp=None):
    """Epochs x minibatches; each minibatch one forward over all of its rows, normalised by its own totals."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    n, gen = batch.input_ids.shape[0], torch.Generator().manual_seed(step_seed)
    for _ in range(cfg.train.epochs_per_rollout):
        order = torch.randperm(n, generator=gen)
        for mb in order.tensor_split(cfg.train.minibatches_per_rollout):
            optimizer.zero_grad()
            logp, _ = QueryRows(batch).logprobs(model, mb, 1.0)
            totals = StepTotals.of(batch.completion_mask[mb], cfg.rollout.max_new_tokens)
            loss, _ = LOSSES.get(cfg.algo.loss)(logp, old_logp[mb], None if ref_logp is None else ref_logp[mb], adv[mb],
                                                batch.completion_mask[mb], cfg.algo, totals)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
            optimizer.step()
    return model


# DAPO: token-mean; GRPO: seq-mean-token-mean; Dr.GRPO: token sums over (sequences x max_new_tokens) and its KL term
@pytest.mark.parametrize("algo", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("micro", ["1", "4", "12", "12 tokens=30"])  # the last: length-aware micro-batches
def test_update_equals_hand_sequenced_loop(algo, micro):
    """In fp64, so that the only differences left are the update's arithmetic, not summation order: each
    micro-batch is computed on its own columns (bicc.kernels.batching.trim_rows), the hand loop on the minibatch's.
    max_new_tokens (12) is above every output (at most 9 tokens), so Dr.GRPO's constant is not any row width."""
    size, _, tokens = micro.partition(" tokens=")
    cfg = compose_cfg([f"algo={algo}", "train.minibatches_per_rollout=2", "train.epochs_per_rollout=2",
                       f"train.micro_batch_size={size}", f"train.micro_batch_tokens={tokens or 0}",
                       "rollout.max_new_tokens=12", "optim.clip_grad=1e9"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    model, reference = build_tiny(ARCH, seed=0)[0].double(), build_tiny(ARCH, seed=0)[0].double()
    old_logp = logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0)
    ref_logp = logprobs_no_grad(build_tiny(ARCH, seed=1)[0].double(), QueryRows(batch), 12, 12, 1.0)
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    s = sgd_state(model)
    metrics, _ = update_policy(s, batch, QueryRows(batch), old_logp, ref_logp, adv, cfg, step_seed=7)
    assert ("train/kl_ref" in metrics) == (algo == "dr_grpo")  # the KL term is in the comparison where it is on
    hand_loop(reference, batch, old_logp, adv, cfg, step_seed=7, ref_logp=ref_logp)
    moved = max((p - q).abs().max().item() for p, q in zip(build_tiny(ARCH, seed=0)[0].double().parameters(),
                                                            model.parameters()))
    assert moved > 1e-3  # 4 SGD steps at lr 0.1: the comparison is not vacuous
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


FSDP2_ONE_RANK = """
import sys
import torch
from bench.update_vs_bare import fsdp_one_rank
from bicc.config import StepConfig
from bicc.kernels.batching import logprobs_no_grad
from bicc.model.logprobs import make_token_batch
from bicc.model.load import build_tiny
from bicc.kernels.rows import QueryRows
from bicc.machine.distributed import Dist
from bicc.machine.ranks import Ranks
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, rows
from tests.test_update import hand_loop, sgd_state

cfg = compose_cfg(["algo=dapo", "train.minibatches_per_rollout=2", "train.epochs_per_rollout=2", "train.micro_batch_size=4",
                   "rollout.max_new_tokens=12", "optim.clip_grad=1e9", *sys.argv[1:]])
prompts, completions = rows()
batch = make_token_batch(prompts, completions, 0)
model, reference = build_tiny(ARCH, seed=0)[0].double(), build_tiny(ARCH, seed=0)[0].double()
old_logp = logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0)
adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
model = fsdp_one_rank(model, cfg, torch.device("cpu"), None)
state = sgd_state(model)
state.ranks = Ranks.of(Dist(), cfg.dist)
update_policy(state, batch, QueryRows(batch), old_logp, None, adv, cfg, step_seed=7)
hand_loop(reference, batch, old_logp, adv, cfg, step_seed=7)
# DTensor shards once resharded; the gathered copies themselves where FSDP2 still holds them
full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
print(max((p - q).abs().max().item() for p, q in zip(full, reference.parameters())))
"""


@pytest.mark.launch
@pytest.mark.parametrize("options", [[], ["dist.reshard_after_forward=false", "dist.reshard_after_backward=false",
                                          "dist.reduce_grads=step"]], ids=["default", "kept-and-unreduced"])
def test_the_update_under_fsdp2_equals_the_hand_loop_with_its_options(options):
    """Four SGD steps (2 epochs x 2 minibatches of 3 micro-batches) under FSDP2 over a one-rank process group
    (a process of its own) equal the unwrapped hand loop, with FSDP2's options that keep the gathered weights
    across micro-batches and reduce once per minibatch: weights kept gathered past a minibatch's last backward
    would be the ones before its optimizer step, which the next minibatch's forward would then use."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = subprocess.run([sys.executable, "-c", FSDP2_ONE_RANK, *options], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) <= 1e-6, out.stdout


def test_no_micro_batch_graph_is_alive_at_the_optimizer_step():
    """Every micro-batch's log-probs, and the graph behind them, are released by the optimizer step. A name still bound to the
    last micro-batch's log-probs would keep its autograd nodes, and the tensors they hold past their backward,
    through the step (1.2 GiB of the trace's optimizer step at 8 layers of the preset, fixed)."""
    import weakref

    cfg = compose_cfg(["algo=grpo", "train.micro_batch_size=4", "rollout.max_new_tokens=12"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    model = build_tiny(ARCH, seed=0)[0].double()
    numerator, made, alive = QueryRows(batch), [], []
    logprobs = numerator.logprobs

    def recorded(*args, **kwargs):
        out = logprobs(*args, **kwargs)
        made.append(weakref.ref(out[0]))
        return out

    numerator.logprobs = recorded
    state = sgd_state(model)
    state.optimizer.register_step_pre_hook(lambda *_: alive.append(sum(r() is not None for r in made)))
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    update_policy(state, batch, numerator, None, None, adv, cfg, step_seed=0)
    assert len(made) == 3 and alive == [0]


def test_update_metrics_are_the_micro_batch_means_read_once():
    """The update's metrics, kept on the device and read once per optimizer step: the loss is the minibatch's (its
    micro-batches' sum under the step's normalisers: the loss of one forward over all rows), the loss's own metrics
    and the entropy are means over the micro-batches (by hand: three micro-batches of 4 rows, pi_old off the
    policy, so that ratios and clipping are not all 1 and 0), and nothing is read per micro-batch."""
    cfg = compose_cfg(["algo=grpo", "train.micro_batch_size=4", "rollout.max_new_tokens=12", "optim.clip_grad=1e9"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    model = build_tiny(ARCH, seed=0)[0].double()
    old_logp = logprobs_no_grad(build_tiny(ARCH, seed=1)[0].double(), QueryRows(batch), 12, 12, 1.0)
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    totals = StepTotals.of(batch.completion_mask, cfg.rollout.max_new_tokens)
    with torch.no_grad():
        logp, entropy = QueryRows(batch).logprobs(model, torch.arange(12), 1.0, with_entropy=True)
        loss, _ = LOSSES.get("grpo")(logp, old_logp, None, adv, batch.completion_mask, cfg.algo, totals)
        parts = [(r, LOSSES.get("grpo")(logp[r], old_logp[r], None, adv[r], batch.completion_mask[r], cfg.algo, totals)[1])
                 for r in torch.arange(12).split(4)]
    reads = []
    item = torch.Tensor.item
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))
        metrics, _ = update_policy(sgd_state(model), batch, QueryRows(batch), old_logp, None, adv,
                                      cfg, step_seed=0)
    assert reads == []  # no scalar read per micro-batch (the two reads of a step are one tolist each)
    assert metrics["train/loss"] == pytest.approx(loss.item(), abs=1e-9)
    for name in ("train/clip_frac_low", "train/clip_frac_high", "train/ratio_mean", "train/ratio_max"):
        assert metrics[name] == pytest.approx(sum(m[name].item() for _, m in parts) / 3, abs=1e-9), name
    assert 0 < metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"]  # some clipping: the means are not 0
    per_micro = [(entropy[r] * batch.completion_mask[r]).sum() / batch.completion_mask[r].sum() for r, _ in parts]
    assert metrics["train/entropy"] == pytest.approx(sum(per_micro).item() / 3, abs=1e-9)


def bicc_setup(form):
    cfg = compose_cfg([f"bicc={form}", "algo=dr_grpo", "rollout.max_new_tokens=9", "rcc=on"])  # dr_grpo: KL on
    prompts, completions = rows(4)
    batch = make_token_batch(prompts, completions, 0)
    contexts = ConditionedPrompts([p + [50, 51, 52] for p in prompts], [10, 10, 11, 11], torch.ones(4, dtype=torch.bool))
    numerator = ContextRows(contexts, completions, batch.completion_len,
                            OmegaConf.create({"context_packing": True, "max_packed_len": 64, "context_packing_impl": "kv"}), 0,
                            torch.device("cpu"))
    return cfg, batch, QueryRows(batch), numerator


@pytest.mark.parametrize("form", ["stable", "on"])
def test_old_reference_and_kl_reference_wiring(form):
    cfg, batch, plain, numerator = bicc_setup(form)
    policy, _ = build_tiny(ARCH, seed=0)
    ref, _ = build_tiny(ARCH, seed=1)
    on_q = logprobs_no_grad(policy, plain, 4, 4, 1.0)
    on_xc = logprobs_no_grad(policy, numerator, 4, 4, 1.0)
    ref_q = logprobs_no_grad(ref, plain, 4, 4, 1.0)
    ref_xc = logprobs_no_grad(ref, numerator, 4, 4, 1.0)
    assert not torch.allclose(on_q, on_xc)  # the context changes the log-probs: the checks below can fail
    plan = StepPlan.from_config(StepConfig.of(cfg), False, diagnostics=True)
    lp = step_logprobs(plan, {"model": policy, "ref": ref}, {"q": plain, "xc": numerator}, None, batch.completion_mask, cfg)
    torch.testing.assert_close(lp["model", "q"], on_q)
    torch.testing.assert_close(lp["ref", "q"], ref_q)  # RCC's delta: pi_ref on q in every form
    old, kl_ref = lp["model", plan.old_context], lp["ref", plan.ref_context]
    if form == "on":  # the paper: rho = pi(o | x^c) / pi_old(o | q); KL to pi_ref(. | q)
        torch.testing.assert_close(old, on_q)
        torch.testing.assert_close(kl_ref, ref_q)
    else:  # the stabilised form: pi_old and the KL's reference on x^c
        torch.testing.assert_close(old, on_xc)
        torch.testing.assert_close(kl_ref, ref_xc)


@pytest.mark.parametrize("form", ["stable", "on"])
@pytest.mark.parametrize("context", ["xc", "q"])
def test_rcc_delta_context(form, context):
    """The paper evaluates delta's policy term on x^c (Algorithm 1) and on q (Section 4.2, Appendices B/C)."""
    cfg, batch, plain, numerator = bicc_setup(form)
    cfg.rcc.delta_context = context
    policy, _ = build_tiny(ARCH, seed=0)
    plan = StepPlan.from_config(StepConfig.of(cfg), False)
    lp = step_logprobs(plan, {"model": policy, "ref": None}, {"q": plain, "xc": numerator}, None, batch.completion_mask, cfg)
    got = lp["model", plan.delta]
    expected = logprobs_no_grad(policy, plain if context == "q" else numerator, 4, 4, 1.0)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("micro", ["5", "12", "12 tokens=40"])
def test_shared_prompts_update_equals_one_row_per_output(micro):
    """train.share_prompts: three prompts, each behind four outputs, computed once per minibatch (KV reuse) give
    the update of one padded row per output, in fp64 over 2 epochs x 2 minibatches (so a minibatch holds some
    of a prompt's outputs and the prompt is shared only within it)."""
    from bicc.kernels.rows import query_rows

    size, _, tokens = micro.partition(" tokens=")
    cfg = compose_cfg(["train.minibatches_per_rollout=2", "train.epochs_per_rollout=2", f"train.micro_batch_size={size}",
                       f"train.micro_batch_tokens={tokens or 0}", "rollout.max_new_tokens=9", "optim.clip_grad=1e9"])
    prompts, completions = rows()
    prompts = [prompts[i // 4] for i in range(12)]  # 3 prompts x 4 outputs
    batch = make_token_batch(prompts, completions, 0)
    shared = query_rows(batch, prompts, completions, True, 0, torch.device("cpu"))
    assert isinstance(shared, ContextRows) and shared.tokens == sum(map(len, prompts[::4])) + sum(map(len, completions))
    assert isinstance(query_rows(batch, prompts, completions, False, 0, torch.device("cpu")), QueryRows)
    model, reference = build_tiny(ARCH, seed=0)[0].double(), build_tiny(ARCH, seed=0)[0].double()
    old_logp = logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0)
    torch.testing.assert_close(logprobs_no_grad(model, shared, 12, int(size), 1.0), old_logp, atol=1e-10, rtol=0)
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    update_policy(sgd_state(model), batch, shared, old_logp, None, adv, cfg, step_seed=7)
    hand_loop(reference, batch, old_logp, adv, cfg, step_seed=7)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_gradients_are_freed_after_the_optimizer_step():
    """The fp32 gradients (4N/W bytes: 3.75 GiB a GPU for the Qwen3-4B preset) lived on through the next rollout,
    beside vLLM's share, until the next update's zero_grad."""
    from bicc.kernels.batching import logprobs_no_grad
    from bicc.kernels.rows import QueryRows
    from bicc.trainer.update import update_policy
    from tests.helpers import guard_setup

    state, batch, cfg = guard_setup()
    plain = QueryRows(batch)
    old = logprobs_no_grad(state.model, plain, 4, 4, 1.0)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    metrics, _ = update_policy(state, batch, plain, old, None, torch.tensor([1.0, -1.0, -1.0, 1.0]), cfg, 0)
    assert metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert all(p.grad is None for p in state.model.parameters())


def test_first_pass_log_ratio_is_each_row_before_any_update():
    """The update returns each row's log-probs at its first forward, before any optimizer step (BiCC's log w reads
    them when pi_old is on q): with two epochs, not the second epoch's, after the first step moved theta."""
    cfg = compose_cfg(["train.epochs_per_rollout=2", "rollout.max_new_tokens=12", "optim.clip_grad=1e9"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    model = build_tiny(ARCH, seed=0)[0].double()
    old_logp = logprobs_no_grad(build_tiny(ARCH, seed=1)[0].double(), QueryRows(batch), 12, 12, 1.0)  # another policy
    before = ((logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0) - old_logp) * batch.completion_mask).sum(-1)
    _, first = update_policy(sgd_state(model), batch, QueryRows(batch), old_logp, None,
                             torch.linspace(-1.5, 1.5, 12, dtype=torch.float64), cfg, step_seed=7)
    first_pass = ((first - old_logp) * batch.completion_mask).sum(-1)
    after = ((logprobs_no_grad(model, QueryRows(batch), 12, 12, 1.0) - old_logp) * batch.completion_mask).sum(-1)
    assert (after - before).abs().max() > 1e-3  # theta moved: the epochs' passes differ
    torch.testing.assert_close(first_pass.double(), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("share", [False, True], ids=["one-row-per-output", "kv-reuse"])
@pytest.mark.parametrize("field, hook, default, option", [
    ("dist.reduce_grads", "set_requires_gradient_sync", "micro_batch", "step"),
    ("dist.reshard_after_backward", "set_reshard_after_backward", "true", "false")], ids=["reduce", "reshard"])
def test_fsdp2_options_act_in_a_minibatch_last_backward_only(share, field, hook, default, option, monkeypatch):
    """``dist.reduce_grads=step`` / ``dist.reshard_after_backward=false``: FSDP2 is told to reduce the gradients /
    free the gathered weights in a minibatch's last backward only: its last micro-batch's, or under KV reuse the
    prompts' prefix backward on leaving the contexts (then every micro-batch's is off). The default never touches
    the setting. (Two ranks against one process: ``tests/test_distributed.py``.)"""
    import bicc.machine.ranks
    from bicc.kernels.batching import micro_batches
    from bicc.kernels.rows import query_rows
    from bicc.machine.distributed import Dist
    from bicc.machine.ranks import Ranks

    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    numerator = query_rows(batch, prompts, completions, share, 0, torch.device("cpu"))
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    calls = []
    monkeypatch.setattr(bicc.machine.ranks, "is_sharded", lambda model: True)  # FSDP2's methods stand in below
    for setting in (default, option):
        cfg = compose_cfg(["train.micro_batch_size=4", "rollout.max_new_tokens=12", f"{field}={setting}"])
        model = build_tiny(ARCH, seed=0)[0].double()
        setattr(model, hook, calls.append)
        state = sgd_state(model)
        state.ranks = Ranks.of(Dist(), cfg.dist)  # as build_rl_state sets them from the dist group
        update_policy(state, batch, numerator, None, None, adv, cfg, step_seed=0)
        if setting == default:
            assert calls == []
    k = len(micro_batches(torch.arange(12), numerator, 4, cfg.train.micro_batch_tokens, model))
    assert k >= 2 and calls == [False] * (k - 1) + [not share, True]
