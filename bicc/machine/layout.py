"""Where rollout workers run and what their layout needs of the machine, checked before anything loads.

- ``worker_places``: each worker's device. CUDA ids in ``rollout.devices`` are this process's ids, as torch numbers
  the GPUs it sees; a worker is started with ``CUDA_VISIBLE_DEVICES`` set to the launcher's own entry for that id
  (under ``CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun ...``, id 2 is physical GPU 6). An id out of range, listed twice
  or on a training rank's GPU is refused, naming both (``rollout.share_gpus`` allows the last). On CPU the workers
  (``rollout.cpu_workers``) share out the listed cores and the trainer keeps the others.
- ``transport``: how the weights travel (``bicc.rollout.weight_sync``): vLLM's own NCCL transfer to vLLM workers on
  GPUs, NCCL to HF workers on GPUs, gloo on CPU or where a worker shares a training GPU (NCCL cannot join two ranks
  on one device).
- ``host_warnings``: what the host must allow: room in ``/dev/shm`` where NCCL joins GPUs of one node (a
  container's default is 64 MiB), enough open files (raised to the hard limit where it is lower), host memory for
  the processes that load the model at once. Each warning names its fix.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass

GIB = 1024**3
NCCL_SHM_BYTES = 1 * GIB  # room NCCL's intra-node transports want in /dev/shm (a few buffers per peer and channel)
FILES_PER_WORKER = 64  # store and group sockets, a worker's pipes to math-verify; generous
FILES_BASE = 1024  # the run itself: libraries, safetensors, logs


@dataclass(frozen=True)
class Place:
    """A worker's device: ``visible`` is the ``CUDA_VISIBLE_DEVICES`` it is started with (None on CPU), ``cores``
    the CPU cores it keeps (None: any), ``shares`` a training rank's GPU."""

    label: str
    visible: str | None = None
    cores: tuple[int, ...] | None = None
    shares: bool = False


def visible_gpus(environ, device_count: int) -> list[str]:
    """The GPUs this process sees, as the launcher names them: ``CUDA_VISIBLE_DEVICES``'s entries, else 0..n-1."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(device_count)]
    return [x.strip() for x in listed.split(",") if x.strip()][:device_count]


def worker_places(rollout_cfg, world: int, cuda: bool, environ=os.environ, device_count: int = 0,
                  cores: list[int] | None = None) -> list[Place]:
    """The workers this node starts. ``world``: the trainer's processes (``LOCAL_WORLD_SIZE`` of them on this node use
    GPUs 0..n-1); ``device_count``/``cores``: what torch and the affinity mask report (passed in by tests)."""
    chosen = list(rollout_cfg.devices) if rollout_cfg.devices is not None else None
    if cuda:
        gpus = visible_gpus(environ, device_count)
        trainers = int(environ.get("LOCAL_WORLD_SIZE", world))
        if chosen is None:
            chosen = [] if rollout_cfg.remote_workers else list(range(trainers, len(gpus)))
            if not chosen and not rollout_cfg.remote_workers:
                raise ValueError(f"rollout.devices: no GPU is left for rollout workers ({len(gpus)} GPUs, {trainers} "
                                 "training processes); run fewer training processes or list the workers' GPUs")
        places = []
        seen = (f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in environ
                else "all of the machine's")
        for i in chosen:
            if not 0 <= i < len(gpus):
                raise ValueError(f"rollout.devices: GPU {i} is out of range: this process sees {len(gpus)} GPU(s) "
                                 f"({seen}), numbered from 0")
            if chosen.count(i) > 1:
                raise ValueError(f"rollout.devices: GPU {i} is listed {chosen.count(i)} times (one worker per GPU)")
            shares = i < trainers
            if shares and not rollout_cfg.share_gpus:
                raise ValueError(f"rollout.devices: GPU {i} (physical {gpus[i]}) is training rank {i}'s GPU "
                                 f"(cuda:{i}); give the workers GPUs {trainers}..{len(gpus) - 1}, or set "
                                 "rollout.share_gpus=true to run one beside a training rank")
            places.append(Place(f"CUDA device {i}" + (f" (physical {gpus[i]})" if gpus[i] != str(i) else ""),
                                visible=gpus[i], shares=shares))
        return places
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    chosen = chosen if chosen is not None else cores[len(cores) // 2:]
    unknown = sorted(set(chosen) - set(cores))
    if unknown:
        raise ValueError(f"rollout.devices: cores {unknown} are not among this process's cores {cores}")
    if rollout_cfg.remote_workers and rollout_cfg.devices is None:
        return []
    n = rollout_cfg.cpu_workers
    shares = [chosen[i::n] or [chosen[i % len(chosen)]] for i in range(n)]
    return [Place(f"CPU cores {list(c)}", cores=tuple(c)) for c in shares]


def transport(route: str, cuda: bool, places: list[Place]) -> str:
    """How a push travels: the engine's ``weight_route`` between GPUs ("vllm": vLLM's NCCL weight transfer, or
    "nccl"), else "gloo" (on CPU, or where a worker shares a training GPU)."""
    if not cuda or any(p.shares for p in places):
        return "gloo"
    return route


def host_warnings(kind: str, workers: int, load_bytes: int, gate_bytes: int = 0, shm_dir: str = "/dev/shm",
                  meminfo: str = "/proc/meminfo") -> list[str]:
    """What the host lacks for this layout, each with its fix: ``kind`` the transport, ``workers`` how many this node
    starts, ``load_bytes`` what the node's processes load into host memory at start, ``gate_bytes`` what the
    sampler check holds there while training (``bicc.trainer.fit.gate_host_bytes``, the node's processes together).
    Raises the open-file limit to its hard limit where that is needed."""
    warnings = []
    if kind in ("nccl", "vllm") and workers:
        free = shutil.disk_usage(shm_dir).free if os.path.isdir(shm_dir) else 0
        if free < NCCL_SHM_BYTES:
            warnings.append(f"/dev/shm has {free / 2**20:.0f} MiB free; NCCL between this node's GPUs wants about "
                            f"{NCCL_SHM_BYTES / GIB:.0f} GiB there (a container's default is 64 MiB): start the "
                            "container with --shm-size=8g or --ipc=host, or set NCCL_SHM_DISABLE=1 (slower)")
    need = FILES_BASE + FILES_PER_WORKER * workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, max(need, 65536))
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            warnings.append(f"open files: the limit is {soft} (hard {hard}) and this layout wants about {need}: "
                            "raise it before launching (ulimit -n 65536)")
    available = mem_available(meminfo)
    if available is not None and load_bytes + gate_bytes > available:
        held = (f" and the sampler check holds {gate_bytes / GIB:.1f} GiB while training (raise "
                "train.sampler_check_every: fewer host copies of the weights)" if gate_bytes else "")
        warnings.append(f"host memory: its processes load about {load_bytes / GIB:.1f} GiB at start{held}, and "
                        f"{available / GIB:.1f} GiB are available: start fewer rollout workers on this node "
                        "(rollout.devices) or training processes, or free memory")
    return warnings


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def worker_gpu(arch, run, hf: bool, rows: int, bucket_bytes: int) -> dict[str, float]:
    """Bytes a rollout worker holds on its GPU (``bicc.machine.memory``'s terms). vLLM: its share of the GPU (weights,
    KV cache, activations: ``rollout.vllm.gpu_memory_utilization``) and the two packed buffers of a bucket that vLLM's
    weight transfer receives into. HF: the policy in the compute dtype, one generate call of ``rows`` rows
    (``rollout.batch_size`` at most), the push's receive bucket, the runtime, and 10% fragmentation on the tensors."""
    from bicc.machine.memory import hf_generate

    if not hf:
        return {"vLLM (awake: weights + KV cache)": run.vllm_utilization * run.gpu_gib * GIB,
                "weight transfer buffers (two buckets)": 2 * bucket_bytes}
    parts = {"policy (compute dtype)": run.compute_bytes * arch.params(),
             **hf_generate(arch, run, rows, run.output_tokens, "rollout.batch_size"),
             "weight push bucket": bucket_bytes}
    parts["allocator fragmentation"] = run.fragmentation * sum(parts.values())
    parts["runtime"] = run.runtime_gib * GIB
    return parts
