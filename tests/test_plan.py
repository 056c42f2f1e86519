"""The step's log-prob plan (bicc/plan.py): which passes each configuration makes, that every pass it
skips is replaced by the same numbers, and the HF engine's sampling log-probs."""

import pytest
import torch

from bicc.config import TinyArchConfig
from bicc.data import encode_prompt
from bicc.logprobs import make_token_batch
from bicc.models import build_tiny
from bicc.plan import StepPlan
from bicc.rollout import EngineOptions, SamplingParams, build_engine
from bicc.rows import QueryRows
from bicc.trainer import logprobs_no_grad, update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, rows, state_for


def passes(overrides, sampler=False, diagnostics=False):
    cfg = compose_cfg(overrides)
    return StepPlan.from_config(cfg, sampler, diagnostics).passes()


def test_passes_per_configuration():
    # plain GRPO, one update per rollout: pi_old is the update's own first forward; nothing else
    assert passes(["bicc=off", "rcc=off"]) == ["update on q (forward + backward, supplies pi_old)"]
    # several updates per rollout: pi_old must be frozen before the first
    assert passes(["bicc=off", "rcc=off", "train.epochs_per_rollout=2"])[0] == "pi_old on q (no grad)"
    # the paper's BiCC + RCC (delta on x^c, Algorithm 1): pi_old on q, pi_ref on q, theta_old on x^c
    paper = ["pi_old on q (no grad)", "pi_ref on q (no grad)", "pi_theta_old on x^c for RCC's delta (no grad)",
             "update on x^c (forward + backward)"]
    assert passes(["bicc=on", "rcc=on"]) == paper
    # delta on q (Section 4.2) reuses pi_old on q; the sampler's log-probs replace pi_old on q
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=q"]) == [paper[0], paper[1], paper[3]]
    assert passes(["bicc=on", "rcc=on", "rollout.old_from_sampler=true"], sampler=True) == paper[1:]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=q", "rollout.old_from_sampler=true"],
                  sampler=True) == [paper[1], paper[3]]
    # the stabilised form: pi_old on x^c is the update's forward too, unless RCC needs it first
    assert passes(["bicc=stable", "rcc=off"]) == ["update on x^c (forward + backward, supplies pi_old)"]
    assert passes(["bicc=stable", "rcc=on"]) == ["pi_old on x^c (no grad)", "pi_ref on q (no grad)", paper[3]]
    # a diagnostics step needs delta, so pi_old and pi_ref before the update
    assert passes(["bicc=off", "rcc=off"], diagnostics=True) == ["pi_old on q (no grad)", "pi_ref on q (no grad)",
                                                                 "update on q (forward + backward)"]
    # an engine with sampling log-probs (vLLM) keeps pi_old on q for the mismatch metric and TIS
    assert passes(["bicc=off", "rcc=off", "rollout.tis_cap=2"], sampler=True)[0] == "pi_old on q (no grad)"


def test_plan_errors_name_the_field():
    with pytest.raises(ValueError, match="old_from_sampler.*old_on_context"):
        StepPlan.from_config(compose_cfg(["bicc=stable", "rollout.old_from_sampler=true"]), True)
    with pytest.raises(ValueError, match="old_from_sampler needs sampling log-probs"):
        StepPlan.from_config(compose_cfg(["rollout.old_from_sampler=true"]), False)


def test_pi_old_from_the_update_forward_gives_the_same_update():
    """One update per rollout: taking pi_old from the update's own forward changes no weight."""
    cfg = compose_cfg(["algo=grpo", "rollout.max_new_tokens=9", "train.micro_batch_size=5"])
    prompts, completions = rows()
    batch = make_token_batch(prompts, completions, 0)
    adv = torch.linspace(-1.5, 1.5, 12)
    a, b = build_tiny(ARCH, seed=0)[0], build_tiny(ARCH, seed=0)[0]
    old = logprobs_no_grad(a, QueryRows(batch), 12, 5, 1.0)
    metrics_a, _ = update_policy(state_for(a), batch, QueryRows(batch), old, None, adv, cfg, step_seed=1)
    metrics_b, _ = update_policy(state_for(b), batch, QueryRows(batch), None, None, adv, cfg, step_seed=1)
    moved = max((p - q).abs().max().item() for p, q in zip(build_tiny(ARCH, seed=0)[0].parameters(), a.parameters()))
    assert moved > 1e-3
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    assert metrics_b["train/ratio_mean"] == 1.0
    assert metrics_a["train/loss"] == pytest.approx(metrics_b["train/loss"], abs=1e-7)


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
