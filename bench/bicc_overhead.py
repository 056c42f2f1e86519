"""Cost of BiCC's conditioned numerator: step time and peak memory of GRPO, BiCC without packing and
BiCC with packing, in one run, on two configs:

- ``embedded``: the tiny default model with its real prompts, synthetic outputs of the task's length;
- ``large``:    a random-init Qwen3 of >= 10M parameters, outputs of 256 tokens, G = 8.
- ``gpu``:      (CUDA) a random-init Qwen3 with Qwen3-0.6B's shape and vocabulary, bf16, flash-attn 2 when
                importable, 8 queries x G = 8, outputs of 1,024 tokens, max 2,048 (context budget 819).
                Also reports training tokens/s and model FLOPs utilisation. ``--shrink`` cuts it to 2
                layers and 64-token outputs, to check the path on a CPU.

Variants: GRPO; BiCC in its stabilised form (``bicc=stable``: pi_old on the context too) without packing,
with packing through a shared prefix KV cache (``packing_impl=kv``, the default) and through one packed
row with a 4-D mask (``packing_impl=mask``); and the paper's exact form with the default packing.

The timed step is the training part that BiCC changes: old log-probs (on q, or on x^c), the numerator's forward and
backward over every micro-batch, and the optimizer step. Rollout generation is left out: it is identical
with and without BiCC, and including it would only dilute the ratio. Outputs and rewards are synthetic
(random tokens, half correct per group) so that every group is conditioned: the worst case for BiCC.

Each variant runs in its own subprocess so that peak RSS (``ru_maxrss``) is its own (on CUDA the
allocator's peak is used instead), ``--rounds`` times, the variants alternating; the step time is the median
over every timed step of its rounds. Run: ``.venv/bin/python -m bench.bicc_overhead [--configs embedded,large]``
(on a GPU: ``--configs gpu``).
Ends with ``RESULT bicc_step_ratio=... target<=1.15`` and ``RESULT bicc_mem_ratio=... target<=1.20``
(packed BiCC over GRPO on the last config), and for ``gpu`` also ``RESULT gpu_grpo_mfu=...`` and
``RESULT gpu_bicc_mfu=...``.

Beside the times, each variant's arithmetic: model FLOPs of its step counted from the rows it computes
(``bench.flops``: the linear layers per token, the output projection per predicted token, and attention per
query-key pair, as ``bicc.kernels.packing`` lays the rows out), and the ratio of packed BiCC's to GRPO's: the step
ratio if every FLOP cost the same in both (larger forwards can run at a better FLOP rate: on the tiny
``embedded`` config BiCC's ratio comes out below it).

MFU counts 2 x parameters FLOPs per token for the no-grad forward of pi_old (when the step plan makes one) and
6 x parameters per token for the numerator's forward and backward (attention's own FLOPs left out, as is usual),
over the step time,
against the GPU's dense bf16 peak (``--peak-tflops``; default 989 for H100/H200).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.flops import plan_flops

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "embedded": dict(arch=dict(hidden_size=128, num_hidden_layers=3, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32), prompts=16, group=8, out_len=26, max_tokens=64, steps=8),
    "large": dict(arch=dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1152, num_attention_heads=6,
                            num_key_value_heads=2, head_dim=64), prompts=4, group=8, out_len=256, max_tokens=256, steps=3),
    "gpu": dict(arch=dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936), dtype="bfloat16",
                attn="flash_attention_2", prompts=8, group=8, out_len=1024, max_tokens=2048, micro=8, steps=3),
}
SHRINK = dict(num_hidden_layers=2, out_len=64, max_tokens=128)
VARIANTS = {  # the stabilised BiCC form (bicc=stable) unless named; packing_impl kv is the default
    "grpo": ["bicc=off", "rcc=off"],
    "bicc_unpacked": ["bicc=stable", "rcc=off", "train.context_packing=false"],
    "bicc_packed": ["bicc=stable", "rcc=off"],
    "bicc_packed_mask": ["bicc=stable", "rcc=off", "train.context_packing_impl=mask"],
    "bicc_paper_packed": ["bicc=on", "rcc=off"],
}


def build_model(spec: dict, seed: int = 0):
    """A random-init Qwen3 of the spec's shape (its own vocabulary size if given) and the char tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bicc.config import TinyArchConfig
    from bicc.model.load import build_tiny, resolve_attn_implementation

    arch = dict(spec["arch"])
    vocab = arch.pop("vocab_size", None)
    model, tok = build_tiny(TinyArchConfig(**arch, max_position_embeddings=4096), seed=seed)
    if vocab is not None:  # the real vocabulary: its embedding and output projection dominate memory
        config = Qwen3Config(**{**model.config.to_dict(), "vocab_size": vocab})
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = resolve_attn_implementation(spec.get("attn", "sdpa"))
    return model.to(getattr(torch, spec.get("dtype", "float32"))), tok


def run_variant(config_name: str, variant: str, shrink: bool = False) -> dict:
    """One measurement, in this process: build, warm up once, time ``steps`` updates."""
    from hydra import compose, initialize_config_dir

    from bicc.config import register_configs
    from bicc.data import build_task, encode_prompt
    from bicc.kernels.rows import ContextRows, query_rows
    from bicc.machine.host import torch_threads
    from bicc.method.advantages import Advantages
    from bicc.method.conditioning import build_contexts
    from bicc.model.load import num_parameters
    from bicc.model.logprobs import make_token_batch
    from bicc.trainer.optim import build_optimizer, warmup_cosine
    from bicc.trainer.plan import StepPlan, step_logprobs
    from bicc.trainer.state import RLState
    from bicc.trainer.update import update_policy

    spec = dict(CONFIGS[config_name])
    if shrink:
        spec = {**spec, **{k: v for k, v in SHRINK.items() if k in spec},
                "arch": {**spec["arch"], "num_hidden_layers": SHRINK["num_hidden_layers"]}}
    register_configs()
    overrides = [f"rollout.prompts_per_step={spec['prompts']}", f"rollout.group_size={spec['group']}",
                 f"rollout.max_new_tokens={spec['max_tokens']}",
                 f"train.micro_batch_size={spec.get('micro', 128)}", "sft.cache_dir=/tmp/unused", *VARIANTS[variant]]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    torch.set_num_threads(torch_threads(0))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.bicc.enabled and cfg.train.context_packing and cfg.train.context_packing_impl == "mask":
        spec["attn"] = "sdpa"  # flash-attn takes no 4-D mask: mask packing always runs on SDPA
    model, tok = build_model(spec)
    model.to(device)
    optimizer = build_optimizer(model, 1e-5, (0.9, 0.999), 0.0)
    state = RLState(model, tokenizer=tok, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 1, 100, 0.1))
    task = build_task(cfg.data)

    gen = torch.Generator().manual_seed(0)
    P, G, L = spec["prompts"], spec["group"], spec["out_len"]
    problems = [task.train_problem(i) for i in range(P)]
    prompt_ids = [encode_prompt(tok, problems[i // G].prompt) for i in range(P * G)]
    prompts = [problems[i // G].prompt for i in range(P * G)]
    digits = tok("0123456789+-=", add_special_tokens=False)["input_ids"]
    boxed = tok("\n\\boxed{7}", add_special_tokens=False)["input_ids"]
    completions = []
    for i in range(P * G):
        body = torch.randint(0, len(digits), (L - len(boxed) - 1,), generator=gen).tolist()
        completions.append([digits[j] for j in body] + boxed + [tok.eos_token_id])
    correct = torch.tensor([float(j % 2 == 0) for j in range(G)] * P)
    group_ids = torch.arange(P).repeat_interleave(G)
    adv = (correct - 0.5) * 2

    batch = make_token_batch(prompt_ids, completions, tok.pad_token_id).to(device)
    plain = query_rows(batch, prompt_ids, completions, cfg.train.share_prompts, tok.pad_token_id, device)
    numerator = plain
    if cfg.bicc.enabled:
        contexts = build_contexts(prompts, completions, correct, group_ids, tok, cfg.bicc, cfg.bicc.max_tokens, prompt_ids)
        numerator = ContextRows(contexts, completions, batch.completion_len, cfg.train, tok.pad_token_id, device)

    plan = StepPlan.from_config(cfg, False)

    def step():  # phases 4 and 6 of train.rl_step (no diagnostics)
        lp = step_logprobs(plan, model, None, plain, numerator, None, cfg, batch.completion_mask)
        update_policy(state, batch, numerator, lp.old, None, Advantages.given(adv.to(device)), cfg, step_seed=0)

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    old_tokens = {"update": 0, "forward": numerator.tokens if plan.old_context == "xc" else plain.tokens}[plan.old_source]
    work = plan_flops(plan, model, plain, numerator)
    params = num_parameters(model)
    return {"config": config_name, "variant": variant, "params_m": params / 1e6,
            "step_s": statistics.median(times), "times": times, "peak_mb": peak / 2**20, "tokens": numerator.tokens,
            "plain_tokens": plain.tokens, "flops": 2 * params * old_tokens + 6 * params * numerator.tokens,
            "work_flops": work,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "attn": model.config._attn_implementation}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "VARIANT"))
    parser.add_argument("--configs", default="embedded,large", help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--shrink", action="store_true", help="2 layers and short outputs (check the path on a CPU)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU, for MFU")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating; step time: the "
                                                               "median over all their timed steps, memory: the peak")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(*args.child, shrink=args.shrink)))
        return
    results = {}
    for config_name in args.configs.split(","):
        runs: dict[str, list[dict]] = {}
        for _ in range(args.rounds):  # variants alternate, so that machine drift hits all of them
            for variant in args.variants.split(","):
                proc = subprocess.run([sys.executable, "-m", "bench.bicc_overhead", "--child", config_name, variant,
                                       *(["--shrink"] if args.shrink else [])], capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    sys.exit(f"{config_name}/{variant} failed:\n{proc.stderr[-3000:]}")
                runs.setdefault(variant, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
        for variant, rounds in runs.items():
            r = {**rounds[0], "step_s": statistics.median(t for x in rounds for t in x["times"]),
                 "peak_mb": max(x["peak_mb"] for x in rounds)}
            results[(config_name, variant)] = r
            r["tokens_per_s"] = r["tokens"] / r["step_s"]
            r["mfu"] = r["flops"] / r["step_s"] / (args.peak_tflops * 1e12)
            print(f"{config_name:9s} {variant:17s} {r['params_m']:7.2f}M params  step {r['step_s']:7.3f}s  "
                  f"peak {r['peak_mb']:8.0f} MB  numerator tokens {r['tokens']} (plain {r['plain_tokens']})  "
                  f"{r['work_flops'] / 1e9:7.1f} GFLOP  "
                  f"{r['tokens_per_s']:9.0f} tok/s  MFU {r['mfu'] if r['device'] != 'cpu' else float('nan'):.3f}  "
                  f"[{r['device']}, {r['attn']}]", flush=True)
    last = args.configs.split(",")[-1]
    base, packed = results.get((last, "grpo")), results.get((last, "bicc_packed"))
    unpacked = results.get((last, "bicc_unpacked"))
    if base and unpacked:
        print(f"[{last}] unpacked BiCC / GRPO: step {unpacked['step_s'] / base['step_s']:.3f}, "
              f"memory {unpacked['peak_mb'] / base['peak_mb']:.3f}")
    if not (base and packed):
        return  # the headline ratios need both grpo and bicc_packed
    print(f"[{last}] packed BiCC / GRPO model FLOPs (the step ratio if every FLOP cost the same): "
          f"{packed['work_flops'] / base['work_flops']:.3f}")
    print(f"RESULT bicc_step_ratio={packed['step_s'] / base['step_s']:.3f} target<=1.15")
    print(f"RESULT bicc_mem_ratio={packed['peak_mb'] / base['peak_mb']:.3f} target<=1.20")
    if last == "gpu":
        print(f"RESULT gpu_grpo_mfu={base['mfu']:.3f} target>=0.30")
        print(f"RESULT gpu_bicc_mfu={packed['mfu']:.3f} target>=0.30")

if __name__ == "__main__":
    main()
