"""``train.py`` that records, for every RL step, the contexts x^c its update read (each ``ContextRows`` built by the
step, decoded), into ``contexts_read.json`` in the run dir. Usage: ``python tests/record_contexts.py <overrides>``."""

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bicc.kernels.rows as rows  # noqa: E402

read: dict[int, list[str]] = {}
ContextRows = rows.ContextRows


def recording(contexts, *args, **kwargs):
    if sys._getframe(1).f_code.co_name != "step_rows":  # the rows on q (train.share_prompts), not on x^c
        return ContextRows(contexts, *args, **kwargs)
    state = sys._getframe(2).f_locals["s"]  # rl_step(s, ...) through step_rows: the step being built is s.step + 1
    read[state.step + 1] = [state.tokenizer.decode(ids) for ids in contexts.prompt_ids]
    run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir="))
    Path(run_dir, "contexts_read.json").write_text(json.dumps(read))
    return ContextRows(contexts, *args, **kwargs)


rows.ContextRows = recording
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
