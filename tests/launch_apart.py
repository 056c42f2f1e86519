"""``train.py`` with rank r started r x 1.5 s late: under torchrun, ranks that read the clock seconds apart (as on
several nodes, or after slow imports). Usage: ``torchrun ... tests/launch_apart.py <train.py overrides>``."""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
time.sleep(1.5 * int(os.environ.get("RANK", "0")))
sys.path.insert(0, str(ROOT))
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
