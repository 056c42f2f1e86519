"""Rollout workers seen from the trainer (``rollout.async_steps`` = N >= 1): worker processes
(``bicc.rollout.worker``) on their own devices sample the next batches while the trainer updates.

The schedule: before step t trains, batches t .. t+N have been requested; batch t+N+1 is requested right after
the weights of step t are pushed, so it is drawn by theta_{t+1} = the weights after step (t+N+1) - N. Batch t is
therefore drawn by theta_{t-N} (theta_0 for the first N steps) and never by older weights. Every rollout carries
the version that drew it and the trainer refuses one older than N (``check_staleness``).

Weights travel through shared memory: N + 1 slots, each a full copy of the policy's state dict; push v writes
slot v mod (N + 1) once every worker has said it loaded what that slot held before, and sends the slot's number.
Under torchrun rank 0 owns the workers: every rank joins the weight gathering, and rank 0 broadcasts each batch
so that each rank takes its own prompt shards.

Nothing waits forever: every wait polls the workers and stops, after ``dist.timeout_minutes``, with an error that
names the worker, its device and its exit code (``WorkerFailure``). A checkpoint holds the batches already
requested and not yet trained, with their versions and data positions, so that a resumed run repeats and skips
nothing (``pending_state``).
"""

from __future__ import annotations

import io
import os
import queue
import time

import torch

from bicc.machine import distributed
from bicc.machine.host import set_torch_threads
from bicc.rollout.collect import DataCursor, Rollout, merge_shards
from bicc.rollout.worker import WorkerSpec, worker_main


class WorkerFailure(RuntimeError):
    """A rollout worker died, reported an error, or did not answer in time."""


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


def worker_devices(rollout_cfg, d, cuda: bool) -> tuple[list[str], list[list[int] | None]]:
    """(device per worker, CPU cores per worker): ``rollout.devices`` as CUDA ids (one worker each) or as the cores
    of the one CPU worker; null picks the GPUs after the trainer's ranks, or the second half of this process's cores."""
    chosen = list(rollout_cfg.devices) if rollout_cfg.devices is not None else None
    if cuda:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", d.world))
        chosen = chosen if chosen is not None else list(range(local, torch.cuda.device_count()))
        if not chosen:
            raise ValueError(f"rollout.devices: no GPU is left for rollout workers ({torch.cuda.device_count()} GPUs, "
                             f"{local} training processes); run fewer training processes or list the workers' GPUs")
        return [str(c) for c in chosen], [None] * len(chosen)
    cores = sorted(os.sched_getaffinity(0))
    chosen = chosen if chosen is not None else cores[len(cores) // 2:]
    unknown = sorted(set(chosen) - set(cores))
    if unknown:
        raise ValueError(f"rollout.devices: cores {unknown} are not among this process's cores {cores}")
    return ["cpu"], [chosen]


class RolloutWorkers:
    """The trainer's handle on the workers: ``push`` weights, ``request`` and ``take`` batches, ``pending_state``
    for checkpoints, ``close``."""

    def __init__(self, cfg, model_path: str, cursor: DataCursor, d=distributed.Dist(), max_model_len=None,
                 pending: dict | None = None, cuda: bool | None = None):
        from omegaconf import OmegaConf

        self.N, self.d = cfg.rollout.async_steps, d
        self.group_size = cfg.rollout.group_size
        self.num_shards = distributed.num_shards(cfg.rollout, d)
        self.local = list(distributed.local_shards(cfg.rollout, d))
        self.timeout = cfg.dist.timeout_minutes * 60
        self.batches: dict[int, dict] = {}  # step -> the "batch" answers of every worker (rank 0)
        self.loaded: dict[int, set] = {}  # version -> the workers that loaded it
        self.slot_version: list = [None] * (self.N + 1)
        self.busy: list[tuple[float, float]] = []  # the trainer's update intervals (time.monotonic)
        self.procs, self.specs = [], []
        self.next_request = 0
        pending = pending or {"batches": [], "cursor": {"pos": cursor.pos, "shard_pos": list(cursor.shard_pos)}}
        self.dropped = len(pending["batches"])
        pending = fresh_pending(pending, self.N)
        self.dropped -= len(pending["batches"])
        for entry in pending["batches"]:
            self.batches[entry["step"]] = {0: ("batch", 0, entry["step"], entry["shards"], entry["cursors"], None, 0.0)}
        self.next_request = max(self.batches, default=-1) + 1
        if not d.is_main:
            return
        devices, cores = worker_devices(cfg.rollout, d, torch.cuda.is_available() if cuda is None else cuda)
        self.affinity, self.threads = os.sched_getaffinity(0), torch.get_num_threads()  # restored by close
        if devices == ["cpu"] and cores[0]:
            rest = sorted(set(os.sched_getaffinity(0)) - set(cores[0]))
            if rest:  # the trainer keeps the other cores; a one-core machine shares its core
                os.sched_setaffinity(0, rest)
                set_torch_threads(min(torch.get_num_threads(), len(rest)))
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests = [ctx.Queue() for _ in devices]
        self.results = ctx.Queue()
        self.slots = None
        plain = OmegaConf.to_container(cfg, resolve=True)
        for i, (device, worker_cores) in enumerate(zip(devices, cores)):
            shards = [s for s in range(self.num_shards) if s % len(devices) == i]
            self.specs.append(WorkerSpec(i, plain, model_path, device, worker_cores, shards, self.num_shards,
                                         pending["cursor"], max_model_len, trainer_pid=os.getpid()))
        self.first_cursor = pending["cursor"]

    def start(self, model, step: int) -> None:
        """Start the workers (rank 0) with ``model``'s weights as version ``step``, and request the batches up to
        ``step + N``."""
        weights = self._full_weights(model)
        if self.d.is_main:
            self.slots = [{k: torch.empty_like(v).share_memory_() for k, v in weights.items()} for _ in range(self.N + 1)]
            ctx = torch.multiprocessing.get_context("spawn")
            for spec, requests in zip(self.specs, self.requests):
                spec.slots = self.slots
                proc = ctx.Process(target=worker_main, args=(spec, requests, self.results), daemon=True,
                                   name=f"bicc-rollout-{spec.index}")
                proc.start()
                self.procs.append(proc)
            ready: set = set()
            self._wait(lambda: len(ready) == len(self.procs), "starting", on_ready=ready.add)
        self._push(weights, step)
        for future in range(max(self.next_request, step), step + self.N + 1):
            self.request(future)

    def push(self, model, version: int) -> None:
        """Send ``model``'s weights as ``version``; every rank calls it (FSDP2 gathers them)."""
        self._push(self._full_weights(model), version)

    def request(self, step: int) -> None:
        if self.d.is_main:
            for requests in self.requests:
                requests.put(("sample", step))
        self.next_request = step + 1

    def take(self, step: int, busy_since: float | None = None) -> tuple[Rollout, dict]:
        """This rank's shards of batch ``step``, and the waits and overlap it measured."""
        t0 = time.monotonic()
        if self.d.is_main:
            self._wait(lambda: len(self.batches.get(step, {})) == len(self.procs) or (step in self.batches and not self.procs)
                       or self._restored(step), f"sampling step {step}")
        answers = self.batches.pop(step, {}) if self.d.is_main else None
        shards = {s: r for a in (answers or {}).values() for s, r in a[3].items()}
        windows = [a[5] for a in (answers or {}).values() if a[5] is not None]
        idle = max((a[6] for a in (answers or {}).values()), default=0.0)
        shards, windows, idle = distributed.broadcast_object((shards, windows, idle), self.d)
        waited = time.monotonic() - t0
        ro = merge_shards([Rollout.from_plain(shards[s]) for s in self.local], self.group_size)
        overlap = max((sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in self.busy) for w0, w1 in windows), default=0.0)
        self.busy = self.busy[-2 * (self.N + 1):]
        metrics = {"perf/trainer_wait_s": waited, "perf/worker_wait_s": idle, "perf/overlap_s": overlap}
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
            self._wait(lambda: len(self.batches.get(s, {})) == len(self.procs) or self._restored(s),
                       f"sampling step {s} for a checkpoint")
            answers = self.batches[s]
            batches.append({"step": s, "shards": {k: v for a in answers.values() for k, v in a[3].items()},
                            "cursors": merge_cursors([a[4] for a in answers.values()], self.specs)})
        cursor = batches[-1]["cursors"]["after"] if batches else self.first_cursor
        return {"batches": batches, "cursor": cursor}

    def close(self, kill: bool = False) -> None:
        """Stop the workers: asked to (waiting up to 10 s each), or at once (``kill``: after a failure)."""
        for requests, proc in zip(getattr(self, "requests", []), self.procs):
            if proc.is_alive() and not kill:
                requests.put(("stop",))
        for proc in self.procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []
        if self.d.is_main:  # the trainer's cores and threads as they were (the final evaluation uses them all)
            os.sched_setaffinity(0, self.affinity)
            set_torch_threads(self.threads)

    # ---- inside ---------------------------------------------------------------------------------
    def _restored(self, step: int) -> bool:  # a batch read back from a checkpoint (one answer, marked worker 0)
        return step in self.batches and self.batches[step].get(0, (None,) * 6)[5] is None

    def _full_weights(self, model) -> dict:
        if distributed.is_sharded(model):
            return distributed.full_state_dict(model)
        return {k: v.detach() for k, v in model.state_dict().items()} if self.d.is_main else {}

    def _push(self, weights: dict, version: int) -> None:
        if not self.d.is_main:
            return
        slot = version % len(self.slots)
        previous = self.slot_version[slot]
        if previous is not None:  # every worker has read what the slot held
            self._wait(lambda: len(self.loaded.get(previous, ())) == len(self.procs), f"loading weight version {previous}")
        with torch.no_grad():
            for name, tensor in weights.items():
                self.slots[slot][name].copy_(tensor)
        self.slot_version[slot] = version
        for requests in self.requests:
            requests.put(("weights", version, slot))

    def _wait(self, done, what: str, on_ready=None) -> None:
        """Read answers until ``done()``; a worker that exits, reports an error or stays silent past the timeout
        stops the run with an error naming it."""
        deadline = time.monotonic() + self.timeout
        while not done():
            try:
                answer = self.results.get(timeout=0.1)
            except queue.Empty:
                answer = None
            if answer is not None:
                self._record(answer, what, on_ready)
                continue
            for spec, proc in zip(self.specs, self.procs):
                if not proc.is_alive():
                    self.close(kill=True)
                    raise WorkerFailure(f"{spec.name} exited with code {proc.exitcode} while {what}")
            if time.monotonic() > deadline:
                sent = max((v for v in self.slot_version if v is not None), default=None)
                silent = [f"{spec.name}, pid {proc.pid} (loaded weight version "
                          f"{max((v for v, ws in self.loaded.items() if spec.index in ws), default=None)} of {sent})"
                          for spec, proc in zip(self.specs, self.procs)]
                self.close(kill=True)
                raise WorkerFailure(f"no answer from {'; '.join(silent)} within {self.timeout:g} s "
                                    f"(dist.timeout_minutes) while {what}; stopped it")

    def _record(self, answer, what: str, on_ready) -> None:
        kind, worker = answer[0], answer[1]
        if kind == "error":
            spec, proc = self.specs[worker], self.procs[worker]
            proc.join(timeout=30)
            tail = answer[2].strip().splitlines()[-1]
            self.close(kill=True)
            raise WorkerFailure(f"{spec.name} failed while {what} (exit code {proc.exitcode}): {tail}\n{answer[2]}")
        if kind == "ready":
            on_ready(worker)
        elif kind == "loaded":
            self.loaded.setdefault(answer[2], set()).add(worker)
        elif kind == "batch":
            shards = torch.load(io.BytesIO(answer[3]), weights_only=True)
            self.batches.setdefault(answer[2], {})[worker] = (*answer[:3], shards, *answer[4:])


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


def merge_cursors(cursors: list[dict], specs: list[WorkerSpec]) -> dict:
    """The data position before and after a batch, each shard's read from the worker that collects it."""
    merged = {}
    for when in ("before", "after"):
        pos = cursors[0][when]["pos"]
        shard_pos = list(cursors[0][when]["shard_pos"])
        for c, spec in zip(cursors, specs):
            for s in spec.shards:
                if s < len(c[when]["shard_pos"]):
                    shard_pos[s] = c[when]["shard_pos"][s]
        merged[when] = {"pos": pos, "shard_pos": shard_pos}
    return merged
