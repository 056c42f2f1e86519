"""The step's log-prob plan (bicc/trainer/plan.py): which passes each configuration makes, that every pass it
skips is replaced by the same numbers, and the HF engine's sampling log-probs."""

import pytest
import torch

from bicc.config import StepConfig, TinyArchConfig, diag_every
from bicc.data import encode_prompt
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import QueryRows
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch
from bicc.rollout import EngineOptions, SamplingParams, build_engine
from bicc.trainer.plan import StepPlan, loads_reference
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, rows, state_for


def passes(overrides, sampler=False, diagnostics=False):
    cfg = compose_cfg(overrides)
    return StepPlan.from_config(StepConfig.of(cfg), sampler, diagnostics).describe()


@pytest.mark.parametrize("overrides, loads", [
    (["bicc=off", "rcc=off"], False),  # plain GRPO: nothing reads pi_ref
    (["bicc=on", "rcc=off"], False),  # the paper's BiCC alone: pi_old on q, no reference
    (["bicc=off", "rcc=on", "diag.every=0"], True),  # RCC's delta
    (["bicc=off", "rcc=off", "diag.every=5"], True),  # only the diagnostics' steps read it
    (["algo=dr_grpo", "bicc=off", "rcc=off"], True),  # Dr.GRPO's KL term (kl_coef 0.01)
    (["bicc=off", "rcc=off", "algo.ratio_denominator=ref"], True),
])
def test_the_run_loads_the_reference_exactly_when_a_step_plan_reads_it(overrides, loads):
    cfg = StepConfig.of(compose_cfg(["sft.cache_dir=/tmp/x", *overrides]))
    assert loads_reference(cfg) is loads
    plans = [StepPlan.from_config(cfg, False), StepPlan.from_config(cfg, False, diagnostics=True)]
    reads = [any(policy == "ref" for policy, _ in p.passes) for p in plans]
    assert any(reads[: 2 if diag_every(cfg.diag, cfg.rcc) > 0 else 1]) is loads


def test_passes_per_configuration():
    # plain GRPO, one update per rollout: pi_old is the update's own first forward; nothing else
    assert passes(["bicc=off", "rcc=off"]) == ["update on q (forward + backward, supplies pi_old)"]
    # several updates per rollout: pi_old must be frozen before the first
    assert passes(["bicc=off", "rcc=off", "train.epochs_per_rollout=2"])[0] == "pi_old on q (no grad)"
    # the paper's BiCC + RCC with delta on x^c (Algorithm 1): pi_old on q, pi_ref on q, theta_old on x^c
    update = "update on x^c (forward + backward)"
    old_q, ref_q, old_xc = "pi_old on q (no grad)", "pi_ref on q (no grad)", "pi_old on x^c (no grad)"
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc"]) == [old_q, ref_q, old_xc, update]
    # delta on q (Section 4.2, rcc=on itself) reuses pi_old on q: one pass fewer; the sampler's log-probs replace it
    assert passes(["bicc=on", "rcc=on"]) == passes(["experiment=paper_qwen3_4b", "bicc=on", "rcc=on"]) == [old_q, ref_q, update]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc", "rollout.old_from_sampler=true"],
                  sampler=True) == [ref_q, old_xc, update]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=q", "rollout.old_from_sampler=true"], sampler=True) == [ref_q, update]
    # the stabilised form: pi_old on x^c is the update's forward unless delta needs it first
    assert passes(["bicc=stable", "rcc=off"]) == ["update on x^c (forward + backward, supplies pi_old)"]
    assert passes(["bicc=stable", "rcc=on", "rcc.delta_context=xc"]) == [old_xc, ref_q, update]
    # ... and with delta on q it needs pi_old on q beside pi_old on x^c
    assert passes(["bicc=stable", "rcc=on"]) == [old_xc, old_q, ref_q, update]
    # ... and its KL term reads pi_ref on x^c, like with like, and nothing on q
    assert passes(["algo=dr_grpo", "bicc=stable", "rcc=off"]) == ["pi_ref on x^c (no grad)",
                                                                  "update on x^c (forward + backward, supplies pi_old)"]
    # a base variant with RCC, or a diagnostics step: delta needs pi_old and pi_ref before the update
    assert passes(["bicc=off", "rcc=on"]) == passes(["bicc=off", "rcc=off"], diagnostics=True) == [
        old_q, ref_q, "update on q (forward + backward)"]
    # an engine with sampling log-probs (vLLM, rollout workers): TIS's weights need pi_old on q before the loss;
    # the gap alone (a metric) is read after the update from its forward
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=token"], sampler=True) == [
        old_q, "update on q (forward + backward)"]
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=none"], sampler=True) == [
        "update on q (forward + backward, supplies pi_old)"]
    assert passes(["bicc=on", "rcc=off", "rollout.correction.rollout_is=token"], sampler=True) == [old_q, update]


def test_plan_errors_name_the_field():
    with pytest.raises(ValueError, match="old_from_sampler.*old_on_context"):
        StepPlan.from_config(StepConfig.of(compose_cfg(["bicc=stable", "rollout.old_from_sampler=true"])), True)
    with pytest.raises(ValueError, match="old_from_sampler needs sampling log-probs"):
        StepPlan.from_config(StepConfig.of(compose_cfg(["rollout.old_from_sampler=true"])), False)


def test_pi_old_from_the_update_forward_gives_the_same_update():
    """One update per rollout: taking pi_old from the update's own forward changes no weight."""
    cfg = compose_cfg(["algo=grpo", "rollout.max_new_tokens=9", "train.micro_batch_size=5"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    adv = torch.linspace(-1.5, 1.5, 12)
    a, b = build_tiny(ARCH, seed=0)[0], build_tiny(ARCH, seed=0)[0]
    old = logprobs_no_grad(a, QueryRows(batch), 12, 5, 1.0)
    metrics_a, first_a = update_policy(state_for(a), batch, QueryRows(batch), old, None, adv, cfg, step_seed=1)
    metrics_b, first_b = update_policy(state_for(b), batch, QueryRows(batch), None, None, adv, cfg, step_seed=1)
    moved = max((p - q).abs().max().item() for p, q in zip(build_tiny(ARCH, seed=0)[0].parameters(), a.parameters()))
    assert moved > 1e-3
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    assert metrics_b["train/ratio_mean"] == 1.0
    assert metrics_a["train/loss"] == pytest.approx(metrics_b["train/loss"], abs=1e-7)
    torch.testing.assert_close(first_b, old, atol=1e-6, rtol=0)  # the first forward is pi_old, zeros past each output


class SamplerCfg:
    batch_size = 64
    old_from_sampler = True


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_sampling_logprobs_equal_the_trainers(temperature):
    model, tok = build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16), seed=0)
    # every 4th token ends an output, so that outputs are ragged
    engine = build_engine("hf", model, tok, SamplerCfg, EngineOptions(end_ids=tuple(range(0, len(tok), 4))))
    prompts = [encode_prompt(tok, t) for t in ("Compute 1+2.", "Compute 10-3+4.")]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=temperature, top_p=1.0, max_new_tokens=10, seed=0))
    assert [len(lp) for lp in out.logprobs] == [len(c) for c in out.completion_ids]
    assert len({len(c) for c in out.completion_ids}) > 1  # ragged: the grid alignment is exercised
    batch = make_token_batch(out.prompt_ids, out.completion_ids, tok.pad_token_id)
    trainer = logprobs_no_grad(model, QueryRows(batch), 6, 6, temperature)
    for i, lp in enumerate(out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), trainer[i, : len(lp)], atol=1e-5, rtol=0)
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0))
    assert greedy.logprobs is None
