"""A trainer that starts its rollout workers, prints their pids and kills itself with SIGKILL (no clean-up can run):
the workers must end by themselves. Usage: ``python tests/kill_trainer.py <policy dir>``."""

import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bicc.rollout.workers import RolloutWorkers  # noqa: E402
from bicc.trainer.state import build_rl_state  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402

if __name__ == "__main__":  # the workers are spawned: they import this file as a module
    policy = sys.argv[1]
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "rollout.async_steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=4"])
    s = build_rl_state(cfg, policy, policy, torch.device("cpu"))
    workers = RolloutWorkers(cfg, policy, s.cursor)
    workers.start(s.model, 0)
    print(" ".join(str(p.pid) for p in workers.procs), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
