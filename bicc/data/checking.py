"""Answer checking for math benchmarks and math training rewards: extraction, a fast exact path, and
math-verify behind a hard per-item deadline.

Model outputs are untrusted text. Here that means:

- extraction (``bicc.data.answers``) is a linear scan over at most ``MAX_CHARS`` characters from the end of the output;
- an extracted answer longer than ``MAX_ANSWER_CHARS``, containing text that could only be code
  (``__``, ``import``, ``lambda`` ...), or whose braces do not balance, scores 0 without being parsed;
- math-verify's expression parser ends in sympy's ``parse_expr`` and thereby ``eval``: text that could
  be code never reaches it (the filter above runs in the parent and again in the worker), and it runs
  only on math-verify's own regex-extracted math spans, inside a worker process capped at 4 GiB over what it
  maps when it starts;
- parsing and comparison run in worker processes, each item under a wall-clock deadline: a worker
  past its deadline is killed and replaced and the item scores 0. The kernel ends each with the process it
  serves, however that one ends (a rollout worker's pool included). math-verify's own timeouts use
  ``signal.alarm``, which does nothing outside the main thread (Math-Verify issue 50), so they are
  disabled and this deadline replaces them.

Extraction is configured per dataset as an ordered list of extractor names (``bicc.data.answers.EXTRACTORS``):
the first that finds something wins.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from bicc.data.answers import EXTRACTORS, balanced, canonical, extract, number_of

MAX_ANSWER_CHARS = 1_000
_CODE_LIKE = re.compile(r"__|\bimport\b|\blambda\b|\beval\b|\bexec\b|\bos\.|\bsys\.|\bsubprocess\b|\bopen\(")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where ``bicc`` is importable from


# ---- slow path: math-verify in worker processes (bicc.data.verify_worker) ---------------------------------
def _start_worker(memory_bytes: int):
    """(process, connection) of a new math-verify worker: ``python -m bicc.data.verify_worker`` from the directory
    that holds this package, its end of a socket pair passed as a file descriptor."""
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", "bicc.data.verify_worker", str(theirs.fileno()), str(os.getpid()),
                                 str(memory_bytes)], cwd=PACKAGE_ROOT, pass_fds=(theirs.fileno(),),
                                stdin=subprocess.DEVNULL)
    return proc, Connection(ours.detach())


def _end(proc, timeout_s: float) -> None:
    """Wait ``timeout_s`` for ``proc`` to end, then kill it."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_WARM_ITEM = ("1", "1", ("latex",), 6, False, True)


class VerifyPool:
    """Worker processes running math-verify, with a per-item wall-clock deadline.

    A worker past its deadline is killed and its place taken at once by a warm spare (a worker that has
    already imported math-verify), so the items behind it never wait for imports; a new spare is started in
    the background. Without a warm spare (several kills in quick succession) a fresh worker takes the place
    and takes items again when its imports are done. ``spares``: warm spares kept (default: one per worker)."""

    def __init__(self, workers: int = 2, deadline_s: float = 1.5, memory_bytes: int = 4 << 30,
                 spares: int | None = None):
        self.size, self.deadline_s, self.memory_bytes = max(1, workers), deadline_s, memory_bytes
        self.spares = self.size if spares is None else spares
        self._workers: list = []  # (process, connection) per slot
        self._warming: dict = {}  # connection -> slot (None: a spare), for workers still importing
        self._ready: list = []  # warm spares: (process, connection)
        self._procs: dict = {}  # connection -> process, for the ones warming
        self.timeouts = 0

    def _spawn(self, slot: int | None = None, spare: bool = False):
        proc, parent = _start_worker(self.memory_bytes)
        parent.send(_WARM_ITEM)  # answered once the worker has imported math-verify
        if not spare:
            if slot is None:
                self._workers.append((proc, parent))
                slot = len(self._workers) - 1
            else:
                self._workers[slot] = (proc, parent)
        self._procs[parent] = proc
        self._warming[parent] = slot

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the workers and spares and wait until all have imported math-verify."""
        while len(self._workers) < self.size:
            self._spawn()
        while len(self._ready) + self.spares_importing < self.spares:
            self._spawn(spare=True)
        deadline = time.monotonic() + timeout_s
        while self._warming:
            ready = wait(list(self._warming), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"math-verify workers did not start within {timeout_s:.0f} s")
            for conn in ready:
                self._finish_warm(conn)

    def _finish_warm(self, conn) -> int | None:
        """A worker done importing: the slot it now serves, or None (a spare, or it died and is respawned)."""
        slot = self._warming.pop(conn)
        proc = self._procs.pop(conn)
        try:
            conn.recv()
        except (EOFError, OSError):  # died while importing: try once more later
            self._spawn(slot, spare=slot is None)
            return None
        if slot is None:
            self._ready.append((proc, conn))
        return slot

    def run(self, items: list[tuple]) -> list[bool]:
        """Verify ``items`` (arguments of ``bicc.data.verify_worker.verify``); an item past its deadline is False."""
        if not items:
            return []
        if len(self._workers) < self.size:
            self.start()
        results: list[bool] = [False] * len(items)
        pending = list(range(len(items)))[::-1]
        busy: dict = {}  # connection -> (item index, start time, slot)
        warming_slots = set(self._warming.values())
        idle = [i for i in range(len(self._workers)) if i not in warming_slots]
        while pending or busy:
            while pending and idle:
                slot = idle.pop()
                index = pending.pop()
                _, conn = self._workers[slot]
                conn.send(items[index])
                busy[conn] = (index, time.monotonic(), slot)
            timeout = None
            if busy:
                timeout = max(0.0, min(t for _, t, _ in busy.values()) + self.deadline_s - time.monotonic())
            ready = wait([*busy, *self._warming], timeout=timeout)
            for conn in ready:
                if conn in self._warming:
                    slot = self._finish_warm(conn)
                    if slot is not None:
                        idle.append(slot)
                    continue
                index, _, slot = busy.pop(conn)
                try:
                    results[index] = bool(conn.recv())
                    idle.append(slot)
                except (EOFError, OSError):  # the worker died (e.g. out of memory): wrong, and replace it
                    if self._replace(slot):
                        idle.append(slot)
            now = time.monotonic()
            for conn, (index, started, slot) in list(busy.items()):
                if now - started > self.deadline_s:
                    busy.pop(conn)
                    self.timeouts += 1
                    if self._replace(slot):
                        idle.append(slot)
        return results

    @property
    def spares_importing(self) -> int:
        """Spares started and still importing math-verify (they take no item until done)."""
        return sum(slot is None for slot in self._warming.values())

    def _replace(self, slot: int) -> bool:
        """Kill the worker in ``slot``; True when a warm spare took its place (it can take an item now)."""
        proc, conn = self._workers[slot]
        proc.kill()
        conn.close()
        proc.wait()
        if self._ready:
            self._workers[slot] = self._ready.pop()
            self._spawn(spare=True)  # a new spare, warming in the background
            return True
        self._spawn(slot)
        return False

    def close(self) -> None:
        spares_warming = [(self._procs[c], c) for c, slot in self._warming.items() if slot is None]
        workers = [*self._workers, *self._ready, *spares_warming]
        for proc, conn in workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in workers:
            _end(proc, 2.0)
            conn.close()
        self._workers, self._warming, self._ready, self._procs = [], {}, [], {}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass
class MathChecker:
    """Scores completions against gold answers: 1.0 or 0.0, never raising.

    ``extractors``: ordered extractor names; ``use_math_verify``: fall back to math-verify when the fast
    path cannot decide; ``workers`` / ``deadline_s``: the verify pool."""

    extractors: tuple[str, ...] = ("boxed", "answer_is")
    use_math_verify: bool = True
    workers: int = 2
    deadline_s: float = 1.5
    stats: dict = field(default_factory=lambda: {"fast": 0, "verify": 0, "no_answer": 0, "rejected": 0})

    def __post_init__(self):
        for name in self.extractors:
            EXTRACTORS.get(name)  # unknown names fail here, naming the choices
        self._pool = None

    @property
    def pool(self) -> VerifyPool:
        if self._pool is None:
            self._pool = VerifyPool(self.workers, self.deadline_s)
        return self._pool

    def fast(self, pred: str, gold: str) -> bool | None:
        """True/False when text alone decides, None when math-verify must."""
        a, b = canonical(pred), canonical(gold)
        if a == b:
            return True
        x, y = number_of(a), number_of(b)
        if x is not None and y is not None:
            return abs(x - y) <= 1e-6 * max(1.0, abs(y))
        return None

    def score_many(self, completions: list[str], golds: list[str]) -> list[float]:
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        scores = [0.0] * len(completions)
        slow_items, slow_index = [], []
        for i, (text, gold) in enumerate(zip(completions, golds)):
            pred = extract(text if isinstance(text, str) else "", self.extractors)
            if pred is None:
                self.stats["no_answer"] += 1
                continue
            if len(pred) > MAX_ANSWER_CHARS or _CODE_LIKE.search(pred) or not balanced(pred):
                self.stats["rejected"] += 1
                continue
            decided = self.fast(pred, str(gold))
            if decided is not None or not self.use_math_verify:
                self.stats["fast"] += 1
                scores[i] = float(bool(decided))
                continue
            slow_index.append(i)
            slow_items.append((f"${gold}$", f"$\\boxed{{{pred}}}$", ("latex", "expr"), 6, False, True))
        if slow_items:
            self.stats["verify"] += len(slow_items)
            for i, ok in zip(slow_index, self.pool.run(slow_items)):
                scores[i] = float(ok)
        return scores

    def score(self, completion: str, gold: str) -> float:
        return self.score_many([completion], [gold])[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
