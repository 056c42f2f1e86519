"""What tests/test_zygote.py reads of a run: ``python tests/zygote_probe.py <0|3|raise|sleep> [words]`` (``0 threads``:
torch's thread count too; ``0 child``: a process it starts, ``python -m tests.zygote_probe_child``, too)."""

import atexit
import os
import sys
import time

import probe_extra  # on PYTHONPATH only

atexit.register(lambda: print("exit handler ran", flush=True))
print("to stderr", file=sys.stderr)
print(f"argv={sys.argv!r}")
print(f"cwd={os.getcwd()}")
print(f"cache={os.environ.get('BICC_CACHE')}")
print(f"extra={probe_extra.WHERE}")
print(f"main={__name__ == '__main__'}")
print(f"pid={os.getpid()}")
print(f"group={os.getpgid(0)}")
print(f"parent={os.getppid()}")
if sys.argv[1:] == ["0", "threads"]:
    import torch

    print(f"threads={torch.get_num_threads()}")
if sys.argv[1:] == ["0", "child"]:
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "tests.zygote_probe_child", "two words"],
                             env={**os.environ, "PROBE_CHILD": "set"})
    print(f"child_code={child.wait()}", flush=True)
    print(f"started_pid={child.pid}", flush=True)
if sys.argv[1] == "raise":
    raise ValueError("planted")
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
