"""The step's log-prob plan (bicc/trainer/plan.py): which passes each configuration makes, that every pass it
skips is replaced by the same numbers, and the HF engine's sampling log-probs."""

import pytest
import torch

from bicc.config import StepConfig, TinyArchConfig, diag_every
from bicc.data import encode_prompt
from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import QueryRows
from bicc.method.advantages import Advantages
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch
from bicc.rollout import EngineOptions, SamplingParams, build_engine
from bicc.trainer.plan import StepPlan
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, CoinTask, rows, state_for


def passes(overrides, sampler=False, diagnostics=False):
    cfg = compose_cfg(overrides)
    return StepPlan.from_config(cfg, sampler, diagnostics).passes()


@pytest.mark.parametrize("overrides, loads", [
    (["bicc=off", "rcc=off"], False),  # plain GRPO: nothing reads pi_ref
    (["bicc=on", "rcc=off"], False),  # the paper's BiCC alone: pi_old on q, no reference
    (["bicc=off", "rcc=on", "diag.every=0"], True),  # RCC's delta
    (["bicc=off", "rcc=off", "diag.every=5"], True),  # only the diagnostics' steps read it
    (["algo=dr_grpo", "bicc=off", "rcc=off"], True),  # Dr.GRPO's KL term (kl_coef 0.01)
    (["bicc=off", "rcc=off", "algo.ratio_denominator=ref"], True),
])
def test_the_run_loads_the_reference_exactly_when_a_step_plan_reads_it(overrides, loads):
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", *overrides])
    assert StepPlan.loads_reference(cfg) is loads
    plans = [StepPlan.from_config(cfg, False), StepPlan.from_config(cfg, False, diagnostics=True)]
    assert any(p.reference for p in plans[: 2 if diag_every(cfg.diag, cfg.rcc) > 0 else 1]) is loads


def test_passes_per_configuration():
    # plain GRPO, one update per rollout: pi_old is the update's own first forward; nothing else
    assert passes(["bicc=off", "rcc=off"]) == ["update on q (forward + backward, supplies pi_old)"]
    # several updates per rollout: pi_old must be frozen before the first
    assert passes(["bicc=off", "rcc=off", "train.epochs_per_rollout=2"])[0] == "pi_old on q (no grad)"
    # the paper's BiCC + RCC with delta on x^c (Algorithm 1): pi_old on q, pi_ref on q; theta_old on x^c is the
    # update's own first forward (one update per rollout), or a pass of its own
    update, update_delta = "update on x^c (forward + backward)", "update on x^c (forward + backward, supplies RCC's delta)"
    paper = ["pi_old on q (no grad)", "pi_ref on q (no grad)", update_delta]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc"]) == paper
    own_pass = [*paper[:2], "pi_theta_old on x^c for RCC's delta (no grad)", update]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc", "train.delta_from_update=false"]) == own_pass
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc", "train.minibatches_per_rollout=2"]) == own_pass
    # delta on q (Section 4.2, rcc=on itself) reuses pi_old on q, with or without delta_from_update (the paper
    # presets' setting): one pass fewer there; the sampler's log-probs replace pi_old on q
    assert passes(["bicc=on", "rcc=on"]) == passes(["bicc=on", "rcc=on", "train.delta_from_update=false"]) == [*paper[:2], update]
    assert passes(["experiment=paper_qwen3_4b", "bicc=on", "rcc=on"]) == [*paper[:2], update]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=xc", "rollout.old_from_sampler=true"], sampler=True) == paper[1:]
    assert passes(["bicc=on", "rcc=on", "rcc.delta_context=q", "rollout.old_from_sampler=true"],
                  sampler=True) == [paper[1], update]
    # the stabilised form: pi_old on x^c is the update's forward too, and so is RCC's delta
    assert passes(["bicc=stable", "rcc=off"]) == ["update on x^c (forward + backward, supplies pi_old)"]
    stable_xc = ["bicc=stable", "rcc=on", "rcc.delta_context=xc"]
    assert passes(stable_xc) == ["pi_ref on q (no grad)", "update on x^c (forward + backward, supplies pi_old and RCC's delta)"]
    assert passes([*stable_xc, "train.delta_from_update=false"]) == ["pi_old on x^c (no grad)", paper[1], update]
    # ... and with delta on q it needs pi_old on q beside pi_old on x^c
    assert passes(["bicc=stable", "rcc=on"]) == ["pi_old on x^c (no grad)", *paper[:2], update]
    # a base variant with RCC: pi_old and delta (both on q) from the update
    assert passes(["bicc=off", "rcc=on"]) == ["pi_ref on q (no grad)",
                                              "update on q (forward + backward, supplies pi_old and RCC's delta)"]
    # a diagnostics step needs delta, so pi_old and pi_ref before the update
    assert passes(["bicc=off", "rcc=off"], diagnostics=True) == ["pi_old on q (no grad)", "pi_ref on q (no grad)",
                                                                 "update on q (forward + backward)"]
    # an engine with sampling log-probs (vLLM, rollout workers): without a context, the mismatch metric and TIS's
    # weights are read from the update's forward, which is pi_old on q; under BiCC pi_old on q is a pass of its own
    sampler_update = "update on q (forward + backward, supplies pi_old and the sampler's weights)"
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=token"], sampler=True) == [sampler_update]
    # the metric only
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=none"], sampler=True) == [sampler_update]
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=token", "train.delta_from_update=false"],
                  sampler=True)[0] == "pi_old on q (no grad)"
    assert passes(["bicc=off", "rcc=off", "rollout.correction.rollout_is=token", "train.epochs_per_rollout=2"],
                  sampler=True)[0] == "pi_old on q (no grad)"
    assert passes(["bicc=on", "rcc=off", "rollout.correction.rollout_is=token"], sampler=True) == [
        "pi_old on q (no grad)", update]


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
    metrics_a, _, _ = update_policy(state_for(a), batch, QueryRows(batch), old, None, Advantages.given(adv), cfg, step_seed=1)
    metrics_b, _, _ = update_policy(state_for(b), batch, QueryRows(batch), None, None, Advantages.given(adv), cfg,
                                    step_seed=1)
    moved = max((p - q).abs().max().item() for p, q in zip(build_tiny(ARCH, seed=0)[0].parameters(), a.parameters()))
    assert moved > 1e-3
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    assert metrics_b["train/ratio_mean"] == 1.0
    assert metrics_a["train/loss"] == pytest.approx(metrics_b["train/loss"], abs=1e-7)


@pytest.mark.parametrize("form", ["on", "stable", "off"])
def test_delta_from_the_update_gives_the_same_steps(form, tmp_path):
    """train.delta_from_update: RCC's delta read from the update's own first forward (every micro-batch's
    forward, then the advantages, then the backwards) makes one no-grad pass fewer and the same steps as
    its own pass: the same correction and the same weights after two ``rl_step`` calls of 4 micro-batches."""
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    base = [f"bicc={form}", "rcc=on", "rcc.delta_context=xc", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=16", "bicc.min_attempt_tokens=2", "train.micro_batch_size=5",
            "diag.every=0", "optim.warmup_steps=0", "optim.lr=1e-3"]
    runs = {}
    for deferred in (True, False):
        cfg = compose_cfg([*base, f"train.delta_from_update={str(deferred).lower()}"])
        s = build_rl_state(cfg, str(tmp_path), str(tmp_path), torch.device("cpu"))
        s.task = CoinTask(s.task)
        assert s.plan.delta_from_update == deferred
        records = [rl_step(s, StepConfig.of(cfg))[0] for _ in range(2)]
        runs[deferred] = records, [p.detach().clone() for p in s.model.parameters()]
    (read, weights_read), (own, weights_own) = runs[True], runs[False]
    for a, b in zip(read, own):
        assert a["perf/no_grad_passes"] == b["perf/no_grad_passes"] - 1
        assert a["reward/mean"] == b["reward/mean"]
        assert a["bicc/samples_conditioned_share" if form != "off" else "reward/mean"] > 0
        assert a["rcc/cov"] == pytest.approx(b["rcc/cov"], abs=1e-6)
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    assert max(r["rcc/abs_cov"] for r in own) > 1e-3  # the correction acts: delta matters to the update
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), weights_own))
    assert moved > 1e-4
    for p, q in zip(weights_read, weights_own):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_delta_from_the_update_needs_one_update_per_rollout():
    cfg = compose_cfg(["train.epochs_per_rollout=2"])
    with pytest.raises(ValueError, match="train.delta_from_update=false"):
        update_policy(state_for(build_tiny(ARCH, seed=0)[0]), None, None, None, None, Advantages.given(torch.zeros(1)), cfg, 0,
                      delta_from_update=True)


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
