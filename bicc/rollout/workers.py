"""Rollout workers seen from the trainer (``rollout.async_steps`` = N >= 1): worker processes
(``bicc.rollout.worker``) on devices of their own sample the next batches while the trainer updates.

The schedule: before step t trains, batches t .. t+N have been requested; batch t+N+1 is requested right after
the weights of step t are pushed, so it is drawn by theta_{t+1} = the weights after step (t+N+1) - N. Batch t is
therefore drawn by theta_{t-N} (theta_0 for the first N steps) and never by older weights. Every rollout carries
the version that drew it and the trainer refuses one older than N (``check_staleness``).

The line (``bicc.rollout.line``): rank 0 serves a store that every worker joins, those it starts on its node
(``bicc.machine.layout.worker_places``) and ``rollout.remote_workers`` more started elsewhere with
``python -m bicc.rollout.worker --connect <host>:<rollout.worker_port>``. Requests, batches and answers travel there.
The weights travel over a process group of their own, bucket by bucket in the sampler's dtype
(``bicc.rollout.weight_sync``; vLLM workers on GPUs: vLLM's NCCL weight transfer, ``bicc.rollout.vllm_transfer``):
a push tells every worker the version, waits until each is ready to receive it (a worker finishes the batch it is
drawing first), then streams. Under torchrun rank 0 owns the workers: every rank joins the gathering of each tensor
(FSDP2), and rank 0 broadcasts each batch so that each rank takes its own prompt shards.

Nothing waits forever: every wait polls the workers and stops, after ``dist.timeout_minutes``, with an error that
names the worker, its device and its exit code (``WorkerFailure``); a worker on another node that stops beating its
heartbeat is failed the same way. A checkpoint holds the batches already requested and not yet trained, with their
versions and data positions, so that a resumed run repeats and skips nothing (``pending_state``).
"""

from __future__ import annotations

import os
import time

import torch

from bicc.machine import distributed
from bicc.machine.distributed import DTYPES
from bicc.machine.host import set_torch_threads
from bicc.machine.layout import transport, worker_places
from bicc.rollout import ENGINES, weight_sync
from bicc.rollout.collect import DataCursor, Rollout, merge_shards
from bicc.rollout.line import Answer, Line, WorkerFailure

__all__ = ["RolloutWorkers", "WorkerFailure", "check_staleness", "fresh_pending", "merge_cursors"]


def check_staleness(ro: Rollout, step: int, async_steps: int) -> dict:
    """The batch trained at ``step`` must be drawn by weights at most ``async_steps`` versions old (0: the step's
    own); else it never reaches the loss. Returns ``rollout/staleness_*``."""
    staleness = step - ro.version
    if not 0 <= staleness <= async_steps:
        raise WorkerFailure(f"step {step}: its batch was sampled by weight version {ro.version}, {staleness} steps old, "
                            f"but rollout.async_steps={async_steps} allows at most {async_steps} (a weight push was "
                            "skipped or a batch replayed)")
    return {"rollout/staleness_mean": float(staleness), "rollout/staleness_max": float(staleness),
            "rollout/weight_version": float(ro.version)}


class RolloutWorkers:
    """The trainer's handle on the workers: ``start``, ``push`` weights, ``request`` and ``take`` batches,
    ``pending_state`` for checkpoints, ``close``."""

    def __init__(self, cfg, model_path: str, cursor: DataCursor, d=distributed.Dist(), max_model_len=None,
                 pending: dict | None = None, cuda: bool | None = None, end_ids=(), store=None, stop=None):
        from omegaconf import OmegaConf

        self.N, self.d, self.cfg = cfg.rollout.async_steps, d, cfg
        self.group_size = cfg.rollout.group_size
        self.num_shards = distributed.num_shards(cfg.rollout, d)
        self.local = list(distributed.local_shards(cfg.rollout, d))
        self.dtype = DTYPES[cfg.model.dtype]
        self.line = Line(cfg.dist.timeout_minutes * 60)
        # the store rank 0 serves (None: served at start), and what stops the wait for the workers' start
        # (``bicc.machine.preemption.Preemption.stop_waiting``: a signal before the first step)
        self.store, self.stop = store, stop
        self.start_s = cfg.rollout.worker_start_minutes * 60
        self.busy: list[tuple[float, float]] = []  # the trainer's update intervals (time.monotonic)
        self.push_s, self.push_bytes = 0.0, 0
        self.group = self.transfer = None
        pending = pending or {"batches": [], "cursor": {"pos": cursor.pos, "shard_pos": list(cursor.shard_pos)}}
        self.dropped = len(pending["batches"])
        pending = fresh_pending(pending, self.N)
        self.dropped -= len(pending["batches"])
        for entry in pending["batches"]:
            self.line.batches[entry["step"]] = {0: Answer(entry["shards"], entry["cursors"])}
        self.next_request = max(self.line.batches, default=-1) + 1
        self.first_cursor = pending["cursor"]
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.kind = None
        if not d.is_main:
            return
        self.places = worker_places(cfg.rollout, d.world, self.cuda, device_count=torch.cuda.device_count())
        self.workers = len(self.places) + cfg.rollout.remote_workers
        if not self.workers:
            raise ValueError("rollout.async_steps: no rollout worker: list rollout.devices or set rollout.remote_workers")
        self.kind = transport(ENGINES.get(cfg.rollout.engine).weight_route, self.cuda, self.places)
        self.affinity, self.threads = os.sched_getaffinity(0), torch.get_num_threads()  # restored by close
        taken = {c for p in self.places for c in (p.cores or ())}
        rest = sorted(set(self.affinity) - taken)
        if taken and rest:  # the trainer keeps the other cores; a one-core machine shares its core
            os.sched_setaffinity(0, rest)
            set_torch_threads(min(torch.get_num_threads(), len(rest)))
        plain = OmegaConf.to_container(cfg, resolve=True)
        self.specs = []
        for i in range(self.workers):
            place = self.places[i] if i < len(self.places) else None
            self.specs.append({"index": i, "cfg": plain, "model_path": model_path, "end_ids": list(end_ids),
                               "device": "cuda" if self.cuda else "cpu", "cores": list(place.cores or ()) if place else [],
                               "shares_gpu": bool(place and place.shares),
                               "shards": [s for s in range(self.num_shards) if s % self.workers == i],
                               "num_shards": self.num_shards, "cursor": pending["cursor"], "max_model_len": max_model_len,
                               "world": self.workers + 1, "transport": self.kind, "timeout_s": self.line.timeout})

    def start(self, model, step: int) -> None:
        """Start the workers (rank 0) and join their weight group, push ``model``'s weights as version ``step`` and
        request the batches up to ``step + N``. Every rank calls it."""
        self.entries = weight_sync.manifest(model)
        self.capacity = weight_sync.bucket_elems(self.cfg.rollout.push_bucket_mib, self.dtype, self.entries)
        self.buckets = weight_sync.plan(self.entries, self.capacity)
        self.kind = distributed.broadcast_object(self.kind, self.d)
        if self.d.is_main:
            entries = [[e.name, list(e.shape)] for e in self.entries]
            for spec in self.specs:
                spec.update(entries=entries, bucket_elems=self.capacity)
            self.line.launch(self.specs, [p.label for p in self.places], [p.visible for p in self.places],
                             self.cfg.rollout.worker_port or 0, self.store, self.start_s, self.stop)
            if self.kind != "vllm":  # the weight group: trainer rank 0 is 0, worker i is i + 1
                self.group = weight_sync.weight_group(self.line.store, 0, self.workers + 1, self.kind, self.line.timeout)
            self.line.wait(lambda: self.line.all("ready"), "the workers start", self.start_s, self.stop)
        if self.kind == "vllm":
            from bicc.rollout.vllm_transfer import trainer_engine

            self.transfer = trainer_engine(self, model, self.d)
        self.push(model, step)
        for future in range(max(self.next_request, step), step + self.N + 1):
            self.request(future)

    def push(self, model, version: int) -> None:
        """Send ``model``'s weights as ``version``; every rank calls it (FSDP2 gathers each tensor on all)."""
        t0, self.line.pushed = time.monotonic(), version
        if torch.cuda.is_available():  # the optimizer step's kernels are done before any gather, which vLLM's
            torch.cuda.current_stream().synchronize()  # transfer runs on side streams of its own (every rank gathers)
        if self.transfer is not None:
            if self.d.is_main:
                self.transfer.client.version = version
                for link in self.line.links:
                    link.pending.append(f"loading weight version {version}")
                with self.line.guard(f"sending weight version {version}", self.abort):
                    self.transfer.send_weights()
            else:
                self.transfer.send_weights()
        elif self.d.is_main:
            self.line.send("weights", f"loading weight version {version}", version=version)
            self.line.wait(lambda: self.line.all("receiving", version), f"sending weight version {version}")
            device = next(model.parameters()).device if self.kind == "nccl" else torch.device("cpu")
            with self.line.guard(f"sending weight version {version}", self.abort):
                weight_sync.send(model, self.entries, self.buckets, self.group, self.dtype, device, self.capacity)
        elif distributed.is_sharded(model):  # the gathers are collectives of every rank
            weight_sync.send(model, self.entries, self.buckets, None, self.dtype, None, self.capacity)
        # what each worker received (logged the same on every rank)
        self.push_s, self.push_bytes = time.monotonic() - t0, sum(e.numel for e in self.entries) * self.dtype.itemsize

    def abort(self) -> None:
        """Tear down the push's communicator (a worker died: its collective would wait for ever), so that a call
        blocked in it returns with an error: vLLM's NCCL group (``ncclCommAbort``), or the weight group's."""
        if self.transfer is not None and getattr(self.transfer, "model_update_group", None) is not None:
            self.transfer.model_update_group.destroy()
        elif self.group is not None:
            self.group.abort()

    def request(self, step: int) -> None:
        if self.d.is_main:
            self.line.send("sample", f"sampling step {step}", step=step)
        self.next_request = step + 1

    def take(self, step: int, busy_since: float | None = None) -> tuple[Rollout, dict]:
        """This rank's shards of batch ``step``, and the waits, overlap and last push it measured."""
        t0 = time.monotonic()
        if self.d.is_main:
            self.line.wait(lambda: self._drawn(step), f"sampling step {step}")
        answers = self.line.batches.pop(step, {}) if self.d.is_main else {}
        shards = {s: r for a in answers.values() for s, r in a.shards.items()}
        windows = [a.window for a in answers.values() if a.window is not None]
        idle = max((a.idle for a in answers.values()), default=0.0)
        shards, windows, idle = distributed.broadcast_object((shards, windows, idle), self.d)
        waited = time.monotonic() - t0
        ro = merge_shards([Rollout.from_plain(shards[s]) for s in self.local], self.group_size)
        overlap = max((sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in self.busy) for w0, w1 in windows), default=0.0)
        self.busy = self.busy[-2 * (self.N + 1):]
        metrics = {"perf/trainer_wait_s": waited, "perf/worker_wait_s": idle, "perf/overlap_s": overlap,
                   "perf/push_s": self.push_s, "perf/push_bytes": float(self.push_bytes)}
        if self.dropped:  # once, on the first step after a resume that dropped them
            metrics["rollout/stale_dropped"], self.dropped = float(self.dropped), 0
        return ro, metrics

    def mark_busy(self, start: float, end: float) -> None:
        """The trainer worked (log-probs, update, push) from ``start`` to ``end`` (time.monotonic)."""
        self.busy.append((start, end))

    def pending_state(self, step: int) -> dict:
        """The requested batches a checkpoint after ``step - 1`` must hold (steps ``step .. step + N - 1``, each
        waited for), with the data position after the last of them; rank 0's is the one that is written."""
        if not self.d.is_main:
            return {}
        batches = []
        for s in range(step, step + self.N):
            self.line.wait(lambda: self._drawn(s), f"sampling step {s} for a checkpoint")
            answers = self.line.batches[s]
            batches.append({"step": s, "shards": {k: v for a in answers.values() for k, v in a.shards.items()},
                            "cursors": merge_cursors([answers[i].cursors for i in sorted(answers)],
                                                     [self.specs[i] for i in sorted(answers)])})
        cursor = batches[-1]["cursors"]["after"] if batches else self.first_cursor
        return {"batches": batches, "cursor": cursor}

    def close(self, kill: bool = False) -> None:
        """Stop the workers: asked to (waiting up to 10 s for each this node started), or at once (``kill``)."""
        self.line.close(kill)
        if self.transfer is not None and self.d.is_main:  # vLLM's NCCL group is aborted, not left to its peers
            self.transfer.shutdown()
        self.group = self.transfer = None
        if self.d.is_main and hasattr(self, "affinity"):  # the trainer's cores and threads as they were
            os.sched_setaffinity(0, self.affinity)
            set_torch_threads(self.threads)

    @property
    def procs(self) -> list:
        """The worker processes this node started."""
        return [link.proc for link in self.line.links if link.proc is not None]

    def _drawn(self, step: int) -> bool:
        answers = self.line.batches.get(step, {})
        restored = 0 in answers and answers[0].window is None  # read back from a checkpoint: one answer
        return len(answers) == len(self.line.links) or restored


def fresh_pending(pending: dict, async_steps: int) -> dict:
    """The drawn batches a checkpoint held that a run with ``async_steps`` may train (a resume with fewer
    async steps than the run that wrote it drops the batches that became too old, and the ones after them), with
    the data position to draw on from: nothing is skipped and nothing trained twice."""
    kept = []
    for entry in pending["batches"]:
        version = min(int(r["version"]) for r in entry["shards"].values())
        if entry["step"] - version > async_steps:
            return {"batches": kept, "cursor": entry["cursors"]["before"]}
        kept.append(entry)
    return {"batches": kept, "cursor": pending["cursor"]}


def merge_cursors(cursors: list[dict], specs: list[dict]) -> dict:
    """The data position before and after a batch, each shard's read from the worker that collects it (``cursors``
    and ``specs`` in the same order)."""
    merged = {}
    for when in ("before", "after"):
        pos = cursors[0][when]["pos"]
        shard_pos = list(cursors[0][when]["shard_pos"])
        for c, spec in zip(cursors, specs):
            for s in spec["shards"]:
                if s < len(c[when]["shard_pos"]):
                    shard_pos[s] = c[when]["shard_pos"][s]
        merged[when] = {"pos": pos, "shard_pos": shard_pos}
    return merged
