"""What tests/test_zygote.py reads of a rank under torchrun: ``torchrun --nproc_per_node=2 tests/zygote_rank_probe.py
<ok|fail>`` (fail: rank 1 exits 3 after the collective, rank 0 waits to be stopped)."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "OMP_NUM_THREADS")
words = [f"rank{rank}", *(f"{name}={os.environ.get(name)}" for name in names), f"sum={total.item()}",
         f"elastic={'TORCHELASTIC_RUN_ID' in os.environ}", f"threads={torch.get_num_threads()}"]
os.write(1, (" ".join(words) + "\n").encode())  # one write: the ranks share the output
dist.destroy_process_group()
if sys.argv[1] == "fail":
    if rank == 1:
        sys.exit(3)
    time.sleep(600)
