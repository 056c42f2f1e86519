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
