"""``train.py`` that sends itself a signal at chosen moments, for the preemption tests, or whose checkpoint writes fail:

    python tests/signal_at.py SIGNAL WHERE [WHERE ...] -- <train.py overrides>

Each WHERE is ``<phase>:<n>`` (on entering the n-th ``generate``, ``log-probs`` or ``update`` phase of the run, i.e.
inside step n of this process) or ``save:<n>`` (inside the n-th checkpoint write, before it writes anything). SIGNAL
``NONE``: no signal (the test sends its own). ``BICC_SLOW_SAVE_S=<s>``: every checkpoint write takes that much longer
on every rank (a slow file system), before it starts. Under
torchrun ``BICC_SIGNAL_RANK`` names the one rank that signals itself (default: every rank); ``BICC_SIGNAL_GROUP=1``
signals its whole process group instead (the rollout workers and math-verify processes it started too). SIGNAL ``ENOSPC`` or
``EACCES``: the n-th checkpoint's weights fail to write with that error instead, after the checkpoint's dir exists."""

import errno
import os
import runpy
import signal
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
split = sys.argv.index("--")
FAILURE = sys.argv[1] if sys.argv[1] in ("ENOSPC", "EACCES") else None
SIGNAL = None if FAILURE or sys.argv[1] == "NONE" else getattr(signal, sys.argv[1])
SLOW_SAVE_S = float(os.environ.get("BICC_SLOW_SAVE_S", "0"))
WHERE = {tuple(w.split(":")) for w in sys.argv[2:split]}
sys.argv = [str(ROOT / "train.py"), *sys.argv[split + 1:]]
MINE = os.environ.get("BICC_SIGNAL_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")
seen = Counter()


def mark(kind: str) -> None:
    seen[kind] += 1
    if MINE and SIGNAL is not None and (kind, str(seen[kind])) in WHERE:
        print(f"[test] {signal.Signals(SIGNAL).name} sent in {kind} {seen[kind]}", flush=True)
        if os.environ.get("BICC_SIGNAL_GROUP"):  # to every process of the run, as a scheduler signalling them all
            os.killpg(os.getpgid(0), SIGNAL)
        else:
            os.kill(os.getpid(), SIGNAL)


import bicc.machine.tracking  # noqa: E402
import bicc.trainer.checkpoint  # noqa: E402
import bicc.trainer.loop  # noqa: E402

save_hf = bicc.trainer.checkpoint.save_hf


def failing_save_hf(model, tokenizer, path, *args, **kwargs):
    seen["write"] += 1
    if ("save", str(seen["write"])) in WHERE:
        print(f"[test] {FAILURE} in write {seen['write']}", flush=True)
        raise OSError(getattr(errno, FAILURE), os.strerror(getattr(errno, FAILURE)), str(path / "model.safetensors"))
    return save_hf(model, tokenizer, path, *args, **kwargs)


if FAILURE:
    bicc.trainer.checkpoint.save_hf = failing_save_hf

phase = bicc.machine.tracking.PhasePeaks.phase


@contextmanager
def marked_phase(self, name):
    mark(name)
    with phase(self, name):
        yield


bicc.machine.tracking.PhasePeaks.phase = marked_phase
save = bicc.trainer.loop.save_rl_checkpoint


def marked_save(*args, **kwargs):
    mark("save")
    if SLOW_SAVE_S:
        print(f"[test] the checkpoint write takes {SLOW_SAVE_S:g} s longer", flush=True)
        import time

        time.sleep(SLOW_SAVE_S)
    return save(*args, **kwargs)


bicc.trainer.loop.save_rl_checkpoint = marked_save
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
