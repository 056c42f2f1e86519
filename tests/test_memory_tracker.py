"""``bench.memory_tracker``: the real RL step of the paper preset traced for memory on fake tensors (4 FSDP2 ranks
of torch's fake process group), against ``bicc.machine.memory``'s prediction."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.launch

GIB = 1024**3


def trace(tmp_path, *args):
    out = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "bench.memory_tracker", "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8")), proc.stdout


def test_it_refuses_a_torch_whose_tracker_miscounts():
    from bench.memory_tracker import unsupported

    assert "found 2.11.0+cu130" in unsupported("2.11.0+cu130") and "2.13 or newer" in unsupported("2.12.1")
    assert unsupported("2.13.0+cpu") is None and unsupported("2.14.1") is None and unsupported("3.0.0") is None


@pytest.mark.parametrize("options", [[], ["dist.reshard_after_forward=false", "dist.reshard_after_backward=false",
                                          "dist.reduce_grads=step", "model.checkpoint_layers=2"]],
                         ids=["default", "fsdp2-options-two-layers-checkpointed"])
def test_four_layers_of_the_paper_width_trace_every_phase_and_their_weights_are_the_models(options, tmp_path):
    """Between steps (the rollout) a rank holds its fp32 master shard, AdamW's two moments and the bf16 reference
    (FSDP2's root is resharded by then), and in the optimizer step its sharded gradients too (fused AdamW: nothing
    parameter-sized besides): that much the model counts by formula and the trace by tensors, within 5%. The
    update's model is at most 10% above the trace and never below it, with FSDP2's options that keep the gathered
    layers and the unreduced gradients too, there with the top two layers outside the checkpoint (their activations
    held for the backward, ``bicc.machine.memory.saved_per_token``). The update holds more than the no-grad passes,
    which hold more than the rollout. (Half the preset's prompts per step: four micro-batches a rank, not eight, each
    of the preset's size, and eight contexts.)"""
    got, stdout = trace(tmp_path, "--layers", "4", "rollout.prompts_per_step=16", *options)
    traced, model = got["traced"], got["model"]
    assert abs(model["rollout"] / traced["rollout"] - 1) < 0.05
    assert abs(model["optimizer step"] / traced["optimizer step"] - 1) < 0.05
    assert 1.0 <= model["update"] / traced["update"] < 1.10  # the update's terms, SDPA's repeated K/V among them
    assert traced["update"] > traced["no-grad log-probs"] > traced["rollout"] > 0
    assert traced["run"] == max(traced[k] for k in ("rollout", "no-grad log-probs", "update", "optimizer step"))
    assert "RESULT memory_model_vs_tracker=" in stdout


def test_a_run_without_a_reference_traces_none(tmp_path):
    """GRPO without RCC's delta or a KL term loads no frozen reference (``StepPlan.loads_reference``; ``train.py``
    passes none): the trace then holds none either, so between steps a rank holds its fp32 master shard and AdamW's
    two moments (12 bytes a parameter over 4 ranks), what the model counts, within 5%; a bf16 reference would add 2
    bytes a parameter on every rank, two-thirds more. (Two layers of the paper width.)"""
    got, _ = trace(tmp_path, "--layers", "2", "algo=grpo", "bicc=off", "rcc=off", "rollout.prompts_per_step=8")
    traced, model = got["traced"], got["model"]
    assert abs(model["rollout"] / traced["rollout"] - 1) < 0.05, (traced, model)
    assert abs(model["optimizer step"] / traced["optimizer step"] - 1) < 0.05, (traced, model)


@pytest.mark.slow
def test_the_paper_preset_fits_an_80_gib_gpu_with_a_tenth_to_spare(tmp_path):
    """experiment=paper_qwen3_4b algo=dapo bicc=on rcc=on on 4 GPUs, every output at 2,048 tokens: the traced peak
    with the allocator's 10% and the 2.5 GiB CUDA runtime stays under 72 GiB (vLLM sleeps through the update), and
    bicc.machine.memory's update is the trace's within 5%, and not below it."""
    got, stdout = trace(tmp_path)
    assert got["on_gpu"] <= 72 * GIB, stdout[-2000:]
    assert 1.0 <= got["model"]["update"] / got["traced"]["update"] < 1.05, stdout[-2000:]
    assert got["traced"]["rollout"] + 0.4 * 80 * GIB <= 72 * GIB  # the rollout beside vLLM's share, awake
