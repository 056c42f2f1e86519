"""Preemption: a scheduler asking the run to stop before it kills it. Slurm sends SIGTERM at the time limit and, with
``--signal=USR1@N``, SIGUSR1 N seconds ahead of it; Kubernetes and spot instances send SIGTERM before SIGKILL.

The handler only notes the first signal (a second one, during the save, changes nothing). The run loop asks after
each step, every rank together (``bicc.trainer.loop.run_rl``): the step in progress is finished, not abandoned (a
step is what a checkpoint holds: half an optimizer step cannot be written, and the rest of a step is at most one
step's time), a checkpoint of it is written (with the batches rollout workers had drawn ahead), and the process exits
with ``REQUEUE_EXIT``. Under torchrun that code stays the ranks': torchrun, signalled itself, exits 1 after them
(``docs/slurm/*.sbatch`` read no code: they requeue on USR1 and the run resumes with ``resume=auto``), and kills
ranks still running ``--shutdown-timeout`` seconds after it passed the signal on (30 by default), which the launch
check holds against the predicted save (``preemption_contract``). Processes a run starts for itself (rollout
workers, math-verify workers) let these signals pass: their trainer ends them, or the kernel does when it dies
(``bicc.machine.host.die_with_parent``)."""

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


# ---- The contract at launch: the scheduler's lead, the launcher's grace and the save -------------------------------
TORCHRUN_GRACE_S = 30  # torchrun's default: SIGKILL this long after it forwards a signal to the ranks


def launcher_grace(environ=os.environ, parent_cmdline: str | None = None) -> int | None:
    """Seconds between torchrun forwarding a signal to the ranks and its SIGKILL: its ``--shutdown-timeout`` (read
    from the launcher's command line, this process's parent), else ``PET_SHUTDOWN_TIMEOUT`` or
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else torch's 30 s; None when no torchrun started this process."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    if parent_cmdline is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent_cmdline = f.read().decode(errors="replace").replace("\0", " ")
        except OSError:
            parent_cmdline = ""
    words = parent_cmdline.split()
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            value = value or (words[i + 1] if i + 1 < len(words) else "")
            if value.isdigit():
                return int(value)
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return TORCHRUN_GRACE_S


def checkpoint_bytes(params: int, compute_bytes: int, master_bytes: int, world: int, local_world: int,
                     sharded: bool) -> int:
    """Bytes the node that writes the most (rank 0's) puts in one checkpoint: the HF weights in the compute dtype
    (rank 0), the master weights where wider and AdamW's two moments (fp32), each rank its share under FSDP2's
    sharded writes, rank 0 all of them otherwise."""
    master = params * master_bytes if master_bytes != compute_bytes else 0
    sharded_part = master + 2 * 4 * params
    return params * compute_bytes + (sharded_part * local_world // world if sharded else sharded_part)


def preemption_contract(save_bytes: int, write_gib_s: float, grace_s: int | None, lead_s: float | None,
                        save_every: int) -> tuple[str, list[str]]:
    """What a preempted run has from the signal to its kill against its save's predicted duration: a line to print,
    and warnings naming the setting where the save does not fit (the run then resumes from its last periodic
    checkpoint, up to ``train.save_every`` steps back)."""
    save_s = save_bytes / (write_gib_s * 2**30)
    line = (f"a preempted run finishes its step and saves it: {save_bytes / 2**30:.1f} GiB on this node, about "
            f"{save_s:.0f} s at train.checkpoint_write_gib_s={write_gib_s:g}")
    limits = []
    if grace_s is not None:
        limits.append(f"torchrun kills the ranks {grace_s} s after passing the signal on (--shutdown-timeout)")
    if lead_s is not None:
        limits.append(f"the scheduler kills the job {lead_s:g} s after its signal (train.preemption_lead_s)")
    line += "; " + "; ".join(limits) if limits else "; no launcher or scheduler limit is known"
    lost = lost_steps(save_every)
    warnings = []
    if grace_s is not None and save_s > grace_s:
        room = f" (under the scheduler's {lead_s:g} s)" if lead_s is not None else ""
        warnings.append(f"the save ({save_s:.0f} s) does not fit torchrun's --shutdown-timeout={grace_s}: {lost}. Launch "
                        f"torchrun with --shutdown-timeout above the save and a step{room}")
    if lead_s is not None and save_s > lead_s:
        warnings.append(f"the save ({save_s:.0f} s) does not fit train.preemption_lead_s={lead_s:g}: {lost}. Ask the "
                        "scheduler for more lead (Slurm: --signal=B:USR1@<seconds>)")
    if grace_s is not None and lead_s is not None and grace_s > lead_s:
        warnings.append(f"torchrun's --shutdown-timeout={grace_s} is above the scheduler's lead "
                        f"(train.preemption_lead_s={lead_s:g}): the scheduler's kill comes first")
    return line, warnings


def lost_steps(save_every: int) -> str:
    return ("the save is cut and the run resumes from its last periodic checkpoint, up to "
            f"train.save_every={save_every} steps back")


def measured_contract(step_s: float, save_s: float, grace_s: int | None, lead_s: float | None,
                      save_every: int) -> str | None:
    """The contract again with what the run measured (a step, and a checkpoint it wrote): a preempted step needs at
    most the rest of a step and a save; a warning naming the limit it passes, else None."""
    need = step_s + save_s
    for limit, name in ((grace_s, "torchrun's --shutdown-timeout"), (lead_s, "train.preemption_lead_s")):
        if limit is not None and need > limit:
            return (f"a step took {step_s:.0f} s and its checkpoint {save_s:.0f} s: a preempted step needs up to "
                    f"{need:.0f} s, past {name}={limit:g}: {lost_steps(save_every)}")
    return None


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
