"""The sampler-trainer agreement gate (bicc/rollout/agreement.py): ``rollout/token_prob_ratio`` against hand
arithmetic, the gate's warning and stop, the kept weight versions; then runs with the faults it exists for planted
(tests/sampler_faults.py: a skipped push, weights read in another dtype, a prefix cache not reset), each stopped
with a message naming the setting and the causes, and a healthy run of stale batches that it must pass (measured
at the weights that sampled, not the trainer's current ones). vLLM, FSDP2 and the rollout workers under torchrun:
tests/test_rollout_vllm.py, tests/test_distributed.py."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from bicc.rollout.agreement import SamplerGate, WeightVersions, check_every, kept_versions, mismatch_limit, token_prob_ratio
from tests.helpers import CONSTRUCTED_REWARD, run_train


def test_token_prob_ratio_by_hand():
    # row 0: |d| = 0.1, 0.2 (a third token past its output); row 1: 0.5 and a token the sampler gave no log-prob
    sampled = [[-1.0, -2.0], [-0.5, float("nan")]]
    trainer = torch.tensor([[-1.1, -1.8, -9.0], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    expected = (math.exp(0.1) + math.exp(0.2) + math.exp(0.5)) / 3
    assert token_prob_ratio(sampled, trainer, mask) == pytest.approx(expected, rel=1e-6)
    # the sides swapped (|d| either way), with a fourth token the sampler gives and the trainer matches exactly
    assert token_prob_ratio([[-1.1, -1.8], [-1.0, -3.0]], torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, 0.0]]),
                            mask) == pytest.approx((math.exp(0.1) + math.exp(0.2) + math.exp(0.5) + 1) / 4, rel=1e-6)
    assert token_prob_ratio([[float("nan")], []], trainer, mask) is None  # nothing to compare


def test_the_limit_by_dtype():
    assert mismatch_limit(None, "float32") == 1.01 and mismatch_limit(None, "bfloat16") == 1.1
    assert mismatch_limit(1.5, "float32") == 1.5 and mismatch_limit(0, "bfloat16") == 0


def test_the_gate_warns_once_then_stops_after_its_steps_in_a_row(capsys):
    gate = SamplerGate(1.1, 3)
    verdicts = [gate.check(r, step) for step, r in enumerate([1.0, 1.2, None, 1.3, 1.05, 1.2, 1.25], start=1)]
    assert verdicts == [None] * 7  # 1.2, 1.3 (None: not measured, the streak stands), then 1.05 resets it
    assert capsys.readouterr().out.count("warning: step 2: rollout/token_prob_ratio = 1.2 > train.max_sampler_mismatch") == 1
    stop = gate.check(1.4, 8)
    assert stop and "step 8" in stop and "3 measured steps in a row" in stop and "weight push" in stop
    assert "warning" not in capsys.readouterr().out  # once
    assert SamplerGate(0, 1).check(50.0, 1) is None  # 0: off


def test_weight_versions_swap_in_and_restore_exactly():
    model = torch.nn.Linear(3, 2)
    versions = WeightVersions()
    versions.keep(model, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    after = [p.detach().clone() for p in model.parameters()]
    with versions.at(model, 4):
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after))
    with versions.at(model, 4):  # the swap is its own inverse: the kept copy is version 4's again after
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    versions.keep(model, 5)
    versions.keep(model, 6)
    versions.forget(5, still_read=True)  # version 5 is read again by a later step: older ones go, it stays
    assert list(versions.kept) == [5, 6]
    versions.forget(5)
    assert list(versions.kept) == [6]
    assert versions.bytes() == (3 * 2 + 2) * 4  # one copy of the fp32 weights and bias


def test_the_versions_kept_at_once_and_the_default_spacing():
    # a copy lives from the push of the version a checked step reads to that step: N + 1 steps are in flight
    # (the one training and N drawn ahead), so every step checked at N = 2 holds 3 copies, every 3rd one
    assert [kept_versions(2, k) for k in (0, 1, 2, 3, 4)] == [0, 3, 2, 1, 1]
    assert [check_every(None, n) for n in (0, 1, 2)] == [1, 2, 3]  # null: free without workers, one copy with them
    assert check_every(5, 2) == 5 and kept_versions(2, check_every(None, 2)) == 1


# ---- Runs -------------------------------------------------------------------------------------------------
# The tiny model at a learning rate that moves it between steps (a push missed matters), rollout workers on a core
RUN = ["bicc=stable", "rcc=mean", "sft.steps=5", "sft.batch_size=8", "rollout.prompts_per_step=4",
       "rollout.group_size=4", "rollout.max_new_tokens=16", "bicc.min_attempt_tokens=4", *CONSTRUCTED_REWARD,
       "eval.num_problems=4", "eval.samples_per_problem=1", "eval.max_new_tokens=16", "logger.wandb_mode=disabled",
       "logger.progress=false", "optim.lr=1e-2", "train.sampler_check_every=1"]


def steps_of(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.launch
def test_stale_batches_from_healthy_workers_pass(tmp_path):
    """rollout.async_steps=2: each batch is scored at the weights that drew it, kept for it; the trainer's current
    weights have moved (the gap to pi_old is large), which must not count."""
    run_train([*RUN, "train.steps=5", "rollout.async_steps=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    steps = steps_of(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1, 2, 2, 2]
    assert all(r["rollout/token_prob_ratio"] < 1 + 1e-5 for r in steps), [r["rollout/token_prob_ratio"] for r in steps]
    assert min(r["rollout/logprob_diff"] for r in steps[2:]) > 0.05  # exp(0.05) > the gate's 1.01: staleness is large
    # every step checked: the versions of the step training and the two drawn ahead, a host copy each
    assert max(r["perf/gate_host_bytes"] for r in steps) == 3 * weight_bytes(tmp_path / "run")


@pytest.mark.launch
def test_the_default_check_under_workers_keeps_one_host_copy(tmp_path):
    """train.sampler_check_every null at rollout.async_steps=2: every third step is scored at its batch's version
    (steps 1 and 4 of 5), and the host holds one copy of the weights at most, where checking every step holds three."""
    run_train([*RUN, "train.steps=5", "rollout.async_steps=2", "train.sampler_check_every=null",
               f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    steps = steps_of(tmp_path / "run")
    assert ["rollout/token_prob_ratio" in r for r in steps] == [True, False, False, True, False]
    assert all(r["rollout/token_prob_ratio"] < 1 + 1e-5 for r in steps if "rollout/token_prob_ratio" in r)
    assert max(r["perf/gate_host_bytes"] for r in steps) == weight_bytes(tmp_path / "run")


@pytest.mark.launch
def test_lora_workers_are_pushed_the_adapted_policy_and_the_gate_keeps_only_the_adapters(tmp_path):
    """model.lora under rollout workers: each push sends the weights with the adapters folded in (the workers hold a
    model without adapters), so a batch drawn after a push scores at its version as the trainer's adapted policy does;
    the gate's host copies are the adapters alone, the frozen base never changing."""
    run_train([*RUN, "train.steps=4", "rollout.async_steps=1", "model.lora.r=4", "model.lora.alpha=8",
               "optim.lr=5e-2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    steps = steps_of(tmp_path / "run")
    assert [r["rollout/weight_version"] for r in steps] == [0, 0, 1, 2]
    assert all(r["rollout/token_prob_ratio"] < 1 + 1e-5 for r in steps), [r["rollout/token_prob_ratio"] for r in steps]
    assert min(r["rollout/logprob_diff"] for r in steps[2:]) > 1e-3  # the adapters moved between pushes
    adapters = load_file(tmp_path / "run" / "checkpoints" / "step_4" / "adapter_model.safetensors")
    assert max(r["perf/gate_host_bytes"] for r in steps) == 2 * 4 * sum(t.numel() for t in adapters.values())


def weight_bytes(run_dir) -> int:
    """One fp32 copy of the policy's parameters (its checkpoint's tensors: a tied head once)."""
    tensors = load_file(run_dir / "checkpoints" / "step_5" / "model.safetensors")
    return 4 * sum(t.numel() for t in tensors.values())


FAULTS = {  # engine -> (extra overrides, the step it stops at, the least ratio there); the first push is the start's:
    # skipped, it leaves the worker's initial weights, which are the trainer's then; misread, it is wrong from step 1
    "SkippedPush": (["train.steps=8", "rollout.async_steps=1"], None, 1.01),
    "WrongDtypePush": (["train.steps=6", "rollout.async_steps=1"], 3, 10.0),
}


@pytest.mark.launch
@pytest.mark.parametrize("engine", FAULTS)
def test_a_planted_fault_stops_the_run_naming_the_setting_and_its_causes(engine, tmp_path):
    extra, stop_step, least = FAULTS[engine]
    run_dir = tmp_path / "run"
    proc = run_train([*RUN, *extra, f"rollout.engine=tests.sampler_faults:{engine}", f"hydra.run.dir={run_dir}"],
                     tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "train.sampler_mismatch_steps = 3" in out, out[-3000:]
    assert "3 measured steps in a row" in out and "a weight push that did not reach the sampler" in out
    ratios = [r.get("rollout/token_prob_ratio") for r in steps_of(run_dir)]
    over = [i + 1 for i, r in enumerate(ratios) if r > 1.01]
    if engine == "SkippedPush":
        assert ratios[0] < 1 + 1e-5 and over[0] > 2  # agreement until the weights have moved
    assert over == over[:1] + list(range(over[0] + 1, over[0] + 3)) and len(over) == 3  # three in a row, then stop
    assert stop_step is None or over[-1] == stop_step
    assert ratios[-1] > least and f"step {over[-1]}: rollout/token_prob_ratio" in out
    assert (run_dir / "checkpoints" / f"step_{over[-1]}" / "COMPLETE").exists()  # stopped with a checkpoint
    if over[0] < over[-1]:
        assert out.count("[rollout] warning: step") == 1


@pytest.mark.launch
def test_a_prefix_cache_not_reset_after_a_push_stops_the_run(tmp_path):
    """vLLM (synchronous) whose push leaves its prefix cache: prompts opening with one long instruction share their
    first KV blocks, which then serve from the weights of the step they were cached at."""
    problems = [{"question": f"Read the question below with care, then answer it with one number and nothing else. "
                             f"What is {a}+{b}?", "solution": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    source = tmp_path / "problems.jsonl"
    args = [*[a for a in RUN if not a.startswith("sft.")], "sft.steps=0", "train.steps=6", "data=jsonl",
            f"data.math.train_source={source}", f"data.math.test_source={source}", "data.math.problem_field=question",
            "data.math.answer_field=solution", "rollout=vllm", "rollout.vllm.enforce_eager=true",
            "rollout.vllm.kv_cache_bytes=100000000", "rollout.engine=tests.sampler_faults:StalePrefixCache",
            f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(args, tmp_path, check=False, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUTF8": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "a prefix cache not reset after a push" in out, out[-3000:]
    ratios = [r["rollout/token_prob_ratio"] for r in steps_of(tmp_path / "run")]
    assert ratios[0] < 1 + 1e-5 and min(ratios[1:]) > 1.01, ratios  # before any push it agrees; after, cache served
