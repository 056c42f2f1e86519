"""A rollout worker's weight push, the shared-memory hand-off rollout workers used until 63d8df1 against the collective
that replaced it (``bicc.rollout.weight_sync``), side by side in one run, at SmolLM2-135M's shape and Qwen3-0.6B's
(random weights: a push moves bytes, whatever they hold); on a GPU also at Qwen3-4B's (``--shapes qwen3_4b``).

Both sides are processes: this one is the trainer, holding the policy in fp32 master weights; a spawned worker holds
the sampler's copy and answers once a push has landed in it.

- **shm** (as at 3daadf5): the trainer copies its full state dict, fp32, into one of N + 1 = 2 ``share_memory_()``
  slots (every key, the tied output projection included) and sends the slot's number; the worker copies the slot into
  its fp32 copy.
- **collective**: the trainer casts each tensor, once, into a bucket of ``rollout.push_bucket_mib`` in the sampler's
  dtype (bf16) and broadcasts it over a gloo group of its own; the worker receives into its bf16 copy.

Measured per method and shape: the push's wall time (median of ``--pushes``, from the trainer starting it to the
worker's answer that it has loaded), the bytes it moves per parameter, and the trainer's extra host memory over the
setup and every push (resident set, sampled every millisecond, less what it held before the push machinery existed),
as a fraction of the model's fp32 bytes. Run: ``.venv/bin/python -m bench.weight_sync [--shapes smollm2_135m qwen3_06b]
[--device cuda]`` (on one GPU the worker shares it, so the collective goes over gloo through host memory, as
``rollout.share_gpus`` runs it). Ends with ``RESULT push_s_<shape>_<method>``, ``RESULT push_bytes_per_param``
(collective, largest shape; target <= 2.05 for bf16) and ``RESULT push_host_fraction`` (collective, largest over the
shapes; target <= 0.1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import QWEN3_06B

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49_152, tie_word_embeddings=True, max_position_embeddings=8192)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            intermediate_size=128, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=256)
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=40_960)
# tiny: the bench's own test; qwen3_4b: on a GPU (--device cuda), 16 GB of fp32 weights a side
SHAPES = {"smollm2_135m": SMOLLM2_135M, "qwen3_06b": QWEN3_06B, "qwen3_4b": QWEN3_4B, "tiny": TINY}
BUCKET_MIB = 32.0  # rollout.push_bucket_mib's default


def build(shape: dict, dtype: torch.dtype, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype).requires_grad_(False)


class PeakRSS:
    """The largest resident set of this process while it runs, sampled every millisecond."""

    def __init__(self):
        self.peak, self.running = resident(), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, resident())
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, resident())


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(method: str, shape: dict, device: str, port: int, requests, answers) -> None:
    """The worker's side: its copy of the policy (fp32 for shm, bf16 for the collective), then each push."""
    torch.set_num_threads(1)
    from bicc.rollout.weight_sync import bucket_elems, manifest, plan, receive, tensors_of, weight_group

    model = build(shape, torch.float32 if method == "shm" else torch.bfloat16, device)
    if method == "collective":
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=300))
        group = weight_group(store, 1, 2, "gloo", 300)
        entries = manifest(model)
        capacity = bucket_elems(BUCKET_MIB, torch.bfloat16, entries)
        buckets, into = plan(entries, capacity), tensors_of(model)
    answers.put("ready")
    slots, state = None, model.state_dict()
    while True:
        message = requests.get()
        if message is None:
            return
        if method == "shm":
            slots = slots or message[1]
            with torch.no_grad():
                for name, tensor in state.items():
                    tensor.copy_(slots[message[0]][name])
        else:
            for _ in receive(group, entries, buckets, torch.bfloat16, torch.device(device), capacity, into):
                pass
        answers.put("loaded")


def measure(method: str, shape: dict, pushes: int, device: str) -> dict:
    from bicc.machine.distributed import full_tensor
    from bicc.rollout.weight_sync import bucket_elems, manifest, plan, send, weight_group

    trainer = build(shape, torch.float32, device)
    params = sum(p.numel() for p in trainer.parameters())
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    store = dist.TCPStore("0.0.0.0", 0, None, True, datetime.timedelta(seconds=300), wait_for_workers=False)
    proc = ctx.Process(target=worker, args=(method, shape, device, store.port, requests, answers))
    proc.start()
    before = resident()
    rss = PeakRSS()
    if method == "collective":
        group = weight_group(store, 0, 2, "gloo", 300)
        entries = manifest(trainer)
        capacity = bucket_elems(BUCKET_MIB, torch.bfloat16, entries)
        buckets = plan(entries, capacity)
    else:  # every key of the state dict, full and fp32, into N + 1 = 2 slots
        full = {k: full_tensor(v).detach().to("cpu") for k, v in trainer.state_dict().items()}
        slots = [{k: torch.empty_like(v).share_memory_() for k, v in full.items()} for _ in range(2)]
    answers.get()  # the worker holds its copy
    times, sent = [], 0
    for v in range(pushes):
        t0 = time.perf_counter()
        if method == "collective":
            requests.put(("push", v))
            sent = send(trainer, entries, buckets, group, torch.bfloat16, torch.device("cpu"), capacity)
        else:
            full = {k: full_tensor(t).detach().to("cpu") for k, t in trainer.state_dict().items()}
            with torch.no_grad():
                for name, tensor in full.items():
                    slots[v % 2][name].copy_(tensor)
            sent = sum(t.numel() * t.element_size() for t in full.values())
            requests.put((v % 2, slots if v == 0 else None))
        assert answers.get(timeout=600) == "loaded"
        times.append(time.perf_counter() - t0)
    extra = rss.stop() - before
    requests.put(None)
    proc.join(timeout=60)
    return {"push_s": statistics.median(times), "bytes_per_param": sent / params,
            "host_fraction": extra / (4 * params), "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2_135m", "qwen3_06b"], choices=list(SHAPES))
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the trainer and the worker hold their copies")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for shape in args.shapes:
        for method in ("shm", "collective"):
            r = results[shape, method] = measure(method, SHAPES[shape], args.pushes, args.device)
            print(f"{shape} {method}: {r['params'] / 1e6:.0f}M parameters, push {r['push_s']:.3f} s, "
                  f"{r['bytes_per_param']:.2f} bytes a parameter, trainer's extra host memory "
                  f"{r['host_fraction']:.3f} x the fp32 model", flush=True)
    for (shape, method), r in results.items():
        print(f"RESULT push_s_{shape}_{method}={r['push_s']:.3f}")
    largest = args.shapes[-1]
    print(f"RESULT push_speedup_{largest}={results[largest, 'shm']['push_s'] / results[largest, 'collective']['push_s']:.2f}")
    print(f"RESULT push_bytes_per_param_shm={results[largest, 'shm']['bytes_per_param']:.2f}")
    print(f"RESULT push_bytes_per_param={results[largest, 'collective']['bytes_per_param']:.3f} target<=2.05")
    print(f"RESULT push_host_fraction_shm={max(results[s, 'shm']['host_fraction'] for s in args.shapes):.3f}")
    print(f"RESULT push_host_fraction={max(results[s, 'collective']['host_fraction'] for s in args.shapes):.3f} "
          "target<=0.1")


if __name__ == "__main__":
    main()
