"""``bicc.trainer.step.rl_step`` (packed or KV-reused contexts, micro-batches, the step plan, delta from the update's own
forward) against ``bicc.method.reference.algorithm1_step`` (the paper's Algorithm 1, one sequence per forward) on the
same rollout, under the published ``bicc=on rcc=on``. Both take one plain SGD step with clipping out of reach, so
the weights after it are the gradient itself: a wrong context, ratio, delta, advantage or normaliser moves them
differently (Adam's first step, about lr x sign(g), would hide every error of scale)."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from bicc.method.diagnostics import conditioning_weights
from bicc.method.reference import algorithm1_step
from bicc.model.load import build_tiny
from bicc.trainer import step as step_module
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import ARCH, CoinTask

LR = 0.5


def sgd(state):
    """Replace the state's AdamW by plain SGD at a constant LR."""
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=LR)
    state.scheduler = warmup_cosine(state.optimizer, 0, 10, 1.0)


def policy_and_reference(root):
    """``root/init`` (pi_ref, the initial policy) and ``root/policy`` (pi_old, a policy some steps on: the initial
    one perturbed); they differ as they do after the first step, so a delta or KL read against the wrong one
    changes the update. Returns the tokenizer."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(root / "init")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return tok


# GRPO over packing (KV reuse, a packed mask, one row per output) x delta (from the update's forward or a
# no-grad pass) x micro-batches (all rows at once, or 5 rows: uneven splits); DAPO's loss and sampling on one
CASES = [("grpo", packing, from_update, micro) for packing in ("packing_impl=kv", "packing_impl=mask", "packing=false")
         for from_update in (True, False) for micro in (64, 5)] + [("dapo", "packing_impl=kv", True, 5)]


@pytest.mark.parametrize(("algo", "packing", "delta_from_update", "micro_batch"), CASES)
def test_rl_step_is_algorithm1(algo, packing, delta_from_update, micro_batch, tmp_path, monkeypatch):
    tok = policy_and_reference(tmp_path)
    # 32-token outputs: a 12-token context budget, above min_attempt_tokens 4, so mixed groups are conditioned
    cfg = compose_cfg([f"algo={algo}", "bicc=on", "rcc=on", "rcc.delta_context=xc", f"bicc.{packing}",
                       f"rcc.delta_from_update={delta_from_update}",
                       f"train.micro_batch_size={micro_batch}", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
                       "rollout.group_size=4", "rollout.max_new_tokens=32", "bicc.min_attempt_tokens=4",
                       "rcc.diag_every=0", "optim.warmup_steps=0", "optim.clip_grad=1e9"])
    s = build_rl_state(cfg, str(tmp_path / "policy"), str(tmp_path / "init"), torch.device("cpu"))
    ref_model = copy.deepcopy(s.ref_model)
    s.task = CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout

    def recording(*args, **kwargs):  # the rollout rl_step samples, kept for the reference
        rollouts.append(collect(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(step_module, "collect_rollout", recording)
    metrics, _ = rl_step(s, cfg)
    ro = rollouts[0]
    assert 0 < metrics["bicc/samples_conditioned_share"]  # contexts were built and read
    assert ro.rewards.std() > 0

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = algorithm1_step(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), tok,
                          ro, cfg, s.task.answer_anchors, s.end_ids)
    assert out["advantages"].abs().sum() > 0
    moved = [(p - b).abs().max().item() for p, b in zip(reference.parameters(), before.parameters())]
    assert max(moved) > 1e-3  # the step moved the weights: the comparison below is not of two no-ops
    for (name, p), q in zip(s.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-6, rtol=1e-4, msg=name)


# ---- Every switch the config offers, in combination -------------------------------------------------
# bicc (off, the paper's, the stabilised form) x rcc (off, the paper's, its per-token mean) x a KL term x TIS x
# where RCC's delta is read (x^c, q: only where RCC is on), each through rl_step against the reference's plain lines
COMBINATIONS = [(bicc, rcc, kl, tis, where, "") for bicc in ("off", "on", "stable") for rcc in ("off", "on", "mean")
                for kl in (0.0, 0.05) for tis in (0.0, 1.2) for where in (("xc", "q") if rcc != "off" else ("xc",))]
# ... and the switches that change how a step gets its log-probs, not what it computes: a diagnostics step (delta
# before the update, gradients measured and cleared) and pi_old on q taken from the sampler's log-probs
COMBINATIONS += [(bicc, rcc, 0.0, 0.0, "xc", "rcc.diag_every=1") for bicc in ("off", "on", "stable") for rcc in ("off", "on")]
COMBINATIONS += [(bicc, rcc, 0.05, 0.0, where, "rollout.old_from_sampler=true") for bicc in ("off", "on")
                 for rcc, where in (("off", "xc"), ("on", "xc"), ("on", "q"))]
COMBINATION_CFG = ["sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=32",
                   "bicc.min_attempt_tokens=4", "rcc.diag_every=0", "optim.warmup_steps=0", "optim.clip_grad=1e9",
                   "train.micro_batch_size=5"]


class ReplayEngine:
    """Returns one recorded rollout whatever it is asked (every combination trains on the same samples), with
    ``logprobs`` as the sampler's log-probs (None: an engine that gives none)."""

    def __init__(self, out, logprobs=None):
        self.out, self.logprobs, self.returns_logprobs = out, logprobs, logprobs is not None

    def generate(self, prompts, sampling):
        assert prompts == self.out.prompt_ids[:: sampling.n] and sampling.n * len(prompts) == len(self.out.prompt_ids)
        return replace(self.out, logprobs=self.logprobs)

    def update_weights(self, model):
        pass


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A policy (the initial one perturbed) and the initial one as the reference, loaded here from its files;
    one recorded rollout of 4 queries x 4 with a mixed group; sampler log-probs pi_old(o | q) + 0.3 sin(i + t),
    whose TIS weights e^{-0.3 sin} lie in [0.74, 1.35], some above the cap 1.2."""
    from transformers import AutoModelForCausalLM

    from bicc.model.logprobs import batch_logprobs, make_token_batch
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout

    tmp = tmp_path_factory.mktemp("combinations")
    tok = policy_and_reference(tmp)
    cfg = compose_cfg([*COMBINATION_CFG, "bicc=off", "rcc=off"])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    ro = collect_rollout(s.engine, tok, CoinTask(s.task), Collection.from_config(cfg), DataCursor(), seed=5)
    right = ro.correct.view(4, 4).sum(1)
    assert ((right > 0) & (right < 4)).any()  # a mixed group: BiCC conditions, advantages are not all 0
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, tok.pad_token_id)
    with torch.no_grad():
        old = batch_logprobs(s.model.eval(), batch, cfg.rollout.temperature)[0]
    sampled = [[old[i, t].item() + 0.3 * math.sin(i + t) for t in range(len(c))] for i, c in enumerate(ro.out.completion_ids)]
    return tmp, ro.out, sampled, AutoModelForCausalLM.from_pretrained(tmp / "init").eval()


@pytest.mark.parametrize(("bicc", "rcc", "kl", "tis", "where", "extra"), COMBINATIONS)
def test_every_combination_of_switches_is_the_reference(bicc, rcc, kl, tis, where, extra, recorded, monkeypatch):
    tmp, out, sampled, ref_model = recorded
    cfg = compose_cfg([*COMBINATION_CFG, f"bicc={bicc}", f"rcc={rcc}", f"algo.kl_coef={kl}", f"rollout.tis_cap={tis}",
                       f"rcc.delta_context={where}", *extra.split()])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    with_logprobs = tis > 0 or cfg.rollout.old_from_sampler
    s.engine, s.plan = ReplayEngine(out, sampled if with_logprobs else None), None  # the plan is resolved for this engine
    s.task = CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout
    monkeypatch.setattr(step_module, "collect_rollout", lambda *a, **k: rollouts.append(collect(*a, **k)) or rollouts[-1])
    metrics, _ = rl_step(s, cfg)
    ro = rollouts[0]
    if bicc != "off":
        assert metrics["bicc/samples_conditioned_share"] > 0  # contexts were built and read
    if tis > 0:
        assert 0 < metrics["rollout/tis_clip_frac"] < 1  # the weights are neither all 1 nor all capped

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = algorithm1_step(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), s.tokenizer, ro, cfg,
                          s.task.answer_anchors, s.end_ids)
    if bicc != "off":  # the logged conditioning weights log pi_old(o | x^c) - log pi_old(o | q), by reward, wherever
        # the step has pi_old on both (bicc=stable has it on q only for TIS or a delta on q)
        expected = conditioning_weights(out["log_w"], out["conditioned"], ro.correct)
        on_q = bicc == "on" or tis > 0 or (rcc != "off" and where == "q") or "diag" in extra
        logged = {k: metrics[k] for k in expected if k in metrics}
        assert expected and logged == (pytest.approx(expected, abs=1e-4) if on_q else {})
    moved = max((p - b).abs().max().item() for p, b in zip(reference.parameters(), before.parameters()))
    assert moved > 1e-3  # the step moved the weights: the comparison below is not of two no-ops
    for (name, p), q in zip(s.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-6, rtol=1e-4, msg=name)
