"""Preemption: a scheduler asking the run to stop before it kills it. Slurm sends SIGTERM at the time limit and, with
``--signal=USR1@N``, SIGUSR1 N seconds ahead of it; Kubernetes and spot instances send SIGTERM before SIGKILL.

The handler only notes the first signal (a second one, during the save, changes nothing). The run loop asks after
each step, every rank together (``bicc.trainer.loop.run_rl``): the step in progress is finished, not abandoned (a
step is what a checkpoint holds: half an optimizer step cannot be written, and the rest of a step is at most one
step's time), a checkpoint of it is written (with the batches rollout workers had drawn ahead), and the process exits
with ``REQUEUE_EXIT``, which ``docs/slurm/*.sbatch`` read as "requeue, then ``resume=auto``". Processes a run
starts for itself (rollout workers, math-verify workers) ignore these signals: their trainer ends them, or the
kernel does when it dies (``bicc.machine.host.die_with_parent``)."""

from __future__ import annotations

import os
import signal
import time

REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped on request with a checkpoint of its last step; run again with resume=auto
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the run loop once the checkpoint of the last step is written; ``train.py`` exits ``REQUEUE_EXIT``."""


class Preemption:
    """The signals' handler for one run: ``install()`` in the main thread, ``requested`` after each step,
    ``restore()`` at the end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at = 0.0
        self._previous: dict = {}

    def install(self) -> "Preemption":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def reason(self) -> str | None:
        """The signal and its age once one came, else None (a wait that no step follows stops on it)."""
        return self.describe() if self.requested else None

    def describe(self) -> str:
        """The signal and the seconds since it came (this process's, where it got one)."""
        if self.signum is None:
            return "another rank's signal"
        return f"{signal.Signals(self.signum).name} {time.monotonic() - self.at:.1f} s ago"

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def ignore_preemption() -> None:
    """In a process the run started for itself: the scheduler's signals are the trainer's to act on, so this process
    lets them pass, but every process it starts keeps the default dispositions. A signal set to SIG_IGN would be
    inherited across fork and exec, and a reward's ``multiprocessing.Pool`` (whose exit ends its workers with SIGTERM)
    or any subprocess ended with SIGTERM would then never end, leaving this process waiting for it. A handler that
    does nothing is reset to the default by exec, and by ``os.fork``'s hook below in a forked child; interrupted
    system calls restart (``siginterrupt``)."""
    for sig in SIGNALS:
        signal.signal(sig, _let_pass)
        signal.siginterrupt(sig, False)
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_defaults_in_child)
        _FORK_HOOK.append(True)


_FORK_HOOK: list = []


def _let_pass(signum, frame) -> None:
    """The trainer acts on it; this process carries on."""


def _defaults_in_child() -> None:
    for sig in SIGNALS:
        if signal.getsignal(sig) is _let_pass:
            signal.signal(sig, signal.SIG_DFL)
