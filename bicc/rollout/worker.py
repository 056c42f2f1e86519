"""One rollout worker: a process of its own that samples whole RL batches with a registered engine while the
trainer updates (``rollout.async_steps``; the trainer's side is ``bicc.rollout.workers``).

It holds its own copy of the policy and reads, in order, the messages the trainer sends:

- ``("weights", version, slot)``: copy the weights in shared-memory slot ``slot`` into its copy, hand them to the
  engine (which drops every cache of older weights), answer ``("loaded", worker, version, slot)``;
- ``("sample", step)``: collect step ``step``'s batch for its prompt shards exactly as the synchronous step does
  (same seed, same data position, same rewards), each shard's rollout stamped with the version that drew it, and
  answer ``("batch", worker, step, {shard: rollout} saved by ``torch.save``, cursors, (start, end), idle_s)``;
- ``("stop",)``.

A worker whose trainer has died (its parent process is gone: a SIGKILL gives it no word) ends by itself.

Messages are served in the order sent, so the weights a batch is drawn with are the last ones sent before its
request. It owns the data cursor of its shards from the start position it is given. Any exception is sent as
``("error", worker, traceback)`` before the process exits with code 1.
"""

from __future__ import annotations

import copy
import io
import os
import queue
import time
import traceback
from dataclasses import dataclass, field

# A planted fault, for the tests of what the trainer does when a worker fails: "<event>:<at>:<how>", the event
# "sample" (at a step) or "load" (at a weight version), how "exit" (code 3) or "hang".
FAULT_ENV = "BICC_WORKER_FAULT"


@dataclass
class WorkerSpec:
    """What a worker is started with. cfg: the run's config as a plain dict; model_path: an HF dir or id with
    the policy's architecture and tokenizer (its weights are replaced by the first push); device: "cpu" or a
    CUDA id as a string; cores: the CPU cores it runs on (None: any); shards: the prompt shards it collects of
    ``num_shards``; cursor: where its shards' next problems are read; slots: the shared-memory weight buffers."""

    index: int
    cfg: dict
    model_path: str
    device: str
    cores: list | None
    shards: list
    num_shards: int
    cursor: dict
    max_model_len: int | None = None
    slots: list = field(default_factory=list)
    trainer_pid: int = 0  # the process that started it: when it is gone (killed), the worker ends too

    @property
    def name(self) -> str:
        where = f"CPU cores {self.cores}" if self.device == "cpu" else f"CUDA device {self.device}"
        return f"rollout worker {self.index} ({where})"


def planted_fault(event: str, at: int) -> None:
    plan = os.environ.get(FAULT_ENV, "")
    if plan and plan.split(":")[:2] == [event, str(at)]:
        if plan.split(":")[2] == "exit":
            os._exit(3)
        time.sleep(10**6)


def worker_main(spec: WorkerSpec, requests, results) -> None:
    try:
        serve(spec, requests, results)
    except BaseException:  # noqa: BLE001  (everything is reported to the trainer, then the process ends)
        results.put(("error", spec.index, traceback.format_exc()))
        results.close()
        results.join_thread()
        raise SystemExit(1)


def serve(spec: WorkerSpec, requests, results) -> None:
    if spec.device != "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.device  # before CUDA starts in this process
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from bicc.data import build_task
    from bicc.machine.host import steady_malloc
    from bicc.model.load import end_token_ids, load_policy
    from bicc.rollout import EngineOptions, build_engine, engine_rows
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout, step_seed

    hf_logging.disable_progress_bar()  # as train.py does
    steady_malloc()  # a fresh process: large tensors would be mapped and unmapped on every generate call
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(len(spec.cores))
    device = torch.device("cpu" if spec.device == "cpu" else "cuda:0")
    cfg = OmegaConf.create(spec.cfg)
    model, tokenizer = load_policy(spec.model_path, cfg.model, device, cfg.train.logprob_chunk_tokens)
    model.requires_grad_(False)
    options = EngineOptions(end_ids=tuple(end_token_ids(tokenizer, model)), max_model_len=spec.max_model_len,
                            dtype=cfg.model.dtype, rows=engine_rows(cfg.rollout, cfg.eval, spec.num_shards), logprobs=True)
    engine = build_engine(cfg.rollout.engine, model, tokenizer, cfg.rollout, options)
    task, collection = build_task(cfg.data), Collection.from_config(cfg)
    cursor = DataCursor(spec.cursor["pos"], list(spec.cursor["shard_pos"]))
    weights = model.state_dict()
    results.put(("ready", spec.index, os.getpid()))
    idle_since = time.monotonic()
    while True:
        try:
            message = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != spec.trainer_pid:  # the trainer died without a word (SIGKILL): nothing more will come
                return
            continue
        idle = time.monotonic() - idle_since
        if message[0] == "stop":
            engine.close()
            return
        if message[0] == "weights":
            _, version, slot = message
            planted_fault("load", version)
            with torch.no_grad():
                for name, tensor in weights.items():
                    tensor.copy_(spec.slots[slot][name])
            engine.update_weights(model, version)
            results.put(("loaded", spec.index, version, slot))
        elif message[0] == "sample":
            step = message[1]
            planted_fault("sample", step)
            before = copy.deepcopy(cursor)
            start = time.monotonic()
            parts = {shard: collect_rollout(engine, tokenizer, task, collection, cursor, step_seed(cfg.seed, step),
                                            (shard,), spec.num_shards).to_plain() for shard in spec.shards}
            cursors = {"before": vars(before), "after": vars(copy.deepcopy(cursor))}
            buffer = io.BytesIO()  # by value: a tensor shared by file descriptor dies with a worker that exits
            torch.save(parts, buffer)
            results.put(("batch", spec.index, step, buffer.getvalue(), cursors, (start, time.monotonic()), idle))
        idle_since = time.monotonic()
