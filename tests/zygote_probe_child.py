"""A process tests/zygote_probe.py starts (``python -m tests.zygote_probe_child <words>``): what it reads of itself,
then exit code 5."""

import os
import sys

print(f"child_argv={sys.argv[1:]!r}")
print(f"child_pid={os.getpid()}")
print(f"child_parent={os.getppid()}")
print(f"child_cwd={os.getcwd()}")
print(f"child_var={os.environ.get('PROBE_CHILD')}")
print(f"child_path0={sys.path[0]}")
print(f"child_main={__name__ == '__main__'}")
print(f"child_preloaded={'torch' in sys.modules}", flush=True)
sys.exit(5)
