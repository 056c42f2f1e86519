"""``train.py`` with rank r started r x 1.5 s late: under torchrun, ranks that read the clock seconds apart (as on
several nodes, or after slow imports). Usage: ``torchrun ... tests/launch_apart.py <train.py overrides>``.

After ``train.py`` returns, each rank writes how many FSDP-wrapped modules are still alive (without collecting)
to ``alive_rank<r>.txt`` in the working dir: any left are freed only at interpreter exit, after the process
group is gone, which is where gloo aborts a finished run now and then."""

import gc
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
time.sleep(1.5 * int(os.environ.get("RANK", "0")))
sys.path.insert(0, str(ROOT))
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")

from torch.distributed.fsdp import FSDPModule  # noqa: E402

alive = sum(isinstance(o, FSDPModule) for o in gc.get_objects())
Path(f"alive_rank{os.environ.get('RANK', '0')}.txt").write_text(str(alive))
