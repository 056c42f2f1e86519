"""Where a paper-scale step goes: a step-time model of Qwen3-4B at the paper's shape, phase by phase.

Run: ``.venv/bin/python -m bench.step_model``.

On a CPU it measures, on this machine, the per-token cost of a no-grad forward, a forward + backward and an
HF decode step at two small Qwen3 sizes, fits cost per token = a x parameters + b, and extrapolates to
Qwen3-4B (attention's quadratic term left out, as FLOP counts usually do; the absolute seconds are this CPU's,
the shares are what the model is for). On a GPU it measures the same three costs on a Qwen3-4B-shaped model
(random weights, bf16) instead of extrapolating.

The step is one GPU's share of the paper preset (``conf/experiment/paper_qwen3_4b.yaml``): 8 queries x
G = 8 = 64 outputs, prompts of 300 tokens, output lengths from the labelled completions scaled so that the
99th percentile is 2,048 tokens, the BiCC context budget 0.4 x 2,048 with KV-reuse packing (two distinct
prefixes per group, each token costing what a plain token costs), activation checkpointing (one more forward
in the update), and the passes each configuration makes (``bicc.trainer.plan.StepPlan``; the preset reads RCC's delta
from pi_old on q, Algorithm 1's on x^c from a pass of its own). On a GPU the weight sync
is added: the bf16 weights at an assumed 100 GB/s. On a CPU the rollout is HF decoding, which costs ~10x a
forward per token here; vLLM on a GPU changes that share, so read the CPU shares with that in mind.
Ends with ``RESULT model_step_ratio_bicc_rcc=<BiCC+RCC / GRPO> target<=1.15``.

``--layouts``: the paper preset's whole step (32 queries x G = 8, BiCC + RCC) on 4 GPUs, laid out three ways:
colocated and synchronous (every GPU samples, then every GPU trains), and rollout workers (``rollout.async_steps=1``)
on 1 or 2 GPUs beside 3 or 2 training GPUs. It is a model, not a measurement, built from the rates measured on
the H100 and H200 that docs/performance.md and its history quote (``LAYOUT_RATES``): the update's tokens/s at
Qwen3-4B's width, and HF generate's seconds per decoding step of 64 rows at Qwen3-0.6B's shape. Its assumptions:
HF generate is bound by the host's kernel launches (34 ms a step at 64 rows, against 0.4 ms to read the 0.6B
weights), so a step's time scales with the layers and not with the rows up to the 256 of a whole batch; a batch
takes as many decoding steps as its longest output; a no-grad pass runs at 3x the update's tokens/s; training
scales linearly over GPUs. The weight push is a line of its own in the table, also a model: the bf16 weights
broadcast over NCCL between the node's GPUs at ``PUSH_GBPS`` = 50 GB/s (verl's one-step-off moves 7B, 14 GB, in under
300 ms: 47 GB/s or more), paid on the trainer's side, beside what the shared-memory hand-off before 63d8df1 cost (the
fp32 state dict, 16 GB, written and read back through host memory at 25 GB/s each way). Ends with
``RESULT model_async_vs_sync_<device>=<best async layout / colocated> target<1`` and ``RESULT model_push_s``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import compose_cfg, drawn_lengths
from bicc.config import StepConfig, TinyArchConfig
from bicc.kernels.rows import QueryRows
from bicc.machine.host import torch_threads
from bicc.machine.memory import QWEN3_4B
from bicc.model.load import build_tiny, num_parameters
from bicc.model.logprobs import make_token_batch
from bicc.trainer.plan import StepPlan

SMALL = [dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64),
         dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1152, num_attention_heads=6, num_key_value_heads=2,
              head_dim=64)]
ROWS, TOKENS, DECODE = 8, 256, 64  # the timed batch: rows x tokens; decode steps
PROMPT, MAX_TOKENS, GROUPS, G, SYNC_GBPS = 300, 2048, 8, 8, 100.0


def timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_token_costs(model, tokenizer) -> dict[str, float]:
    """Seconds per token of a no-grad forward, a forward + backward, and one decoded token."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tokenizer), (ROWS, TOKENS), generator=gen).tolist()
    batch = make_token_batch([r[:32] for r in ids], [r[32:] for r in ids], tokenizer.pad_token_id).to(device)
    numerator, rows = QueryRows(batch), torch.arange(ROWS)

    def forward():
        with torch.no_grad():
            numerator.logprobs(model, rows, 1.0)

    def forward_backward():
        numerator.logprobs(model, rows, 1.0)[0].sum().backward()

    prompt = torch.tensor([r[:32] for r in ids], device=device)

    def decode():
        with torch.no_grad():
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=None,
                           max_new_tokens=DECODE, min_new_tokens=DECODE, pad_token_id=tokenizer.pad_token_id)

    n = ROWS * TOKENS
    return {"forward": timed(forward) / n, "forward_backward": timed(forward_backward) / n,
            "decode": timed(decode) / (ROWS * DECODE)}


def measured_costs() -> dict[str, float]:
    """Per-token seconds at Qwen3-4B's size: measured (GPU) or extrapolated from two small sizes (CPU)."""
    if torch.cuda.is_available():
        from transformers import Qwen3Config, Qwen3ForCausalLM

        _, tok = build_tiny(TinyArchConfig(**SMALL[0]), seed=0)
        a = QWEN3_4B
        config = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                             num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                             intermediate_size=a.intermediate, tie_word_embeddings=a.tied)
        model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
        print(f"measured on {torch.cuda.get_device_name()} at {num_parameters(model) / 1e9:.2f}B parameters (bf16)")
        return per_token_costs(model, tok)
    sizes, costs = [], []
    for arch in SMALL:
        model, tok = build_tiny(TinyArchConfig(**arch, max_position_embeddings=1024), seed=0)
        sizes.append(num_parameters(model))
        costs.append(per_token_costs(model, tok))
        print(f"{sizes[-1] / 1e6:.1f}M parameters: " + ", ".join(f"{k} {v * 1e6:.1f} us/token" for k, v in costs[-1].items()))
    target = QWEN3_4B.params()
    out = {}
    for key in costs[0]:
        slope = (costs[1][key] - costs[0][key]) / (sizes[1] - sizes[0])
        out[key] = costs[1][key] + slope * (target - sizes[1])
    print(f"extrapolated to {target / 1e9:.2f}B parameters (this CPU's seconds; the shares are the model's point)")
    return out


def step_phases(plan: StepPlan, cost: dict[str, float], mean_len: float, max_len: int,
                share_prompts: bool = True) -> dict[str, float]:
    """Seconds per phase of one GPU's step under ``plan``; ``share_prompts`` (``train.share_prompts``): each
    prompt computed once for its G outputs in the passes on q, else once per output."""
    n = GROUPS * G
    q_tokens = (GROUPS if share_prompts else n) * PROMPT + n * mean_len
    prefix = PROMPT + int(0.4 * MAX_TOKENS)
    xc_tokens = GROUPS * 2 * prefix + n * mean_len  # KV-reuse packing: each group's two prefixes once
    update_tokens = xc_tokens if plan.update_context == "xc" else q_tokens
    phases = {"rollout": n * PROMPT * cost["forward"] + n * mean_len * cost["decode"]}
    for name, (_, ctx) in zip(plan.describe(), plan.passes):
        phases[name.replace(" (no grad)", "")] = (xc_tokens if ctx == "xc" else q_tokens) * cost["forward"]
    # activation checkpointing replays each layer's forward in the backward
    phases["update"] = update_tokens * (cost["forward_backward"] + cost["forward"])
    if torch.cuda.is_available():  # a GPU figure: beside this CPU's seconds it would mean nothing
        phases["weight sync"] = QWEN3_4B.params() * 2 / (SYNC_GBPS * 1e9)
    return phases


# Measured rates (docs/performance.md; docs/history/performance-2026-11.md): the update's tokens/s per GPU at
# Qwen3-4B's width (H200: 36 layers; H100: 8 layers, scaled by 8/36 to the full depth), and HF generate's seconds
# per decoding step (H100, Qwen3-0.6B's 28 layers, 64 rows x 1,024 tokens in 34.98 s, the growing cache).
LAYOUT_RATES = {"H100": {"update_tokens_s": 55_519 * 8 / 36, "decode_step_s": 34.98 / 1024 * 36 / 28},
                "H200": {"update_tokens_s": 15_410, "decode_step_s": 34.98 / 1024 * 36 / 28}}
HOST_GBPS, PUSH_GBPS, LAYOUT_GPUS, LAYOUT_QUERIES = 25.0, 50.0, 4, 32


def push_seconds(collective: bool = True) -> float:
    """A push of Qwen3-4B's weights to the rollout workers (a model): bf16 over NCCL, or (the hand-off before 63d8df1)
    the fp32 state dict through host shared memory, written and read back."""
    if collective:
        return QWEN3_4B.params() * 2 / (PUSH_GBPS * 1e9)
    return 2 * QWEN3_4B.params() * 4 / (HOST_GBPS * 1e9)


def layout_times(rates: dict, train_tokens: float, no_grad_tokens: float, longest: int,
                 faster: float = 1.0) -> dict[str, float]:
    """Seconds per step of each layout: colocated (generation then training on every GPU) or k training GPUs
    beside 4 - k rollout GPUs (one batch ahead: the slower of the two sides, plus the push on the trainer's);
    ``faster``: generation that many times faster than the measured HF generate, rows still free."""
    generate = longest * rates["decode_step_s"] / faster  # host-bound steps: the same at 64 rows a GPU or 256
    work = train_tokens / rates["update_tokens_s"] + no_grad_tokens / (3 * rates["update_tokens_s"])  # one GPU's
    push = push_seconds()
    times = {"4 GPUs colocated, synchronous": generate + work / LAYOUT_GPUS}
    for trainers in (3, 2):
        times[f"{trainers} training + {LAYOUT_GPUS - trainers} rollout GPUs, async_steps=1"] = max(
            generate, work / trainers + push)
    return times


def layouts(mean_len: float, longest: int) -> None:
    cfg = compose_cfg(["experiment=paper_qwen3_4b", "diag.every=0", "bicc=on", "rcc=on"])
    plan = StepPlan.from_config(StepConfig.of(cfg), True)
    n = LAYOUT_QUERIES * G
    q_tokens = LAYOUT_QUERIES * PROMPT + n * mean_len
    xc_tokens = LAYOUT_QUERIES * 2 * (PROMPT + int(0.4 * MAX_TOKENS)) + n * mean_len
    no_grad = sum(xc_tokens if ctx == "xc" else q_tokens for _, ctx in plan.passes)
    train = (xc_tokens if plan.update_context == "xc" else q_tokens) * 4 / 3  # activation checkpointing's replayed forward
    print(f"the paper preset's step on {LAYOUT_GPUS} GPUs (a model, not a measurement): {n} outputs, mean {mean_len:.0f} "
          f"tokens, longest {longest}; passes: {' -> '.join(plan.describe())}")
    print(f"weight push (a model): {push_seconds():.2f}s over NCCL in bf16, against {push_seconds(False):.2f}s through host "
          "shared memory in fp32 before 63d8df1")
    print(f"RESULT model_push_s={push_seconds():.3f}")
    for device, rates in LAYOUT_RATES.items():
        times = layout_times(rates, train, no_grad, longest)
        colocated = times["4 GPUs colocated, synchronous"]
        print(f"\n{device}:")
        for name, seconds in times.items():
            print(f"  {name:48s} {seconds:7.1f}s  {colocated / seconds:5.2f}x colocated")
        best = min(times, key=times.get)
        print(f"  fastest: {best}")
        for faster in (5, 20, 50):  # a faster sampler (vLLM's rate at this size is unmeasured here)
            other = layout_times(rates, train, no_grad, longest, faster)
            name = min(other, key=other.get)
            print(f"  generation {faster}x faster: fastest {name}, "
                  f"{other['4 GPUs colocated, synchronous'] / other[name]:.2f}x colocated")
        print(f"RESULT model_async_vs_sync_{device}={min(times.values()) / colocated:.3f} target<1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", action="store_true", help="4 GPUs: colocated sync against 3+1 and 2+2 async")
    args = parser.parse_args()
    torch.set_num_threads(torch_threads(0))
    if args.layouts:
        _, tok = build_tiny(TinyArchConfig(**SMALL[0]), seed=0)
        lengths = drawn_lengths(MAX_TOKENS, tok).float()
        layouts(float(lengths.mean()), MAX_TOKENS)
        return
    cost = measured_costs()
    _, tok = build_tiny(TinyArchConfig(**SMALL[0]), seed=0)
    lengths = drawn_lengths(MAX_TOKENS, tok).float()
    mean_len = float(lengths.mean())
    print(f"outputs: mean {mean_len:.0f}, median {float(lengths.median()):.0f}, max {int(lengths.max())} tokens; "
          f"per GPU {GROUPS} queries x G = {G}, prompts {PROMPT} tokens, context budget {int(0.4 * MAX_TOKENS)}")
    totals = {}
    for name, overrides in (("GRPO", ["bicc=off", "rcc=off"]), ("BiCC+RCC (paper)", ["bicc=on", "rcc=on"]),
                            ("BiCC+RCC, Algorithm 1's delta on x^c", ["bicc=on", "rcc=on", "rcc.delta_context=xc"]),
                            ("BiCC+RCC, pi_old from the sampler", ["bicc=on", "rcc=on", "rollout.old_from_sampler=true"])):
        cfg = compose_cfg(["experiment=paper_qwen3_4b", "diag.every=0", *overrides])
        plan = StepPlan.from_config(StepConfig.of(cfg), cfg.rollout.old_from_sampler)
        phases = step_phases(plan, cost, mean_len, MAX_TOKENS, cfg.train.share_prompts)
        total = totals[name] = sum(phases.values())
        top = max(phases, key=phases.get)
        print(f"\n{name}: {total:.1f}s per step, dominated by {top} ({phases[top] / total:.0%})")
        for phase, seconds in phases.items():
            print(f"  {phase:48s} {seconds:8.2f}s {seconds / total:6.1%}")
    for name in list(totals)[2:]:
        print(f"{name}: {totals[name] / totals['GRPO']:.3f} x GRPO")
    ratio = totals["BiCC+RCC (paper)"] / totals["GRPO"]
    print(f"\nRESULT model_step_ratio_bicc_rcc={ratio:.3f} target<=1.15")


if __name__ == "__main__":
    main()
