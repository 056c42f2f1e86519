"""``make gpu-check``: what a person with one CUDA GPU runs first (8 minutes on one H100 at most, 12 with
``--compile``: every phase has a budget; no hub access, no vLLM, no flash-attn needed).

    make gpu-check                              # .venv's python, else python3
    .venv/bin/python -m bench.gpu_check --skip-tests --budget-s 300

1. The GPU-marked tests (``pytest -m gpu``: a bf16 run on CUDA; flash-attn against SDPA where it is installed).
2. A one-GPU rehearsal of the headline command::

       torchrun --nproc_per_node=1 train.py experiment=paper_qwen3_4b algo=dapo bicc=on rcc=on rollout=hf

   on a Qwen3-0.6B-shaped model with random weights and a tokenizer built locally (the character tokenizer,
   its vocabulary filled to Qwen3's 151,936 ids), FSDP2 over one rank (bf16 compute over fp32 master weights),
   activation checkpointing, outputs of up to 256 tokens (a random model rarely ends one early). Two legs: the
   initial evaluation, steps 1-2 and a checkpoint; then a resume from that checkpoint, step 3, a checkpoint and
   the final evaluation (MATH-500 alone, ``eval=math500``, 2 problems x 4 samples of 128 tokens: the four
   benchmarks of ``eval=paper`` run the same code four times). The training reward is constructed (``tests.rewards:first_right``:
   every group mixed, whatever a random model samples), so one sampling round fills a batch and BiCC conditions
   every sample.
3. The bare baseline: ``bench.update_vs_bare --fsdp`` at the same shape, 512-token outputs (our update, sharded as
   the rehearsal shards it, against a 40-line transformers loop).

``--skip-tests`` leaves out phase 1. ``--skip-baseline`` leaves out phase 3 and gives the rehearsal the whole budget
left: ``--compile --skip-tests --skip-baseline --budget-s 590`` runs the compiled rehearsal's two legs alone, for a
job limited to 10 minutes.

``--compile`` runs the rehearsal with ``model.compile=on`` (each decoder layer compiled for the update and the
log-prob passes, ``bicc.kernels.compile``) and ``rollout.hf.static_cache=true`` (HF generate into a static KV cache, whose
decoding steps transformers compiles), and the baseline with ``--compile``: run the check once without and once
with it to compare them on one GPU (``perf/generate_s`` and ``perf/update_s`` tell the two apart). Each of its
three processes compiles (the second leg and the baseline from Inductor's caches): on one H100 with empty caches
the first leg alone took 370 s, so its budget is 720 s. Hydra overrides after the flags reach the rehearsal, the
baseline's update and the memory model's prediction alike, e.g. FSDP2's options that keep the gathered layers
(``docs/distributed.md``)::

    make gpu-check ARGS="--compile dist.reshard_after_forward=false dist.reshard_after_backward=false"

Each phase runs under what is left of ``--budget-s`` (480; 720 with ``--compile``): a phase that would overrun is
stopped and says so (the RL loop stops at ``train.time_budget_s`` with a checkpoint). Ends with ``RESULT`` lines:
``gpu_train_tokens_per_s`` (tokens the update computes, contexts once, per second of the update phase, steps
after the first), ``gpu_train_mfu`` (6 FLOPs per parameter per such token plus the output projection's, over the
GPU's dense bf16 peak; target >= 0.40), ``gpu_update_vs_bare``, ``gpu_allocated_vs_model`` (CUDA's allocated
peak over ``bicc.machine.memory``'s allocated bytes for the run's own config, target 0.9-1.1; each phase printed),
``gpu_reserved_vs_allocated`` and ``gpu_check_wall_s`` (target <= the budget; one H100 80GB: 366 s). Without CUDA
it says so and exits 2 at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import GIB, PEAK_TFLOPS, QWEN3_06B, ROOT

PROMPTS, STEPS, OUTPUT_TOKENS, EVAL_TOKENS = 8, 3, 256, 128
BUDGET_S = 480  # make gpu-check's whole wall time
COMPILE_BUDGET_S = 720  # with --compile: each of the three processes compiles (one H100, caches empty: leg 1 370 s)
NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")


def rehearsal_overrides(model_dir: Path, run_dir: Path, prompts: int = PROMPTS, output_tokens: int = OUTPUT_TOKENS,
                        eval_tokens: int = EVAL_TOKENS) -> list[str]:
    """The headline command's overrides for one GPU: the model, the sizes, the constructed reward (the steps and
    checkpoints are each leg's: ``rehearse``)."""
    return ["experiment=paper_qwen3_4b", "algo=dapo", "bicc=on", "rcc=on", "rollout=hf", f"model.path={model_dir}",
            "model.name=qwen3_0.6b_shape_random", f"rollout.prompts_per_step={prompts}",
            f"rollout.max_new_tokens={output_tokens}", f"bicc.max_tokens={output_tokens}", "optim.warmup_steps=1",
            "diag.every=0", "eval=math500", "eval.limit=2", "eval.samples_per_problem=4",
            f"eval.max_new_tokens={eval_tokens}", "eval.checker_workers=1",
            "data.reward=tests.rewards:first_right", "data.reward_batched=true", "logger.wandb_mode=disabled",
            "logger.progress=false", f"hydra.run.dir={run_dir}"]


def shape_files(path: Path, arch: dict):
    """The config.json of a Qwen3 of shape ``arch`` and the character tokenizer filled to its vocabulary, at ``path``
    (what ``bicc.machine.memory`` reads); the config."""
    from transformers import Qwen3Config

    from bicc.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(vocab_size=arch["vocab_size"])
    config = Qwen3Config(**arch, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return config


def build_model_dir(path: Path, arch: dict, device: str) -> Path:
    """A random-weight Qwen3 of shape ``arch`` (fp32) and its tokenizer (``shape_files``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = shape_files(path, arch)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path)
    return path


def dapo_file(path: Path, rows: int = 400) -> Path:
    """Arithmetic problems in DAPO-Math-17k's nested layout (what ``data=dapo_math17k`` reads)."""
    from omegaconf import OmegaConf

    from bicc.config import DataConfig
    from bicc.data import build_task

    task = build_task(OmegaConf.structured(DataConfig(task="arith")))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            p = task.train_problem(i)
            f.write(json.dumps({"prompt": [{"role": "user", "content": p.prompt}],
                                "reward_model": {"ground_truth": p.answer}, "extra_info": {"index": i}}) + "\n")
    return path


class Cut(RuntimeError):
    """A phase stopped at its budget."""


def run_phase(name: str, cmd: list[str], env: dict, seconds: float, capture: bool = False) -> str:
    """``cmd`` in the repo root with ``seconds`` to finish; Cut when it would overrun, RuntimeError when it fails.
    ``capture``: its stdout is returned (and its stderr's tail told on failure) rather than printed."""
    if seconds <= 0:
        raise Cut(f"{name}: no time left in the budget")
    pipe = subprocess.PIPE if capture else None
    # its own process group: a cut stops what it started too (torchrun's workers), not only the launcher
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=capture, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=seconds)
        except subprocess.TimeoutExpired as err:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=grace)
                    break
            raise Cut(f"{name}: stopped at its budget of {seconds:.0f} s") from err
    if proc.returncode:
        raise RuntimeError(f"{name} exited {proc.returncode}" + (f": {stderr[-2000:]}" if capture else ""))
    return stdout if capture else ""


def rehearse(out: Path, arch: dict, env: dict, device: str = "cuda", extra: tuple = (), budget_s: float = BUDGET_S,
             steps: int = STEPS, **sizes) -> tuple[list, dict]:
    """Build the model dir and the data file under ``out``, run the headline command under torchrun with one
    process in two legs (steps 1 .. steps-1 and a checkpoint; a resume, the last step and the final evaluation),
    within ``budget_s``; (its metrics rows, the second leg's results). ``sizes``: ``rehearsal_overrides``'s."""
    deadline = time.perf_counter() + budget_s
    model_dir = build_model_dir(out / "model", arch, device)
    env = {**env, "BICC_DAPO_MATH": str(dapo_file(out / "dapo_math.jsonl"))}
    run_dir = out / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    for leg, overrides in ((1, [f"train.steps={steps - 1}", f"train.save_every={steps - 1}"]),
                           (2, [f"train.steps={steps}", f"train.save_every={steps}", "resume=auto"])):
        left = deadline - time.perf_counter()
        # the RL loop stops (with a checkpoint) with a fifth of the leg's time left for the evaluation
        cmd = [*launch, *rehearsal_overrides(model_dir, run_dir, **sizes), *overrides,
               f"train.time_budget_s={max(1.0, 0.8 * left):.0f}", *extra]
        print(f"[gpu-check] rehearsal, leg {leg}: " + " ".join(cmd[1:]), flush=True)
        run_phase(f"rehearsal leg {leg}", cmd, env, left)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return rows, json.loads((run_dir / "results.json").read_text(encoding="utf-8"))


def bare_baseline(env: dict, seconds: float, extra: tuple = ()) -> float:
    """``bench.update_vs_bare`` at the rehearsal's shape: our update's tokens/s over a bare transformers loop's."""
    cmd = [sys.executable, "-m", "bench.update_vs_bare", "--fsdp", "--shape", "qwen3_0.6b", "--output-tokens", "512",
           "--iters", "1", *extra]
    stdout = run_phase("bare baseline", cmd, env, seconds, capture=True)
    print(stdout[-2000:], end="")
    found = [line.split("=", 1)[1].split()[0] for line in stdout.splitlines() if line.startswith("RESULT update_vs_bare=")]
    if not found:
        raise RuntimeError("bare baseline printed no RESULT update_vs_bare line")
    return float(found[0])


def model_flops_per_token(arch: dict) -> float:
    """Training FLOPs per token the update embeds: 6 per non-embedding parameter, plus the output projection's
    6 x hidden x vocab (attention's score FLOPs left out: a lower bound on what the GPU did)."""
    h, i, hq, hkv = arch["hidden_size"], arch["intermediate_size"], arch["num_attention_heads"] * arch["head_dim"], \
        arch["num_key_value_heads"] * arch["head_dim"]
    layer = h * hq + 2 * h * hkv + hq * h + 3 * h * i
    return 6.0 * (arch["num_hidden_layers"] * layer + h * arch["vocab_size"])


# the run's phases (results.json ``cuda_peaks_gib``) and the model's that fall in each
PHASES = {"generate": ("rollout",), "log-probs": ("no-grad log-probs",), "evaluation": ("evaluation",),
          "update": ("update: head backward", "update: layers backward", "update: contexts backward",
                     "update: root reduce-scatter", "optimizer step")}


def summarise(rows: list[dict], results: dict, arch: dict, peak_tflops: float, predicted: dict[str, float]) -> dict:
    """Throughput and MFU from the run's metrics (steps after the first, whose update pays for kernel selection and
    the allocator's growth); CUDA's allocated peaks against ``predicted`` (GiB per run phase, ``predicted_gib``);
    the graphs each step compiled."""
    steps = [r for r in rows if "perf/update_s" in r]
    timed = steps[1:] or steps
    if not timed:
        raise RuntimeError("the run logged no training step")
    tokens = sum(r["perf/update_tokens"] for r in timed)
    seconds = sum(r["perf/update_s"] - r.get("perf/diagnostics_s", 0.0) for r in timed)
    rate = tokens / seconds
    reserved, allocated = results.get("cuda_max_reserved_gib"), results.get("cuda_max_allocated_gib")
    measured = results.get("cuda_peaks_gib", {})
    return {"gpu_train_tokens_per_s": rate, "gpu_train_mfu": rate * model_flops_per_token(arch) / (peak_tflops * 1e12),
            "gpu_peak_gib": reserved, "gpu_model_gib": max(predicted.values()),
            "gpu_allocated_vs_model": None if allocated is None else allocated / max(predicted.values()),
            "gpu_reserved_vs_allocated": None if not allocated else reserved / allocated,
            "phases": {k: (measured[k]["allocated"], v) for k, v in predicted.items() if k in measured},
            "graphs": [(r["step"], int(r.get("perf/compiled_graphs", 0))) for r in steps]}


def predicted_gib(model_dir: Path, gpu_gib: float, extra: tuple = (), **sizes) -> dict[str, float]:
    """``bicc.machine.memory``'s allocated bytes (no runtime, no allocator slack: what ``max_memory_allocated`` counts) per
    run phase, for the rehearsal's own config (with the overrides ``extra``) as ``train.py`` composes it: one process
    under torchrun (FSDP2 over one rank), its longest training prompt, HF generate for the rollout and the
    evaluation, SDPA."""
    from bench.common import compose_cfg
    from bicc.data import build_task
    from bicc.machine.memory import allocated
    from bicc.model.load import tokenizer_and_positions
    from bicc.trainer.fit import predicted_run

    cfg = compose_cfg([o for o in rehearsal_overrides(model_dir, model_dir, **sizes) if not o.startswith("hydra.")] + list(extra))
    tokenizer = tokenizer_and_positions(cfg.model)[0]
    table = allocated(*predicted_run(cfg, build_task(cfg.data), tokenizer, 1, True, gpu_gib))
    return {phase: max(table[name] for name in names) / GIB for phase, names in PHASES.items()}


def no_cuda_message() -> str | None:
    if not any(Path(p).exists() for p in NVIDIA_NODES):  # said before torch is imported: at once
        return "[gpu-check] no NVIDIA GPU on this machine (no /dev/nvidia*): make gpu-check needs one"
    import torch

    if torch.cuda.is_available():
        return None
    return ("[gpu-check] no CUDA device is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}): make gpu-check needs one NVIDIA GPU and a CUDA build of torch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="only the rehearsal and the baseline")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="no bare baseline: the rehearsal gets the whole budget left after the tests")
    parser.add_argument("--out", default=None, help="where the model, data and run go (default: a fresh dir under outputs/)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole check's wall time (default {BUDGET_S}, {COMPILE_BUDGET_S} with --compile)")
    parser.add_argument("--compile", action="store_true",
                        help="model.compile=on and rollout.hf.static_cache=true in the rehearsal, --compile in the baseline")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the rehearsal, the baseline's update and the "
                        "memory model (e.g. dist.reshard_after_forward=false)")
    args = parser.parse_args()
    args.budget_s = args.budget_s or (COMPILE_BUDGET_S if args.compile else BUDGET_S)
    message = no_cuda_message()
    if message:
        print(message, file=sys.stderr)
        return 2
    import torch

    begin = time.perf_counter()
    deadline = begin + args.budget_s
    name = torch.cuda.get_device_name(0)
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    print(f"[gpu-check] {name}, {gpu_gib:.0f} GiB, torch {torch.__version__}, peak bf16 "
          f"{peak_tflops or 'unknown (pass --peak-tflops)'} TFLOP/s; budget {args.budget_s:.0f} s")
    out = Path(args.out or ROOT / "outputs" / "gpu-check" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "BICC_CACHE": str(out / "cache")}
    failed, cut = [], []

    def phase(label: str, fn, share: float):
        """``fn(seconds)`` with ``share`` of what is left; its result, or None (cut or failed, said)."""
        start = time.perf_counter()
        try:
            return fn(share * (deadline - start))
        except Cut as err:
            cut.append(label)
            print(f"[gpu-check] CUT {err}", file=sys.stderr)
        except RuntimeError as err:
            failed.append(label)
            print(f"[gpu-check] {err}", file=sys.stderr)
        finally:
            print(f"[gpu-check] {label}: {time.perf_counter() - start:.0f} s")
        return None

    if not args.skip_tests:
        phase("GPU tests", lambda s: run_phase("GPU tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                                                             "tests/test_gpu.py"], env, s), 0.25)
    compiled = ("model.compile=on", "rollout.hf.static_cache=true") if args.compile else ()
    overrides = tuple(args.overrides)
    done = phase("rehearsal", lambda s: rehearse(out, QWEN3_06B, env, extra=compiled + overrides, budget_s=s),
                 1.0 if args.skip_baseline else 0.8)
    ratio = None if args.skip_baseline else phase(
        "bare baseline", lambda s: bare_baseline(env, s, (("--compile",) if args.compile else ()) + overrides), 1.0)
    if done is not None:
        rows, results = done
        os.environ["BICC_DAPO_MATH"] = str(out / "dapo_math.jsonl")
        summary = summarise(rows, results, QWEN3_06B, peak_tflops or float("nan"),
                            predicted_gib(out / "model", gpu_gib, compiled + overrides))
        print(f"[gpu-check] peak {results['cuda_max_allocated_gib']:.2f} GiB allocated, {summary['gpu_peak_gib']:.2f} "
              f"reserved; bicc.machine.memory {summary['gpu_model_gib']:.2f} GiB allocated")
        for name, (got, want) in summary["phases"].items():
            print(f"[gpu-check]   {name:<11} allocated {got:6.2f} GiB, bicc.machine.memory {want:6.2f} GiB ({got / want:.3f})")
        print("[gpu-check] graphs compiled per step (model.compile): "
              + ", ".join(f"step {step} {n}" for step, n in summary["graphs"]))
        print(f"RESULT gpu_train_tokens_per_s={summary['gpu_train_tokens_per_s']:.0f}")
        print(f"RESULT gpu_train_mfu={summary['gpu_train_mfu']:.3f} target>=0.40")
        print(f"RESULT gpu_allocated_vs_model={summary['gpu_allocated_vs_model']:.3f} target>=0.9 target<=1.1")
        print(f"RESULT gpu_reserved_vs_allocated={summary['gpu_reserved_vs_allocated']:.3f}")
    if ratio is not None:
        print(f"RESULT gpu_update_vs_bare={ratio:.3f} target>=1.5")
    print(f"RESULT gpu_check_wall_s={time.perf_counter() - begin:.0f} target<={args.budget_s:.0f}")
    if cut:
        print(f"[gpu-check] CUT at the budget: {', '.join(cut)}", file=sys.stderr)
    if failed:
        print(f"[gpu-check] FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or cut else 0


if __name__ == "__main__":
    sys.exit(main())
