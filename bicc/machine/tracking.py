"""Metrics sinks: ``metrics.jsonl`` in the run dir (always) and wandb (mode from config); the CUDA memory peaks of
each phase (``PhasePeaks``, for results.json).

Only rank 0 logs. wandb's ``offline`` mode needs no network; ``disabled`` skips it entirely.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class Tracker:
    def __init__(self, run_dir: Path, run_name: str, config: dict, wandb_mode: str, wandb_project: str,
                 enabled: bool = True):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, dir=str(run_dir), mode=wandb_mode,
                                     config=config, reinit="finish_previous")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in metrics.items()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                                 for k, v in clean.items()}}) + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of one step as a wandb table named ``name`` (the run dir's JSONL holds them already)."""
        if self._wandb is None or not rows:
            return
        import wandb

        columns = list(rows[0])
        self._wandb.log({name: wandb.Table(columns=columns, data=[[json.dumps(r.get(c)) if isinstance(r.get(c), list)
                                                                   else r.get(c) for c in columns] for r in rows])},
                        step=step)

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def rewind_jsonl(path: Path, step: int) -> int:
    """Drop rows logged after ``step`` (a resumed run recomputes those steps exactly); returns how many.
    Rewritten atomically, so a kill during the rewind leaves the old file."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line).get("step")
        except json.JSONDecodeError:  # a line cut by the kill
            dropped += 1
            continue
        if row_step is not None and row_step > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return dropped


class PhasePeaks:
    """CUDA's allocated and reserved peaks of each phase of a run (``generate``, ``log-probs``, ``update``,
    ``evaluation``) and of the whole run, in bytes, for results.json; on a CPU device nothing is recorded.
    ``stats``: where the counters are read (``torch.cuda``'s by default)."""

    def __init__(self, device=None, stats=None):
        import torch

        self.device = device
        self.stats = stats if stats is not None else (torch.cuda if device is not None and device.type == "cuda" else None)
        self.peaks: dict[str, dict[str, int]] = {}

    def _fold(self, name: str | None) -> None:
        allocated = self.stats.max_memory_allocated(self.device)
        reserved = self.stats.max_memory_reserved(self.device)
        for key in ("run", name) if name else ("run",):
            now = self.peaks.setdefault(key, {"allocated": 0, "reserved": 0})
            now["allocated"], now["reserved"] = max(now["allocated"], allocated), max(now["reserved"], reserved)

    def phase(self, name: str):
        """A context: the counters restart on entry (the run's peak so far kept) and are read on exit."""
        import contextlib

        if self.stats is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def measured():
            self._fold(None)
            self.stats.reset_peak_memory_stats(self.device)
            try:
                yield
            finally:
                self._fold(name)

        return measured()

    def gib(self) -> dict[str, dict[str, float]]:
        """The peaks so far in GiB (the run's counted up to now), {} on CPU."""
        if self.stats is not None:
            self._fold(None)
        return {name: {k: v / 2**30 for k, v in peak.items()} for name, peak in self.peaks.items()}
