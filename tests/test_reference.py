"""``bicc.trainer.step.rl_step`` (packed or KV-reused contexts, micro-batches, the step plan, delta from the update's own
forward) against ``bicc.method.reference.algorithm1_step`` (the paper's Algorithm 1, one sequence per forward) on the
same rollout, under the published ``bicc=on rcc=on``. Both take one plain SGD step with clipping out of reach, so
the weights after it are the gradient itself: a wrong context, ratio, delta, advantage or normaliser moves them
differently (Adam's first step, about lr x sign(g), would hide every error of scale)."""

import copy

import pytest
import torch

from bicc.config import StepConfig, corrects
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import QueryRows
from bicc.method.advantages import ADVANTAGES
from bicc.method.diagnostics import conditioning_weights
from bicc.method.losses.tis import sampler_logprob_diff
from bicc.method.reference import algorithm1_step
from bicc.model.logprobs import make_token_batch
from bicc.trainer import step as step_module
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from tests.conftest import compose_cfg
from tests.helpers import COMBINATION_CFG, LR, CoinTask, ReplayEngine, policy_and_reference, recorded_rollout, sgd
from tests.losses.helpers import VARIANTS, split_invariant

# GRPO over packing (KV reuse, a packed mask, one row per output) x micro-batches (all rows at once, or 5 rows:
# uneven splits); DAPO's loss and sampling on one
PACKINGS = ("context_packing_impl=kv", "context_packing_impl=mask", "context_packing=false")
CASES = [("grpo", packing, micro) for packing in PACKINGS for micro in (64, 5)] + [("dapo", "context_packing_impl=kv", 5)]
# ... and LoRA adapters (model.lora), moved off zero first so that pi_ref (the policy with them off) is not the policy
LORA = ("grpo", "context_packing_impl=kv", 5, ("model.lora.r=4", "model.lora.alpha=8"))


@pytest.mark.parametrize(("algo", "packing", "micro_batch", "extra"), [(*c, ()) for c in CASES] + [LORA],
                         ids=[f"{a}-{p}-{m}" for a, p, m in CASES] + ["lora"])
def test_rl_step_is_algorithm1(algo, packing, micro_batch, extra, tmp_path, monkeypatch):
    tok = policy_and_reference(tmp_path)
    # 32-token outputs: a 12-token context budget, above min_attempt_tokens 4, so mixed groups are conditioned
    cfg = compose_cfg([f"algo={algo}", "bicc=on", "rcc=on", "rcc.delta_context=xc", f"train.{packing}",
                       f"train.micro_batch_size={micro_batch}", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
                       "rollout.group_size=4", "rollout.max_new_tokens=32", "bicc.min_attempt_tokens=4",
                       "diag.every=0", "optim.warmup_steps=0", "optim.clip_grad=1e9", *extra])
    s = build_rl_state(cfg, str(tmp_path / "policy"), str(tmp_path / "init"), torch.device("cpu"))
    if extra:  # B off zero: the adapters change the policy, and pi_ref (them off) differs from it
        with torch.no_grad():
            for name, p in s.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    ref_model = copy.deepcopy(s.ref_model)
    s.task = CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout

    def recording(*args, **kwargs):  # the rollout rl_step samples, kept for the reference
        rollouts.append(collect(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(step_module, "collect_rollout", recording)
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    ro = rollouts[0]
    assert 0 < metrics["bicc/samples_conditioned_share"]  # contexts were built and read
    assert ro.rewards.std() > 0

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = algorithm1_step(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), tok,
                          ro, StepConfig.of(cfg), s.task.answer_anchors, s.end_ids)
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
COMBINATIONS += [(bicc, rcc, 0.0, 0.0, "xc", "diag.every=1") for bicc in ("off", "on", "stable") for rcc in ("off", "on")]
COMBINATIONS += [(bicc, rcc, 0.05, 0.0, where, "rollout.old_from_sampler=true") for bicc in ("off", "on")
                 for rcc, where in (("off", "xc"), ("on", "xc"), ("on", "q"))]
# ... and RCC's diagnostic form divided by the group's reward std (rcc=std, not the paper's)
COMBINATIONS += [(bicc, "std", 0.0, 0.0, where, "") for bicc in ("off", "on") for where in ("xc", "q")]
# ... and the released code's form (bicc=released: pi_old on x^c, pi_theta on q; one attempt, its layout) under its
# objective and under the paper's RCC, a KL term, TIS; and each of its switches alone on the paper's bicc=on
RELEASED = "algo=released"
COMBINATIONS += [("released", rcc, kl, tis, where, RELEASED if rcc == "off" else "") for rcc in ("off", "on")
                 for kl in (0.0, 0.05) for tis in (0.0, 1.2) for where in (("xc", "q") if rcc == "on" else ("xc",))]
COMBINATIONS += [("released", "off", 0.0, 0.0, "xc", f"{RELEASED} diag.every=1")]
# ... and its partition under overlong shaping (a buffer of 3 of 32 tokens: right outputs of 32 tokens fall to 0), by
# the shaped reward (algo=released's) and by the verdict
COMBINATIONS += [("released", "off", 0.0, 0.0, "xc", f"{RELEASED} algo.overlong_buffer_share=0.1 {rule}")
                 for rule in ("", "algo.partition=correct")]
COMBINATIONS += [("on", "on", 0.0, 0.0, "q", switch) for switch in
                 ("bicc.context_in=denominator", "bicc.mode=last", "bicc.layout=released", "bicc.mode=last bicc.truncate=none")]
COMBINATIONS += [("on", "off", 0.0, 0.0, "xc", "algo.advantage=src")]
# ... and a temperature other than 1: every pass scores the outputs at the sampling temperature
COMBINATIONS += [(bicc, "on", 0.05, 1.2, "xc", "rollout.temperature=0.7") for bicc in ("off", "on", "stable")]
# ... and the rollout correction's other forms (tis 1.2 gives the sampler's log-probs, e^{-0.3 sin(i + t)} apart from
# pi_old's; the overrides after it set the correction): sequence-level weights, IcePop's band normalised over the
# step, a token rejection, and two criteria chained; a rejected token leaves the loss and every normaliser
CORRECTIONS = ("rollout.correction.rollout_is=sequence rollout.correction.rollout_is_threshold=1.5",
               "rollout.correction.rollout_is_threshold=0.8_1.3 rollout.correction.rollout_is_batch_normalize=true",
               "rollout.correction.rollout_is=none rollout.correction.rollout_rs=token_k2 "
               "rollout.correction.rollout_rs_threshold=0.02",
               'rollout.correction.rollout_rs="token_k1,seq_mean_k3" rollout.correction.rollout_rs_threshold="0.8_1.25,0.03"')
COMBINATIONS += [(bicc, rcc, 0.0, 1.2, "xc", corr) for bicc in ("off", "on") for rcc in ("off", "on") for corr in CORRECTIONS]
# ... and every registered advantage without RCC (found in the registry: a new one joins), the paper's BiCC on, but
# those named here with why
NOT_HERE = {"grpo": "every case above", "src": "its case above", "rcc": "RCC's own (rcc=on)", "rcc_std": "rcc=std above",
            "remax": "needs a greedy output per query (tests/test_released.py)",
            "grpo_passk": "this rollout's groups have no single best output: every output gets 0 (tests/test_advantages.py)"}
COMBINATIONS += [("on", "off", 0.0, 0.0, "xc", f"algo.advantage={a}") for a in ADVANTAGES.names() if a not in NOT_HERE]
# ... and every conf/algo preset's loss under the paper's BiCC and RCC (found on disk: a new one joins), but those that
# select tokens by the statistics of the micro-batch they are given (declared: Clip-Cov, KL-Cov), whose step is not
# the whole batch's
COMBINATIONS += [("on", "on", 0.0, 0.0, "q", f"algo={v}") for v in sorted(VARIANTS)
                 if v not in ("grpo", "released") and split_invariant(v)]


def group_cov_loop(rewards: torch.Tensor, values: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Mean over groups of (1/G) sum_i (r_i - R_bar)(v_i - v_bar), one group at a time."""
    covs = []
    for g in group_ids.unique():
        r, v = rewards[group_ids == g].double(), values[group_ids == g].double()
        covs.append(((r - r.mean()) * (v - v.mean())).mean().item())
    return sum(covs) / len(covs)


def tis_cap(cap: float) -> list[str]:
    """Token-level truncated importance weights at ``cap`` (0: none), as ``rollout.correction`` says it."""
    if not cap:
        return ["rollout.correction.rollout_is=none"]
    return ["rollout.correction.rollout_is=token", f"rollout.correction.rollout_is_threshold={cap}"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return recorded_rollout(tmp_path_factory.mktemp("combinations"))


@pytest.mark.parametrize(("bicc", "rcc", "kl", "tis", "where", "extra"), COMBINATIONS)
def test_every_combination_of_switches_is_the_reference(bicc, rcc, kl, tis, where, extra, recorded, monkeypatch):
    tmp, out, sampled, ref_model = recorded
    cfg = compose_cfg([*COMBINATION_CFG, f"bicc={bicc}", f"rcc={rcc}", f"algo.kl_coef={kl}", *tis_cap(tis),
                       f"rcc.delta_context={where}", *extra.split()])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    with_logprobs = tis > 0 or cfg.rollout.old_from_sampler
    s.engine, s.plan = ReplayEngine(out, sampled if with_logprobs else None), None  # the plan is resolved for this engine
    s.task = CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout
    monkeypatch.setattr(step_module, "collect_rollout", lambda *a, **k: rollouts.append(collect(*a, **k)) or rollouts[-1])
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    ro = rollouts[0]
    # the sampler's weights or rejection need pi_old before the loss: a pass of its own
    if corrects(cfg.rollout) and with_logprobs and not cfg.rollout.old_from_sampler:
        assert s.plan.old_source == "forward"
    if bicc != "off":
        assert metrics["bicc/samples_conditioned_share"] > 0  # contexts were built and read
    if bicc == "released" or "mode=last" in extra:  # one opposite attempt each
        assert metrics["bicc/attempts_shown"] == 1.0
    if tis > 0 and "rollout_is=" not in extra and "rollout_rs" not in extra:
        assert 0 < metrics["rollout_corr/rollout_is_oob_ratio"] < 1  # the weights are neither all 1 nor all capped
    if "rollout_rs" in extra:
        assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1  # some tokens left the loss, not all

    reference = copy.deepcopy(before)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    out = algorithm1_step(reference, ref_model, optimizer, warmup_cosine(optimizer, 0, 10, 1.0), s.tokenizer, ro,
                          StepConfig.of(cfg), s.task.answer_anchors, s.end_ids)
    if bicc != "off":  # the logged conditioning weights log pi_old(o | x^c) - log pi_old(o | q), by reward, wherever
        # the step has pi_old on both (bicc=stable has it on q only for TIS or a delta on q; the released form's update
        # runs on q, and its first forward is pi_old on q)
        expected = conditioning_weights(out["log_w"], out["conditioned"], ro.correct)
        on_q = bicc != "stable" or tis > 0 or (rcc != "off" and where == "q") or "diag" in extra
        logged = {k: metrics[k] for k in expected if k in metrics}
        assert expected and logged == (pytest.approx(expected, abs=1e-4) if on_q else {})
        if on_q:  # what delta on x^c would add to Cov(r, delta): Cov(r, log w), group by group
            cov = group_cov_loop(ro.rewards, out["log_w"], ro.group_ids)
            assert metrics["bicc/cov_r_log_w"] == pytest.approx(cov, abs=1e-4) and abs(cov) > 1e-3
    assert metrics["train/adv_abs_mean"] == pytest.approx(out["advantages"].abs().mean().item(), rel=1e-5)
    moved = max((p - b).abs().max().item() for p, b in zip(reference.parameters(), before.parameters()))
    assert moved > 1e-3  # the step moved the weights: the comparison below is not of two no-ops
    for (name, p), q in zip(s.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=2e-6, rtol=1e-4, msg=name)


def test_the_sampler_gap_read_from_the_update_is_a_pass_on_the_weights_before_it(recorded, monkeypatch):
    """Without a context or a correction, nothing needs pi_old on q before the update: its first forward supplies it,
    and the sampler's gap to it (``rollout/logprob_diff``) is read after the update from that forward. It equals the
    gap to a no-grad pass on the weights before the step."""
    tmp, out, sampled, _ = recorded
    cfg = compose_cfg([*COMBINATION_CFG, "bicc=off", "rcc=off", "rollout.correction.rollout_is=none"])
    s = build_rl_state(cfg, str(tmp / "policy"), str(tmp / "init"), torch.device("cpu"))
    s.engine, s.plan, s.task = ReplayEngine(out, sampled), None, CoinTask(s.task)
    sgd(s)
    before = copy.deepcopy(s.model)
    rollouts, collect = [], step_module.collect_rollout
    monkeypatch.setattr(step_module, "collect_rollout", lambda *a, **k: rollouts.append(collect(*a, **k)) or rollouts[-1])
    metrics, _ = rl_step(s, StepConfig.of(cfg))
    assert s.plan.passes == () and s.plan.old_source == "update" and metrics["perf/no_grad_passes"] == 0
    ro = rollouts[0]
    batch = make_token_batch(ro.out.prompt_ids, ro.out.completion_ids, s.tokenizer.pad_token_id)
    old = logprobs_no_grad(before, QueryRows(batch), len(batch.input_ids), 64, cfg.rollout.temperature)
    assert metrics["rollout/logprob_diff"] > 0.05
    assert metrics["rollout/logprob_diff"] == pytest.approx(sampler_logprob_diff(ro.out.logprobs, old, batch.completion_mask),
                                                            abs=1e-6)
