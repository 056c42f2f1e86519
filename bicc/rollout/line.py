"""Trainer rank 0's line to its rollout workers: the processes it starts, the store every worker joins, the messages
each way (``bicc.rollout.channel``), and the waits, each of which stops with an error naming the worker when one
fails. What is asked when, and the weights, are ``bicc.rollout.workers``' business.

A worker of this node is started as ``python -m bicc.rollout.worker --connect 127.0.0.1:<port> --index i`` with the
trainer's environment less torchrun's variables and with ``CUDA_VISIBLE_DEVICES`` naming its GPU. One elsewhere joins
by itself and gets the next index. A worker here that exits is seen at once (its exit code); one elsewhere by its
heartbeat stopping (``HEARTBEAT_LAPSE_S``); either that stays silent past ``dist.timeout_minutes`` by the timeout.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from bicc.machine.preemption import REQUEUE_EXIT, Preempted
from bicc.rollout import channel
from bicc.rollout.channel import POLL_S

HEARTBEAT_LAPSE_S = 60.0  # a worker on another node whose heartbeat stops this long is failed
GUARD_POLL_S = 0.2  # how often a push's guard looks at the workers
# torchrun's variables: a worker is no rank of the trainer's group (vLLM would read LOCAL_RANK as its GPU)
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class WorkerFailure(RuntimeError):
    """A rollout worker died, reported an error, or did not answer in time."""


@dataclass
class Answer:
    """A worker's batch: its prompt shards (plain rollouts), data positions, when it was drawn (None: read back from
    a checkpoint) and how long the worker waited for the request."""

    shards: dict
    cursors: dict
    window: list | None = None
    idle: float = 0.0


@dataclass
class Link:
    """The line to worker ``index``: its name, its process (None: started elsewhere) and both channels."""

    index: int
    name: str
    proc: subprocess.Popen | None
    inbox: channel.Channel  # to the worker
    outbox: channel.Channel  # from it
    beats: int = 0
    beat_seen: float = 0.0
    connect_host: str = "127.0.0.1"  # the trainer's host as the worker reached it
    pending: list = field(default_factory=list)  # what it was asked and has not answered yet, oldest first
    loaded: int | None = None  # the last weight version it loaded
    doing: str = "starting its process"  # what it last said it is doing, until it is ready
    ready: bool = False
    joined: float | None = None  # when it said hello (time.monotonic)


class Line:
    """The workers' processes and messages: ``launch``, ``send``, ``wait``, ``close``; what they answered is kept in
    ``batches`` (step -> worker -> ``Answer``) and ``acks`` ((kind, version or call) -> workers)."""

    def __init__(self, timeout_s: float):
        self.timeout = timeout_s
        self.links: list[Link] = []
        self.store = None
        self.batches: dict[int, dict[int, Answer]] = {}
        self.acks: dict[tuple, set] = {}
        self.pushed = None  # the weight version being or last sent

    def launch(self, specs: list[dict], labels: list[str], visible: list[str | None], port: int, store=None,
               start_s: float | None = None, stop=None) -> None:
        """Serve the store on ``port`` (0: a free one; ``store``: one served already, at the run's start, which workers
        from elsewhere may have joined), write each worker's spec, start this node's workers (one per label, on
        ``visible``'s GPU), and wait until every worker, those from elsewhere too, has said hello (within
        ``start_s``; ``stop``: as ``wait``'s)."""
        self.store = store if store is not None else channel.serve(port, self.timeout)
        for spec in specs:
            self.store.set(f"line/spec/{spec['index']}", json.dumps(spec))
        self.store.set("line/local_workers", str(len(labels)))
        env = worker_env(os.environ)
        for i, (label, gpu) in enumerate(zip(labels, visible)):
            cmd = [sys.executable, "-m", "bicc.rollout.worker", "--connect", f"127.0.0.1:{self.store.port}",
                   "--index", str(i), "--parent-pid", str(os.getpid())]
            proc = subprocess.Popen(cmd, env={**env, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})})
            self._add(i, f"rollout worker {i} ({label})", proc)
        for i in range(len(labels), len(specs)):
            self._add(i, f"rollout worker {i} (joining from elsewhere)", None)
        if len(specs) > len(labels):
            print(f"[rollout] waiting for {len(specs) - len(labels)} worker(s) from other nodes: "
                  f"python -m bicc.rollout.worker --connect <this host>:{self.store.port}")
        self.wait(lambda: self.all("hello"), "starting", start_s, stop)

    def send(self, kind: str, doing: str | None = None, **fields) -> None:
        """``kind`` to every worker; ``doing``: what answering it is, until it is answered (for error messages)."""
        for link in self.links:
            link.inbox.send(kind, **fields)
            if doing:
                link.pending.append(doing)

    def all(self, kind: str, key=None) -> bool:
        return len(self.acks.get((kind, key), ())) == len(self.links)

    def wait(self, done, what: str, timeout_s: float | None = None, stop=None) -> None:
        """Read answers until ``done()``; a worker that exits, reports an error, stops beating or stays silent past
        ``timeout_s`` (the workers' start: ``rollout.worker_start_minutes``; default the line's,
        ``dist.timeout_minutes``) stops the run with an error naming it and
        what it was doing, the stacks of those on this node printed first. ``stop``: called while waiting, an
        exception to raise instead of waiting on (a preemption before the first step: nothing to save)."""
        setting = "dist.timeout_minutes" if timeout_s is None else "rollout.worker_start_minutes"
        timeout_s = self.timeout if timeout_s is None else timeout_s
        deadline, pause = time.monotonic() + timeout_s, 0.001
        while not done():
            got = False
            for link in self.links:
                message = link.outbox.poll()
                if message is not None:
                    self._record(message, link, what)
                    got = True
            if got:
                pause = 0.001
                continue
            reason = stop() if stop is not None else None
            if reason is not None:  # nothing to save: the run stops here, saying where it waited
                states = "; ".join(f"{link.name}, pid {link.proc.pid if link.proc else '?'}: {doing(link, what)}"
                                   for link in self.links)
                self.close(kill=True)
                raise Preempted(f"[rl] preempted ({reason}) while {what} ({states}); no step was trained in this "
                                f"process: exit {REQUEUE_EXIT}, resume=auto starts from the last checkpoint")
            self._check_alive(what)
            if time.monotonic() > deadline:
                silent = [f"{link.name}, pid {link.proc.pid if link.proc else '?'} (loaded weight version {link.loaded} "
                          f"of {self.pushed if self.pushed is not None else 'none yet'}), while "
                          f"{link.pending[0] if link.pending else link.doing if not link.ready else 'idle'}"
                          for link in self.links]
                self.print_stacks(self.links)
                self.close(kill=True)
                raise WorkerFailure(f"no answer from {'; '.join(silent)} within {timeout_s:g} s ({setting}) while "
                                    f"{what}; stopped it")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)

    def close(self, kill: bool = False) -> None:
        """Stop the workers: asked to (waiting up to 10 s for each this node started), or at once (``kill``)."""
        for link in self.links:
            if not kill:
                try:
                    link.inbox.send("stop")
                except Exception:  # noqa: BLE001  (a line already gone: the worker is ended below)
                    pass
        deadline = time.monotonic() + (0.5 if kill else 10)
        for link in self.links:
            if link.proc is not None:
                try:
                    link.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    link.proc.kill()
                    link.proc.wait()
            elif not kill:  # one elsewhere: until it has read the stop (else it finds the store gone first)
                while link.inbox.pending() and time.monotonic() < deadline:
                    time.sleep(0.05)
        self.links = []
        self.store = None  # the store's server goes with it: a worker elsewhere sees it gone and ends

    @contextmanager
    def guard(self, what: str, abort) -> Iterator[None]:
        """Around a call that cannot see the workers (a weight push: an NCCL broadcast waits for ever on a peer that
        died), a thread watches them: one that exits (this node's) or stops its heartbeat (another node's) has
        ``abort()`` called (the transport's communicator torn down, so that the blocked call returns) and the run
        stops with an error naming it. A call that fails by itself (gloo sees the peer's socket close) is named the
        same way."""
        links, stopped, failure = list(self.links), threading.Event(), []
        beats = channel.connect(f"127.0.0.1:{self.store.port}", 30) if any(k.proc is None for k in links) else None
        seen = {k.index: (k.beats, time.monotonic()) for k in links}

        def watch():
            while not stopped.wait(GUARD_POLL_S):
                culprit = dead(links, beats, seen)
                if culprit is not None:
                    failure.append(culprit)
                    abort()
                    return

        thread = threading.Thread(target=watch, name="bicc-push-guard", daemon=True)
        thread.start()
        try:
            yield
        except BaseException as err:
            stopped.set()
            thread.join()
            deadline = time.monotonic() + 5  # the transport may see a peer's socket close before its exit is reaped
            while not failure and time.monotonic() < deadline:
                culprit = dead(links, beats, seen)
                failure.extend([culprit] if culprit else [])
                time.sleep(0.05)
            if not failure:
                raise
            self.close(kill=True)
            raise WorkerFailure(f"{failure[0]} while {what}: the transfer was aborted ({type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''})") from err
        stopped.set()
        thread.join()
        if failure:  # the call returned although aborted
            self.close(kill=True)
            raise WorkerFailure(f"{failure[0]} while {what}: the transfer was aborted")

    def print_stacks(self, links: list[Link]) -> None:
        """Each of ``links`` started on this node prints its threads' stacks to the run's stderr (the worker's
        faulthandler on SIGUSR2), before it is stopped."""
        asked = [link for link in links if link.proc is not None and link.proc.poll() is None]
        for link in asked:
            print(f"[rollout] {link.name} is late: its stacks follow", file=sys.stderr, flush=True)
            try:
                os.kill(link.proc.pid, signal.SIGUSR2)
            except OSError:
                pass
        if asked:
            time.sleep(1.0)

    # ---- inside ---------------------------------------------------------------------------------
    def _add(self, i: int, name: str, proc) -> None:
        self.links.append(Link(i, name, proc, channel.to_worker(self.store, i), channel.from_worker(self.store, i)))

    def _check_alive(self, what: str) -> None:
        now = time.monotonic()
        for link in self.links:
            if link.proc is not None and link.proc.poll() is not None:
                code = link.proc.returncode
                self.close(kill=True)
                raise WorkerFailure(f"{link.name} exited with code {code} while {doing(link, what)}")
            # one elsewhere, once it has said hello: its beats, counted from then (one that dies before its first
            # beat is failed as one whose beats stop)
            if link.proc is None and link.joined is not None and now - link.beat_seen > 1.0 and self.store is not None:
                beats = self.store.add(f"line/beat/{link.index}", 0)
                if beats != link.beats or not link.beat_seen:
                    link.beats, link.beat_seen = beats, (now if beats else link.joined)
                elif now - link.beat_seen > HEARTBEAT_LAPSE_S:
                    self.close(kill=True)
                    raise WorkerFailure(f"{link.name} stopped its heartbeat {HEARTBEAT_LAPSE_S:g} s ago while "
                                        f"{doing(link, what)}" if beats else
                                        f"{link.name} said hello {now - link.joined:.0f} s ago and has not beaten its "
                                        f"heartbeat since (it beats every second), while {doing(link, what)}")

    def _record(self, message, link: Link, what: str) -> None:
        if message.kind == "error":
            if link.proc is not None:
                try:
                    link.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            code = link.proc.returncode if link.proc is not None else "unknown"
            trace = message["traceback"]
            self.close(kill=True)
            raise WorkerFailure(f"{link.name} failed while {doing(link, what)} (exit code {code}): "
                                f"{trace.strip().splitlines()[-1]}\n{trace}")
        if message.kind == "starting":
            link.doing = message["doing"]
            return
        if message.kind == "hello":
            link.connect_host, link.joined = message["connect"].rpartition(":")[0], time.monotonic()
            if link.proc is None:
                link.name = f"rollout worker {link.index} ({message['device']} on {message['host']})"
            print(f"[rollout] {link.name}: pid {message['pid']} on {message['host']}, {message['device']}")
        if message.kind in ("batch", "loaded"):
            answered = (f"sampling step {message['step']}" if message.kind == "batch"
                        else f"loading weight version {message['version']}")
            if answered in link.pending:
                link.pending.remove(answered)
        if message.kind == "loaded":
            link.loaded = message["version"]
        if message.kind == "ready":
            link.ready = True
        if message.kind == "batch":
            shards = torch.load(io.BytesIO(message.payload), weights_only=True)
            self.batches.setdefault(message["step"], {})[link.index] = Answer(
                {int(k): v for k, v in shards.items()}, message["cursors"], message["window"], message["idle"])
            return
        key = message.fields.get("version", message.fields.get("call"))
        self.acks.setdefault((message.kind, key), set()).add(link.index)


def dead(links: list[Link], beats, seen: dict) -> str | None:
    """The first of ``links`` that has exited (this node's) or whose heartbeat on ``beats`` (a store client of the
    caller's thread) has not moved for ``HEARTBEAT_LAPSE_S`` (``seen``: index -> (beats, when they last moved)), said
    as an error's opening; None while all live."""
    now = time.monotonic()
    for link in links:
        if link.proc is not None and link.proc.poll() is not None:
            return f"{link.name} exited with code {link.proc.returncode}"
        if link.proc is None and beats is not None:
            count = beats.add(f"line/beat/{link.index}", 0)
            if count != seen[link.index][0]:
                seen[link.index] = (count, now)
            elif now - seen[link.index][1] > HEARTBEAT_LAPSE_S:
                return f"{link.name} stopped its heartbeat {HEARTBEAT_LAPSE_S:g} s ago"
    return None


def doing(link: Link, what: str) -> str:
    """What a failed worker was doing (its oldest unanswered request, or before it was ready what it last said), and
    what the trainer was waiting for."""
    asked = link.pending[0] if link.pending else what if link.ready else link.doing
    return asked if asked == what else f"{asked} (the trainer was waiting for {what})"


def worker_env(environ) -> dict:
    """The environment a worker this node starts runs in: the trainer's, without torchrun's variables (it is no
    rank of the trainer's group), with the library importable whatever the working dir."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([root, *([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else [])])
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the store's socket warnings when the trainer is gone
    return env
