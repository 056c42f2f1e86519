"""A trainer with rollout workers, run as a process of its own by the tests: ``python tests/async_trainer.py <policy
dir> <mode> [overrides...]``.

- ``run``: two RL steps under ``rollout.async_steps=1``, then a clean stop; prints ``trained <step>``;
- ``kill-start``: the workers started and every batch of the schedule requested, it prints ``started`` and the pids
  of every process it started (its descendants) and kills itself with SIGKILL, while the workers draw and return
  their batches;
- ``kill-push``: one step, then a SIGKILL in the middle of the next weight push (after its first bucket), while the
  workers are receiving.

No clean-up can run after a SIGKILL: the workers (and their math-verify processes) must end by themselves."""

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bicc.config import StepConfig  # noqa: E402
from bicc.rollout.workers import RolloutWorkers  # noqa: E402
from bicc.trainer.state import build_rl_state  # noqa: E402
from bicc.trainer.step import rl_step  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402


def descendants(pid: int) -> list[int]:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def read_by_workers(workers, message: int, timeout_s: float = 60.0) -> None:
    """Wait until every worker has read message ``message`` (1, 2, ...) sent to it (a read message's key is
    deleted)."""
    import time

    deadline = time.monotonic() + timeout_s
    for link in workers.line.links:
        key = f"{link.inbox.name}/{message}"
        while workers.line.store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)


def die() -> None:
    print("started", *descendants(os.getpid()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":  # the workers may import this file as a module
    policy, mode, *overrides = sys.argv[1:]
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout.async_steps=1", "rollout.prompts_per_step=2",
                       "rollout.group_size=2", "rollout.max_new_tokens=4", "diag.every=0", *overrides])
    s = build_rl_state(cfg, policy, policy, torch.device("cpu"))
    s.workers = RolloutWorkers(cfg, policy, s.cursor)
    s.workers.start(s.model, 0)
    if mode == "kill-start":  # once the worker holds its requests (it may be stuck in one: a planted hang)
        read_by_workers(s.workers, 2)  # its requests: weight version 0, then batches 0 and 1
        die()
    if mode == "kill-push":
        import bicc.rollout.weight_sync as weight_sync

        broadcast = weight_sync.broadcast
        calls = []

        def broadcast_then_die(group, tensor):
            broadcast(group, tensor)
            calls.append(1)
            if len(calls) > len(s.workers.buckets):  # the second push's first bucket is out
                die()

        weight_sync.broadcast = broadcast_then_die
    for _ in range(2):
        rl_step(s, StepConfig.of(cfg))
    s.workers.close()
    print(f"trained {s.step}", flush=True)
