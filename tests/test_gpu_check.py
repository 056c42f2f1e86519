"""``make gpu-check``'s CPU side: it refuses at once without a GPU, its arithmetic by hand, and its rehearsal
command run end to end on CPU at a small shape (the same overrides, model dir, data file and metrics it reads)."""

import dataclasses
import os
import subprocess
import time

import pytest

from bench import gpu_check
from tests.helpers import ROOT


@pytest.mark.launch
def test_without_a_gpu_it_says_so_and_exits_nonzero_at_once(monkeypatch):
    monkeypatch.setattr(gpu_check, "NVIDIA_NODES", ("/nonexistent/nvidiactl",))
    assert "no NVIDIA GPU" in gpu_check.no_cuda_message()
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")):
        pytest.skip("this machine has an NVIDIA device")
    start = time.perf_counter()
    proc = subprocess.run(["make", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 10
    assert proc.returncode != 0 and "no NVIDIA GPU" in proc.stderr


def test_flops_and_summary_by_hand():
    # Qwen3-0.6B: a layer is 1024 x 2048 (q) + 2 x 1024 x 1024 (k, v) + 2048 x 1024 (o) + 3 x 1024 x 3072 (MLP)
    layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    assert layer == 15_728_640
    per_token = gpu_check.model_flops_per_token(gpu_check.QWEN3_06B)
    assert per_token == 6 * (28 * layer + 1024 * 151_936) == 3_575_906_304
    rows = [{"step": 1, "perf/update_s": 9.0, "perf/update_tokens": 1000.0, "perf/compiled_graphs": 11.0},  # not timed
            {"step": 2, "perf/update_s": 2.0, "perf/update_tokens": 30_000.0, "perf/diagnostics_s": 0.5,
             "perf/compiled_graphs": 1.0},
            {"step": 3, "perf/update_s": 1.5, "perf/update_tokens": 40_000.0}, {"eval/x": 1.0}]
    results = {"cuda_max_reserved_gib": 30.0, "cuda_max_allocated_gib": 24.0,
               "cuda_peaks_gib": {"update": {"allocated": 24.0, "reserved": 30.0}, "run": {"allocated": 24.0}}}
    out = gpu_check.summarise(rows, results, gpu_check.QWEN3_06B, 989.0, {"update": 25.0, "generate": 20.0})
    assert out["gpu_train_tokens_per_s"] == 70_000 / 3.0  # (30k + 40k) tokens over (2.0 - 0.5) + 1.5 s
    assert out["gpu_train_mfu"] == pytest.approx(70_000 / 3.0 * 3_575_906_304 / 989e12)
    assert out["gpu_allocated_vs_model"] == 24.0 / 25.0 and out["gpu_reserved_vs_allocated"] == 30.0 / 24.0
    assert out["phases"] == {"update": (24.0, 25.0)}  # a phase the run did not record is left out
    assert out["graphs"] == [(1, 11), (2, 1), (3, 0)]  # per step; a run before the metric existed: 0
    with pytest.raises(RuntimeError, match="no training step"):
        gpu_check.summarise([{"eval/x": 1.0}], {}, gpu_check.QWEN3_06B, 989.0, {"update": 25.0})


def test_the_memory_model_prediction_for_the_check(tmp_path, monkeypatch):
    """The rehearsal's own config as train.py composes it, read from the model dir's config and tokenizer."""
    from bicc.machine.memory import GIB, Arch, Run, allocated

    gpu_check.shape_files(tmp_path, gpu_check.QWEN3_06B)
    monkeypatch.setenv("BICC_DAPO_MATH", str(gpu_check.dapo_file(tmp_path / "dapo.jsonl", rows=50)))
    got = gpu_check.predicted_gib(tmp_path, 79.2)
    assert set(got) == {"generate", "log-probs", "update", "evaluation"}
    # one process: fp32 master 4N + AdamW 8N of N = 596M, a bf16 reference 2N and the bf16 sampler copy 2N in every
    # phase, (update) + fp32 gradients 4N; the rollout's KV cache 64 rows x (prompt + 256) x 29 layers x 2 x 1024 x 2 B
    n = 596_049_920
    assert 16 * n / GIB < got["evaluation"] < got["log-probs"] < got["update"]
    assert got["update"] > 20 * n / GIB
    # the same numbers as bicc.machine.memory for the sizes spelled out (the longest prompt with the contexts' framing: 153
    # characters of the character tokenizer)
    arch = Arch(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151_936, tied=True)
    run = Run(world=1, micro_batch=8, output_tokens=256, prompt_tokens=153, contexts=16, rows=64, chunk_tokens=1024,
              vllm=False, eval_vllm=False, eval_batch_tokens=0, eval_new_tokens=128, eval_rows=8, flash=False,
              rollout_batch=64, gpu_gib=79.2)
    assert got["generate"] == allocated(arch, run)["rollout"] / GIB
    # model.checkpoint_layers=auto as the run resolves it: at 256-token outputs no layer needs the checkpoint
    auto = gpu_check.predicted_gib(tmp_path, 79.2, ("model.checkpoint_layers=auto",))
    run = dataclasses.replace(run, checkpoint_layers=0)
    assert auto["update"] == max(allocated(arch, run)[p] for p in gpu_check.PHASES["update"]) / GIB > got["update"]


@pytest.mark.launch
def test_the_rehearsal_runs_on_cpu_at_a_small_shape(tmp_path, capfd):
    """The check's own pipeline, shrunk: a 2-layer model with Qwen3's 151,936-id vocabulary and the filled
    character tokenizer, the headline overrides, the DAPO-layout file, the constructed reward, 2 steps in two
    legs (step 1 and a checkpoint; a resume from it, step 2 and the final evaluation), each step's batch filled by
    one sampling round."""
    arch = {**gpu_check.QWEN3_06B, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 1024}
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    rows, results = gpu_check.rehearse(tmp_path, arch, env, device="cpu", extra=("device=cpu", "threads=2"),
                                       prompts=4, steps=2, output_tokens=16, eval_tokens=8)
    steps = [r for r in rows if "perf/update_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # one right answer in every group of G = 8: one sampling round fills the batch (at 16 tokens no attempt fits a
    # context's 6-token budget; at the check's 1,024 every sample is conditioned)
    assert all(r["rollout/generate_rounds"] == 1 and r["reward/accuracy"] == 1 / 8 for r in steps)
    assert "resumed from" in capfd.readouterr().out  # the second leg started from the first leg's checkpoint
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir() and (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    assert results["final"]["eval/math500/num_problems"] == 2 and "cuda_max_reserved_gib" not in results
    out = gpu_check.summarise(rows, results, arch, 1.0, {"update": 1.0})
    assert out["gpu_train_tokens_per_s"] > 0 and out["gpu_allocated_vs_model"] is None


@pytest.mark.launch
def test_the_bare_baseline_phase_runs_ours_sharded_and_reads_its_ratio(capfd):
    """The check's third phase on CPU at a tiny shape (its later arguments override the check's own)."""
    small = ("--shape", "cpu_small", "--layers", "1", "--prompts", "1", "--group", "2", "--prompt-tokens", "8",
             "--output-tokens", "16")
    ratio = gpu_check.bare_baseline({**os.environ, "OMP_NUM_THREADS": "1"}, 120.0, extra=small)
    out = capfd.readouterr().out
    assert "ours: sharded by FSDP2 over a one-rank process group" in out
    assert ratio == float(out.split("RESULT update_vs_bare=", 1)[1].split()[0]) > 0


@pytest.mark.launch
def test_a_phase_that_would_overrun_its_budget_is_stopped_and_says_so(tmp_path):
    import sys

    # a launcher whose worker outlives it unless the whole process group is stopped (torchrun and train.py)
    launcher = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(30); open(sys.argv[1], \"w\").close()', sys.argv[1]]); time.sleep(30)")
    marker = tmp_path / "worker_finished"
    start = time.perf_counter()
    with pytest.raises(gpu_check.Cut, match="stopped at its budget of 1 s"):
        gpu_check.run_phase("sleeper", [sys.executable, "-c", launcher, str(marker)], {}, 1.0)
    assert time.perf_counter() - start < 15
    time.sleep(0.5)
    procs = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True).stdout.split()
    assert procs == [], "the cut phase's worker is still running"
    with pytest.raises(gpu_check.Cut, match="no time left"):
        gpu_check.run_phase("late", [sys.executable, "-c", "pass"], {}, 0.0)
    with pytest.raises(RuntimeError, match="failing exited 3"):
        gpu_check.run_phase("failing", [sys.executable, "-c", "raise SystemExit(3)"], {}, 30.0)


# CUDA's allocated peaks (GiB) of make gpu-check's rehearsal on one H100 80GB HBM3 (torch 2.11.0+cu130, transformers
# 5.19.0, SDPA, expandable segments), 2026-11-25, results.json's cuda_peaks_gib: one process under torchrun, FSDP2
# over one rank, 8 prompts x G 8, micro-batch 8, outputs and evaluation at the sizes given (the 1,024 row: four
# benchmarks, the others MATH-500 alone; 2 problems x 4 samples each)
H100_RUNS = {  # output tokens: (evaluation tokens, {phase: allocated GiB})
    1024: (512, {"generate": 16.776, "log-probs": 10.188, "update": 16.898, "evaluation": 9.986}),
    512: (256, {"generate": 13.025, "log-probs": 10.179, "update": 15.344, "evaluation": 9.496}),
    256: (128, {"generate": 11.118, "log-probs": 10.143, "update": 14.678, "evaluation": 9.387}),
}


@pytest.mark.parametrize("output_tokens", sorted(H100_RUNS))
def test_the_memory_model_holds_to_the_h100_runs(output_tokens, tmp_path, monkeypatch):
    """bicc.machine.memory's allocated bytes for the rehearsal's own config: the run's peak and each phase's within 10%
    (docs/performance.md has the table)."""
    eval_tokens, measured = H100_RUNS[output_tokens]
    gpu_check.shape_files(tmp_path, gpu_check.QWEN3_06B)
    monkeypatch.setenv("BICC_DAPO_MATH", str(gpu_check.dapo_file(tmp_path / "dapo.jsonl")))
    predicted = gpu_check.predicted_gib(tmp_path, 79.2, output_tokens=output_tokens, eval_tokens=eval_tokens)
    assert 0.9 <= max(measured.values()) / max(predicted.values()) <= 1.1, predicted
    for phase, got in measured.items():
        assert 0.9 <= got / predicted[phase] <= 1.1, (phase, got, predicted[phase])



def stub_phases(monkeypatch, tmp_path, argv) -> dict:
    """``gpu_check.main`` as on an H100 with its phases stubbed, run with ``argv``: what each phase was asked to run
    (the rehearsal's extra overrides and seconds, the baseline's flags, the memory model's overrides)."""
    import sys
    import types

    asked = {}
    monkeypatch.setenv("BICC_DAPO_MATH", str(tmp_path / "dapo_math.jsonl"))  # main sets it: restored after the test
    fake_cuda = types.SimpleNamespace(get_device_name=lambda i: "H100", get_device_properties=lambda i: types.SimpleNamespace(
        total_memory=80 * gpu_check.GIB))
    monkeypatch.setattr(gpu_check, "no_cuda_message", lambda: None)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake_cuda, __version__="2.11.0"))
    done = ([], {"cuda_max_allocated_gib": 1.0})
    monkeypatch.setattr(gpu_check, "rehearse", lambda out, arch, env, extra=(), budget_s=0:
                        asked.update(rehearsal=extra, rehearsal_s=round(budget_s)) or done)
    monkeypatch.setattr(gpu_check, "bare_baseline", lambda env, s, extra=(): asked.update(baseline=extra) or 2.0)
    monkeypatch.setattr(gpu_check, "predicted_gib", lambda model_dir, gib, extra=(): asked.update(predicted=extra) or {})
    summary = dict.fromkeys(["gpu_peak_gib", "gpu_model_gib", "gpu_train_tokens_per_s", "gpu_train_mfu",
                             "gpu_allocated_vs_model", "gpu_reserved_vs_allocated"], 1.0)
    monkeypatch.setattr(gpu_check, "summarise", lambda *args: {**summary, "phases": {}, "graphs": []})
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--out", str(tmp_path), *argv])
    asked["exit"] = gpu_check.main()
    return asked


@pytest.mark.parametrize("flag", [[], ["--compile"], ["--compile", "dist.reshard_after_backward=false"]])
def test_compile_reaches_the_rehearsal_and_the_baseline(flag, monkeypatch, tmp_path, capsys):
    """``make gpu-check ARGS=--compile``: the rehearsal runs with model.compile=on and a static generate cache, the
    baseline with --compile; without the flag neither does; Hydra overrides after it reach both and the memory
    model's prediction (the phases stubbed: what each was asked to run). The budget is 720 s with the flag (each
    process compiles), 480 s without."""
    asked = stub_phases(monkeypatch, tmp_path, ["--skip-tests", *flag])
    rehearsal = ("model.compile=on", "rollout.hf.static_cache=true", *flag[1:]) if flag else ()
    assert asked == {"rehearsal": rehearsal, "baseline": ("--compile", *flag[1:]) if flag else (), "predicted": rehearsal,
                     "rehearsal_s": 0.8 * (720 if flag else 480), "exit": 0}  # its share of the budget
    assert f"budget {720 if flag else 480} s" in capsys.readouterr().out


def test_without_the_baseline_the_rehearsal_takes_the_whole_budget(monkeypatch, tmp_path, capsys):
    """``--skip-baseline``: no baseline phase and no ``gpu_update_vs_bare`` line; the rehearsal's share of what is
    left is all of it (590 s of ``--budget-s 590``, not 0.8 x 590 = 472), so both compiled legs get a 10-minute
    job's time."""
    asked = stub_phases(monkeypatch, tmp_path, ["--compile", "--skip-tests", "--skip-baseline", "--budget-s", "590"])
    compiled = ("model.compile=on", "rollout.hf.static_cache=true")
    assert asked == {"rehearsal": compiled, "rehearsal_s": 590, "predicted": compiled, "exit": 0}
    out = capsys.readouterr().out
    assert "RESULT gpu_train_mfu=" in out and "gpu_update_vs_bare" not in out and "bare baseline" not in out


def test_the_memory_prediction_reads_the_checks_overrides(tmp_path, monkeypatch):
    """``predicted_gib`` composes the rehearsal's config with the check's overrides: keeping every layer of the
    0.6B shape gathered through the update adds its 26 layers beyond the two FSDP2 holds anyway (bf16, 15,730,944
    parameters a layer: 2 x 1,024 x 2,048 + 2 x 1,024 x 1,024 + 3 x 1,024 x 3,072 + 2 x 1,024 + 2 x 128) to the update's
    peak, and not to the rollout's."""
    gpu_check.shape_files(tmp_path, gpu_check.QWEN3_06B)
    monkeypatch.setenv("BICC_DAPO_MATH", str(gpu_check.dapo_file(tmp_path / "dapo.jsonl")))
    base = gpu_check.predicted_gib(tmp_path, 79.2)
    kept = gpu_check.predicted_gib(tmp_path, 79.2, ("dist.reshard_after_backward=false",))
    assert kept["update"] - base["update"] == pytest.approx(26 * 2 * 15_730_944 / gpu_check.GIB)
    assert kept["generate"] == base["generate"]
