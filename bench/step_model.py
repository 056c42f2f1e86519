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
from a pass of its own, ``train.delta_from_update=true`` from the update's forward). On a GPU the weight sync
is added: the bf16 weights at an assumed 100 GB/s. On a CPU the rollout is HF decoding, which costs ~10x a
forward per token here; vLLM on a GPU changes that share, so read the CPU shares with that in mind.
Ends with ``RESULT model_step_ratio_bicc_rcc=<BiCC+RCC / GRPO> target<=1.15``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import compose_cfg, drawn_lengths
from bicc.config import TinyArchConfig
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
    update_tokens = xc_tokens if plan.conditioned else q_tokens
    phases = {"rollout": n * PROMPT * cost["forward"] + n * mean_len * cost["decode"]}
    for name in plan.passes()[:-1]:
        phases[name.replace(" (no grad)", "")] = (xc_tokens if "x^c" in name else q_tokens) * cost["forward"]
    # activation checkpointing replays each layer's forward in the backward
    phases["update"] = update_tokens * (cost["forward_backward"] + cost["forward"])
    if torch.cuda.is_available():  # a GPU figure: beside this CPU's seconds it would mean nothing
        phases["weight sync"] = QWEN3_4B.params() * 2 / (SYNC_GBPS * 1e9)
    return phases


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    torch.set_num_threads(torch_threads(0))
    cost = measured_costs()
    _, tok = build_tiny(TinyArchConfig(**SMALL[0]), seed=0)
    lengths = drawn_lengths(MAX_TOKENS, tok).float()
    mean_len = float(lengths.mean())
    print(f"outputs: mean {mean_len:.0f}, median {float(lengths.median()):.0f}, max {int(lengths.max())} tokens; "
          f"per GPU {GROUPS} queries x G = {G}, prompts {PROMPT} tokens, context budget {int(0.4 * MAX_TOKENS)}")
    totals = {}
    for name, overrides in (("GRPO", ["bicc=off", "rcc=off"]), ("BiCC+RCC (paper)", ["bicc=on", "rcc=on"]),
                            ("BiCC+RCC, delta from the update", ["bicc=on", "rcc=on", "train.delta_from_update=true"]),
                            ("BiCC+RCC, pi_old from the sampler", ["bicc=on", "rcc=on", "rollout.old_from_sampler=true"])):
        cfg = compose_cfg(["experiment=paper_qwen3_4b", "diag.every=0", *overrides])
        plan = StepPlan.from_config(cfg, cfg.rollout.old_from_sampler)
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
