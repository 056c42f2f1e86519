"""What a rollout-worker layout needs of the machine, checked before anything loads (``bicc.trainer.fit.check_workers``,
``bicc.machine.layout``), with faked device counts, environments and hosts."""

import resource
import shutil
from types import SimpleNamespace

import pytest
import torch

from bicc.machine import layout
from bicc.machine.distributed import Dist
from bicc.machine.layout import GIB, host_warnings, worker_gpu
from bicc.machine.memory import QWEN3_4B, Run
from bicc.model.tokenizer import build_char_tokenizer
from bicc.rollout.worker import worker_rollout
from bicc.trainer.fit import check_workers, gate_host_bytes, predicted_run
from tests.conftest import compose_cfg


@pytest.fixture
def roomy_host(monkeypatch, tmp_path):
    """A host with a large /dev/shm, open files to spare and memory: each test takes one of them away."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100000000 kB\nMemAvailable: 90000000 kB\n")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=64 * GIB, used=0, free=64 * GIB))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1 << 20, 1 << 20))
    return meminfo


def test_host_warnings_name_their_fix(roomy_host, monkeypatch):
    assert host_warnings("nccl", 2, GIB, meminfo=str(roomy_host)) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=64 << 20, used=0, free=64 << 20))
    (shm,) = host_warnings("nccl", 2, GIB, meminfo=str(roomy_host))
    assert shm.startswith("/dev/shm has 64 MiB free") and "--shm-size" in shm and "NCCL_SHM_DISABLE=1" in shm
    assert host_warnings("gloo", 2, GIB, meminfo=str(roomy_host)) == []  # nothing of a CPU layout lives there
    (memory,) = host_warnings("gloo", 2, 200 * GIB, meminfo=str(roomy_host))
    assert memory.startswith("host memory: its processes load about 200.0 GiB at start, and 85.8 GiB are available")


def test_the_sampler_checks_host_copies_at_the_paper_preset(roomy_host):
    """Qwen3-4B (4,022,468,096 parameters, fp32 master: 16.09 GB) on 4 FSDP2 ranks, 2 batches drawn ahead: checking
    every step holds 3 copies of each rank's quarter (12.07 GB a rank, 48.27 GB a node); the default, every third
    step, holds one (4.02 GB a rank). DDP holds whole copies; LoRA, the adapters'. The launch check names the setting
    when they do not fit."""
    run = Run(world=4, sharded=True)
    quarter = 4_022_468_096 * 4 // 4
    assert gate_host_bytes(QWEN3_4B, run, 2, 1) == 3 * quarter == 12_067_404_288
    assert gate_host_bytes(QWEN3_4B, run, 2, None) == quarter
    assert gate_host_bytes(QWEN3_4B, Run(world=4, sharded=False), 2, None) == 4 * quarter
    assert gate_host_bytes(QWEN3_4B, run, 2, 0) == 0
    # model.lora r 64 on the seven projections: 64 x (2560+4096 + 2 x (2560+1024) + 4096+2560 + 2 x (2560+9728) +
    # 9728+2560) = 3,670,016 adapter parameters a layer, x 36 layers; only they change between versions
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = Run(world=4, sharded=True, lora_rank=64, lora_targets=every)
    assert gate_host_bytes(QWEN3_4B, adapters, 2, 1) == 3 * 3_670_016 * 36 * 4 // 4
    (memory,) = host_warnings("gloo", 0, 41 * GIB, 4 * 3 * quarter, meminfo=str(roomy_host))
    assert "the sampler check holds 45.0 GiB while training" in memory and "train.sampler_check_every" in memory
    assert host_warnings("gloo", 0, 41 * GIB, 4 * quarter, meminfo=str(roomy_host)) == []  # the default fits 85.8


def test_a_vllm_worker_alone_on_its_gpu_takes_its_own_share():
    """vLLM's share in a worker (bicc.rollout.worker.worker_rollout): rollout.vllm.worker_gpu_memory_utilization on a
    GPU of its own, the colocated rollout.vllm.gpu_memory_utilization beside a training rank (share_gpus) and on CPU."""
    rollout = compose_cfg(["rollout=vllm"]).rollout
    shares = {(device, shared): worker_rollout(rollout, {"device": device, "shares_gpu": shared}).vllm.gpu_memory_utilization
              for device in ("cuda", "cpu") for shared in (False, True)}
    assert shares == {("cuda", False): 0.9, ("cuda", True): 0.4, ("cpu", False): 0.4, ("cpu", True): 0.4}
    assert worker_rollout(rollout, {"device": "cuda", "shares_gpu": False}).vllm.sleep is False


def test_a_low_open_file_limit_is_raised_or_named(roomy_host, monkeypatch):
    """Soft 256 under a hard 65536: raised to the hard limit's 65536 quietly; under a hard 512: a warning with the fix."""
    raised = []
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: raised.append(limits))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (256, 65536))
    assert host_warnings("gloo", 4, 0, meminfo=str(roomy_host)) == [] and raised == [(65536, 65536)]
    monkeypatch.setattr(resource, "getrlimit", lambda what: (256, 512))
    (files,) = host_warnings("gloo", 4, 0, meminfo=str(roomy_host))
    assert "the limit is 256 (hard 512)" in files and "ulimit -n" in files and raised[-1] == (512, 512)


def test_a_worker_gpu_counts_what_its_engine_holds():
    """vLLM: its share of an 80 GiB GPU (0.4 = 32 GiB) and two 32 MiB receive buffers; HF on Qwen3-4B: the bf16 policy
    (2 bytes x 4.02B = 7.5 GiB), its KV cache and logits for 64 rows, the bucket, the runtime."""
    run = Run(gpu_gib=80.0, vllm_utilization=0.4)
    vllm = worker_gpu(QWEN3_4B, run, hf=False, rows=64, bucket_bytes=32 << 20)
    assert sum(vllm.values()) == 0.4 * 80 * GIB + 64 * 2**20
    hf = worker_gpu(QWEN3_4B, run, hf=True, rows=64, bucket_bytes=32 << 20)
    assert hf["policy (compute dtype)"] == 2 * QWEN3_4B.params() and hf["weight push bucket"] == 32 << 20
    assert hf["runtime"] == 2.5 * GIB and any(k.startswith("HF generate KV cache") for k in hf)


ASYNC = ["rollout.async_steps=1", "train.memory_check=true"]


def check(overrides, environ, count=4, world=2):
    cfg = compose_cfg([*ASYNC, *overrides])
    d = Dist(rank=0, world=world, strategy="fsdp2", joined=True)
    from bicc.data import build_task

    task, tokenizer = build_task(cfg.data), build_char_tokenizer()
    predict = lambda gib: predicted_run(cfg, task, tokenizer, d.world, True, gib)  # noqa: E731
    return check_workers(cfg.rollout, cfg.train, predict, d, torch.device("cuda"), environ, count)


def test_the_launch_check_refuses_a_bad_gpu_layout_before_anything_loads(roomy_host, monkeypatch):
    """2 training ranks under CUDA_VISIBLE_DEVICES=4,5,6,7: workers on ids 2 and 3 fit an 80 GiB budget; id 1 is rank 1's
    GPU, id 4 is out of range; a worker GPU that cannot hold its engine names the knob; one beside a training rank
    (rollout.share_gpus) counts both."""
    monkeypatch.setattr(layout, "mem_available", lambda meminfo="": 90 * GIB)
    env = {"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    (line, gate) = check(["rollout.devices=[2,3]", "train.memory_gib=80"], env)
    assert line.startswith("rollout worker GPU: predicted") and line.endswith("of 80.0 GiB (hf)")
    # the tiny model's 0.46M fp32 parameters, one copy of each rank's half at the default spacing
    assert gate.startswith("sampler check: 1 host copy of each training process's share of the weights, 0.9 MiB a ")
    with pytest.raises(ValueError, match=r"GPU 1 \(physical 5\) is training rank 1's GPU"):
        check(["rollout.devices=[1,3]", "train.memory_gib=80"], env)
    with pytest.raises(ValueError, match=r"GPU 4 is out of range: this process sees 4 GPU\(s\)"):
        check(["rollout.devices=[4]", "train.memory_gib=80"], env)
    with pytest.raises(ValueError, match=r"'rollout.devices': rollout worker GPU: predicted .* of 0\.0 GiB \(hf\): it "
                                         r"does not fit. Lower rollout.batch_size"):
        check(["rollout.devices=[2,3]", "train.memory_gib=0.01"], env)
    with pytest.raises(ValueError, match="Lower rollout.vllm.worker_gpu_memory_utilization"):
        check(["rollout=vllm", "rollout.devices=[2]", "train.memory_gib=8", "rollout.vllm.worker_gpu_memory_utilization=0.95",
               "rollout.push_bucket_mib=512"], env)  # its share and the transfer's two buffers: 7.6 + 1 GiB
    # a vLLM worker alone on its GPU takes 0.9 of it (72 GiB of 80), not the colocated engine's 0.4
    (line, _) = check(["rollout=vllm", "rollout.devices=[2]", "train.memory_gib=80"], env)
    assert line == "rollout worker GPU: predicted 72.1 GiB of 80.0 GiB (vllm)"  # + two 32 MiB transfer buffers
    alone = float(check(["rollout.devices=[1]", "rollout.share_gpus=true", "train.memory_gib=80"], env, world=1)[0]
                  .split("predicted ")[1].split()[0])
    apart = float(check(["rollout.devices=[1]", "train.memory_gib=80"], {"LOCAL_WORLD_SIZE": "1"}, world=1)[0]
                  .split("predicted ")[1].split()[0])
    assert alone > apart  # beside a training rank, the rank's peak counts too


def test_the_launch_check_warns_of_a_small_dev_shm_for_nccl(roomy_host, monkeypatch):
    monkeypatch.setattr(layout, "mem_available", lambda meminfo="": 90 * GIB)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=64 << 20, used=0, free=64 << 20))
    lines = check(["rollout.devices=[2,3]", "train.memory_gib=80"], {"LOCAL_WORLD_SIZE": "2"})
    assert lines[0].startswith("warning: /dev/shm has 64 MiB free") and lines[1].startswith("rollout worker GPU")
