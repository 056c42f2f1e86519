"""Progress on long loops: a tqdm bar on a terminal; elsewhere (a log file, CI) a plain line at most every
``every_s`` seconds and one at the end, instead of a carriage-return redraw per step."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class LineProgress:
    """The part of tqdm's interface the loops use, printed as occasional lines."""

    def __init__(self, total: int, desc: str, initial: int = 0, every_s: float | None = 30.0):
        """``every_s`` None: silent."""
        self.total, self.desc, self.n, self.every_s = total, desc, initial, every_s
        self.postfix, self.start, self.last = "", time.perf_counter(), time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.every_s is not None and time.perf_counter() - self.last >= self.every_s:
            self._line()

    def set_postfix(self, **values) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def _line(self) -> None:
        self.last = time.perf_counter()
        print(f"[{self.desc}] {self.n}/{self.total} ({time.perf_counter() - self.start:.0f}s) {self.postfix}".rstrip(),
              flush=True)

    def close(self) -> None:
        if self.every_s is not None and self.n:
            self._line()


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0, leave: bool = True):
    """A progress reporter for ``total`` steps: tqdm on a terminal, occasional lines otherwise, nothing when
    not ``enabled``."""
    if enabled and sys.stdout.isatty():
        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=leave)
    return LineProgress(total, desc, initial, every_s=30.0 if enabled else None)
