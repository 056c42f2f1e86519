"""Tasks, one module each, found on disk: every module of this folder is imported here, so each registers its task in
``bicc.data.TASKS``. ``arith``: the embedded sums with worked steps (its settings ``data.arith``); ``math``: math
problems from JSONL, parquet or HF datasets, scored by the math checker (``data.math``). A new task is its module and
its ``conf/data/<name>.yaml``, with no import to add here.
"""

from bicc.registry import import_folder

import_folder(__name__, __path__)
