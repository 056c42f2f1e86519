"""One rollout worker: a process of its own that samples whole RL batches with a registered engine while the
trainer updates (``rollout.async_steps``; the trainer's side is ``bicc.rollout.workers``). Trainer rank 0 starts
the workers on its node; one on another node is started by hand or by Slurm (docs/slurm/train_async.sbatch):

    python -m bicc.rollout.worker --connect <trainer host>:<rollout.worker_port>

It joins the trainer's rollout store (``bicc.rollout.channel``), reads the spec the trainer wrote for it (its
config, prompt shards, data position and the weights it will be sent), builds its engine (an HF module in the
compute dtype, or a vLLM engine with no HF copy of the policy beside it) and joins the weight push's process group
(``bicc.rollout.weight_sync``; vLLM on CUDA: vLLM's weight transfer). Then it serves, in order, what the trainer
sends:

- ``weights`` (version): answer ``receiving``, take the push into the engine (which drops every cache of older
  weights), answer ``loaded``;
- ``sample`` (step): collect step ``step``'s batch for its prompt shards exactly as the synchronous step does (same
  seed, data position and rewards, math-verify's processes included), each shard stamped with the version that drew
  it, and answer ``batch``;
- ``transfer`` (vLLM on CUDA): one call of vLLM's weight-transfer protocol, answered ``done``;
- ``stop``.

Messages are served in the order sent, so the weights a batch is drawn with are the last ones sent before its
request. Any exception is sent as ``error`` with its traceback before the process exits with code 1.

It never outlives its trainer: a thread checks the store every second and ends the process (``os._exit``) as soon
as the store is gone, whatever the main thread is blocked in (a generate call, a receive, a send); a worker
started by the trainer also has the kernel kill it with its parent (``die_with_parent``), and math-verify's
processes die with it the same way.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import io
import json
import os
import signal
import socket
import threading
import time
import traceback

# A planted fault, for the tests of what the trainer does when a worker fails: "<event>:<at>:<how>", the event
# "sample" (at a step), "load" (at a weight version, before it is received) or "push" (in the middle of receiving
# it: after its first tensor), how "exit" (code 3), "kill" (SIGKILL) or "hang".
FAULT_ENV = "BICC_WORKER_FAULT"
WATCH_S = 1.0  # how often a worker checks that its trainer's store is there (and beats its heartbeat)


def planted_fault(event: str, at: int) -> None:
    plan = os.environ.get(FAULT_ENV, "")
    if plan and plan.split(":")[:2] == [event, str(at)]:
        how = plan.split(":")[2]
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10**6)


def planted_after_first(items, event: str, at: int):
    """``items``, with ``planted_fault(event, at)`` once the first has been taken."""
    for i, item in enumerate(items):
        yield item
        if i == 0:
            planted_fault(event, at)


def watch_trainer(address: str, index: int, timeout_s: float) -> None:
    """Beat ``line/beat/<index>`` every ``WATCH_S`` on a store client of its own; when the store cannot be reached
    (its trainer is gone) end the process at once."""
    from bicc.rollout.channel import connect

    def watch():
        try:
            store = connect(address, timeout_s)
            while True:
                store.add(f"line/beat/{index}", 1)
                time.sleep(WATCH_S)
        except Exception:  # noqa: BLE001  (any failure to reach the store: the trainer is gone)
            os._exit(0)

    threading.Thread(target=watch, name="bicc-watch-trainer", daemon=True).start()


STATUS_EVERY_S = 60.0  # how often a worker waiting for its trainer says what the trainer is doing


def wait_for_key(store, key: str, address: str) -> bytes:
    """``key``'s value once the trainer has set it, waiting as long as the trainer's store is there (its start may
    take long: a model load, the first evaluation); every ``STATUS_EVERY_S`` the wait prints what the trainer is
    doing (``line/status``). A store that is gone raises (``DistNetworkError``): the trainer has ended."""
    start = last = time.monotonic()
    while not store.check([key]):
        if time.monotonic() - last >= STATUS_EVERY_S:
            last = time.monotonic()
            status = store.get("line/status").decode() if store.check(["line/status"]) else "starting"
            print(f"[rollout worker] waiting for the trainer at {address} for {last - start:.0f} s: it is {status}",
                  flush=True)
        time.sleep(0.2)
    return store.get(key)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A rollout worker of a run with rollout.async_steps >= 1.")
    parser.add_argument("--connect", required=True, help="host:port of the trainer's rollout store "
                        "(rank 0's host and rollout.worker_port)")
    parser.add_argument("--index", type=int, default=None, help="set by the trainer for the workers it starts")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long to wait for the trainer's store "
                        "to answer (it serves it as soon as it starts; after that the worker waits as long as the "
                        "trainer is there: its model load and first evaluation may take long)")
    parser.add_argument("--parent-pid", type=int, default=None, help="set by the trainer for the workers it starts")
    args = parser.parse_args(argv)
    from bicc.machine.host import die_with_parent
    from bicc.machine.preemption import ignore_preemption

    ignore_preemption()  # the trainer saves and stops on SIGTERM / SIGUSR1 and then ends its workers
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the trainer asks for the stacks of one that is late
    if args.index is not None and die_with_parent() and args.parent_pid not in (None, os.getppid()):
        os._exit(0)  # started by a trainer that died before the kernel was asked to end this process with it
    import torch.distributed

    from bicc.rollout.channel import connect, from_worker, to_worker

    store = connect(args.connect, args.timeout_s)
    index = args.index
    if index is None:  # joined from elsewhere: after the trainer's own workers, in the order they join
        index = int(wait_for_key(store, "line/local_workers", args.connect)) + store.add("line/remote_joined", 1) - 1
    spec = {**json.loads(wait_for_key(store, f"line/spec/{index}", args.connect)), "connect": args.connect}
    watch_trainer(args.connect, index, spec["timeout_s"])
    outbox = from_worker(store, index)
    try:
        serve(spec, to_worker(store, index), outbox, store)
    except torch.distributed.DistNetworkError:  # the trainer's store is gone: the run ended, the trainer says how
        print(f"[rollout worker {index}] the trainer is gone; ending", flush=True)
        os._exit(0)
    except BaseException:  # noqa: BLE001  (everything is reported to the trainer, then the process ends)
        try:
            outbox.send("error", traceback=traceback.format_exc())
        finally:
            os._exit(1)
    os._exit(0)  # nothing left to flush; vLLM's and gloo's teardown at exit only costs time


def build_sampler(spec: dict, rollout, model_cfg, eval_cfg, device):
    """(engine, tokenizer, the tensors a push fills in place or None): an HF module in the compute dtype, or a vLLM
    engine with no HF module at all. Both start from the initial policy's files; the first push brings the weights
    of the step. (vLLM's dummy weights would save that read, but its dummy loader also randomises buffers that are
    no weight of the HF model, such as the rotary cache, and no push restores those.)"""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from bicc.model.load import end_token_ids, load_pretrained, load_tokenizer
    from bicc.rollout import ENGINES, EngineOptions, build_engine, engine_rows
    from bicc.rollout.weight_sync import tensors_of

    rollout_cfg = worker_rollout(rollout, spec)
    options = EngineOptions(end_ids=tuple(spec["end_ids"]), max_model_len=spec["max_model_len"], dtype=model_cfg.dtype,
                            rows=engine_rows(rollout, eval_cfg, spec["num_shards"]), logprobs=True,
                            weight_transfer="nccl" if spec["transport"] == "vllm" else None)
    if not ENGINES.get(rollout.engine).samples_from_module:  # it loads its own weights from the files
        model = ModelRef(spec["model_path"], AutoConfig.from_pretrained(spec["model_path"]))
        tokenizer, into = load_tokenizer(spec["model_path"]), None
    else:
        model, tokenizer = load_pretrained(spec["model_path"], model_cfg, device)
        model.requires_grad_(False)
        into = tensors_of(model)
    if not options.end_ids:  # the trainer names them; else the model's own (its generation config, or its config)
        options = dataclasses.replace(options, end_ids=tuple(end_token_ids(tokenizer, getattr(model, "generation_config",
                                                                                              model.config))))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return build_engine(rollout.engine, model, tokenizer, rollout_cfg, options), tokenizer, into


def worker_rollout(rollout, spec: dict):
    """The rollout settings a worker's engine runs with: no sleep (the device is the worker's: nothing to free while
    the trainer updates) and, alone on its GPU, ``rollout.vllm.worker_gpu_memory_utilization`` of it (its KV cache and
    batch take what a colocated engine leaves to training)."""
    rollout_cfg = copy.deepcopy(rollout)
    rollout_cfg.vllm.sleep = False
    if spec["device"] == "cuda" and not spec["shares_gpu"]:
        rollout_cfg.vllm.gpu_memory_utilization = rollout.vllm.worker_gpu_memory_utilization
    return rollout_cfg


class ModelRef:
    """What a vLLM engine reads of the policy when there is no HF module: its dir and config."""

    def __init__(self, path: str, config):
        self.name_or_path, self.config = path, config


def serve(spec: dict, inbox, outbox, store) -> None:
    import torch
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from bicc.data import build_task
    from bicc.machine.distributed import DTYPES
    from bicc.machine.host import set_torch_threads, steady_malloc
    from bicc.rollout.collect import Collection, DataCursor, collect_rollout, step_seed
    from bicc.rollout.weight_sync import Entry, plan, receive, weight_group

    hf_logging.disable_progress_bar()  # as train.py does
    steady_malloc()  # a fresh process: large tensors would be mapped and unmapped on every generate call
    if spec["cores"]:
        os.sched_setaffinity(0, spec["cores"])
        set_torch_threads(len(spec["cores"]))
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    outbox.send("hello", pid=os.getpid(), host=socket.gethostname(), connect=spec["connect"],
                device=torch.cuda.get_device_name(0) if cuda else "cpu")
    group = None
    if spec["transport"] != "vllm":  # joined first, so that the trainer's side never waits on an engine's start
        outbox.send("starting", doing="joining the weight push's process group")
        group = weight_group(store, spec["index"] + 1, spec["world"], spec["transport"], spec["timeout_s"])
    cfg = OmegaConf.create(spec["cfg"])
    outbox.send("starting", doing=f"loading the policy and building its {cfg.rollout.engine} engine")
    engine, tokenizer, into = build_sampler(spec, cfg.rollout, cfg.model, cfg.eval, device)
    outbox.send("starting", doing="building the task (data.reward's check on a sample)")
    task, collection = build_task(cfg.data), Collection.of(cfg.algo, cfg.rollout, cfg.data)
    cursor = DataCursor(spec["cursor"]["pos"], list(spec["cursor"]["shard_pos"]))
    entries = [Entry(name, tuple(shape)) for name, shape in spec["entries"]]
    dtype, capacity = DTYPES[cfg.model.dtype], spec["bucket_elems"]
    buckets = plan(entries, capacity)
    staging = torch.device("cpu") if spec["transport"] == "gloo" else device  # gloo's wire starts on the host
    outbox.send("ready")
    idle_since = time.monotonic()
    while True:
        message = inbox.receive(1.0)
        if message is None:
            continue
        idle = time.monotonic() - idle_since
        if message.kind == "stop":
            engine.close()
            return
        if message.kind == "weights":
            version = message["version"]
            planted_fault("load", version)
            outbox.send("receiving", version=version)
            tensors = receive(group, entries, buckets, dtype, device, capacity, into, staging)
            engine.load_weights(planted_after_first(tensors, "push", version), version)
            outbox.send("loaded", version=version)
        elif message.kind == "transfer":  # vLLM's weight transfer (CUDA): one call of its protocol
            transfer_call(engine, message)
            outbox.send("done", call=message["call"])
            if message["call"] == "finish":
                outbox.send("loaded", version=message["version"])
        elif message.kind == "sample":
            step = message["step"]
            planted_fault("sample", step)
            before = copy.deepcopy(cursor)
            start = time.monotonic()
            parts = {shard: collect_rollout(engine, tokenizer, task, collection, cursor, step_seed(cfg.seed, step),
                                            (shard,), spec["num_shards"]).to_plain() for shard in spec["shards"]}
            cursors = {"before": vars(before), "after": vars(copy.deepcopy(cursor))}
            buffer = io.BytesIO()
            torch.save(parts, buffer)
            outbox.send("batch", buffer.getvalue(), step=step, cursors=cursors, window=[start, time.monotonic()],
                        idle=idle)
        idle_since = time.monotonic()


def transfer_call(engine, message) -> None:
    """vLLM's weight-transfer protocol, driven by the trainer's ``NCCLTrainerWeightTransferEngine`` through
    ``bicc.rollout.vllm_transfer.WorkersClient``: init (joins the NCCL group at rank ``rank_offset``), start,
    update (receives one round of broadcasts into the model), finish (the new weights are live)."""
    llm, call = engine.llm, message["call"]
    if call == "init":
        llm.init_weight_transfer_engine({"init_info": message["info"]})
    elif call == "start":
        llm.start_weight_update()
    elif call == "update":
        llm.update_weights({"update_info": message["info"]})
    elif call == "finish":
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        engine.version = message["version"]
    else:
        raise ValueError(f"unknown weight-transfer call {call!r}")


if __name__ == "__main__":
    main()
