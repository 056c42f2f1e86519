"""``rollout=hf``'s generate with a growing KV cache against a static one (``rollout.static_cache``), in one run.

    .venv/bin/python -m bench.hf_generate                  # CPU: cpu_small at 2 layers, 4 x 4 rows of 32 tokens
    python -m bench.hf_generate                            # CUDA: Qwen3-0.6B's shape, 8 prompts x 8 of 1,024 tokens

The engine is ``bicc.rollout.hf.HFEngine`` as training builds it beside a sharded policy: a copy of the policy in
the compute dtype (``bicc.model.load.compute_copy``: bf16 on CUDA, fp32 on CPU), sampling at the training settings
(T 1.0, top-p 1.0) from ``--prompts`` random prompts of ``--prompt-tokens`` tokens, G = ``--n`` outputs each, up to
``--tokens`` new tokens, every row in one generate call. The weights are random, so outputs rarely end early; the
rates count the tokens each call produced. Each cache form runs one warm-up call (on CUDA transformers compiles
the static cache's decoding step in it, printed), then ``--repeats`` timed calls, the median kept. Prints

- ``RESULT hf_tokens_per_s=`` and ``RESULT hf_static_tokens_per_s=`` (output tokens per second of each form);
- ``RESULT hf_static_vs_dynamic=`` (their ratio);
- the share of rows both forms sampled alike (the same seed; a difference in the kernels' rounding can flip a
  sample, so this is reported, not required).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from bench.update_vs_bare import SHAPES, make_rows, synchronize

END_ID = 2  # the random model's end token; its sampling probability is about 1 / vocab per step


class _Tokenizer:
    """What the engine reads of a tokenizer: a pad id and ``batch_decode`` (random ids decode to nothing here)."""

    pad_token_id = 0
    eos_token_id = END_ID

    def batch_decode(self, ids, **_) -> list[str]:
        return [""] * len(ids)


def build_sampler(arch: dict, device: torch.device):
    """A random Qwen3 of shape ``arch`` copied to the compute dtype as ``bicc.trainer.state`` copies the sampler."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bicc.model.load import compute_copy

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**arch, pad_token_id=0, eos_token_id=END_ID))
    model.config._attn_implementation = "sdpa"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return compute_copy(model, SimpleNamespace(dtype=dtype)).eval()


def run_form(engine, prompts, sampling, device, repeats: int, label: str):
    """(output tokens per second, the median of ``repeats`` calls after a warm-up; the last call's output); prints
    the warm-up's time too."""
    times, out = [], None
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    tokens = sum(map(len, out.completion_ids))
    print(f"[hf_generate] {label}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} tokens/s), its warm-up "
          f"call {times[0]:.1f} s", flush=True)
    return tokens / seconds, out


def main() -> None:
    from bicc.config import RolloutConfig
    from bicc.rollout import EngineOptions, SamplingParams, build_engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: cpu_small on CPU, qwen3_0.6b on CUDA")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count (CPU default: 2)")
    parser.add_argument("--prompts", type=int, default=None, help="default: 4 on CPU, 8 on CUDA")
    parser.add_argument("--n", type=int, default=None, help="outputs per prompt; default: 4 on CPU, 8 on CUDA")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=None, help="most new tokens; default: 32 on CPU, 1,024 on CUDA")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    arch = dict(SHAPES[args.shape or ("qwen3_0.6b" if cuda else "cpu_small")])
    arch["num_hidden_layers"] = args.layers or (arch["num_hidden_layers"] if cuda else 2)
    prompts_n, n = args.prompts or (8 if cuda else 4), args.n or (8 if cuda else 4)
    tokens = args.tokens or (1024 if cuda else 32)
    prompts = make_rows(prompts_n, 1, args.prompt_tokens, 2, arch["vocab_size"])[0]
    sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=0)
    sampler = build_sampler(arch, device)
    print(f"[hf_generate] {device.type}, {arch['num_hidden_layers']} layers x {arch['hidden_size']}, vocab "
          f"{arch['vocab_size']}, {next(sampler.parameters()).dtype}; {prompts_n} prompts x {n} outputs of <= {tokens} "
          f"tokens; torch {torch.__version__}", flush=True)
    options = EngineOptions(end_ids=(END_ID,))
    results = {}
    for static in (False, True):
        cfg = RolloutConfig(engine="hf", batch_size=prompts_n * n, static_cache=static)
        engine = build_engine("hf", sampler, _Tokenizer(), cfg, options)
        results[static] = run_form(engine, prompts, sampling, device, args.repeats, f"{engine.cache or 'growing'} cache")
    (rate, out), (static_rate, static_out) = results[False], results[True]
    alike = sum(a == b for a, b in zip(out.completion_ids, static_out.completion_ids))
    print(f"[hf_generate] rows sampled alike by both forms: {alike} of {prompts_n * n}")
    print(f"RESULT hf_tokens_per_s={rate:.1f}")
    print(f"RESULT hf_static_tokens_per_s={static_rate:.1f}")
    print(f"RESULT hf_static_vs_dynamic={static_rate / rate:.3f}")


if __name__ == "__main__":
    main()
