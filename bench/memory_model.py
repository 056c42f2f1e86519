"""Per-GPU peak memory of a paper-scale run, phase by phase, from the model's shape and the preset.

    .venv/bin/python -m bench.memory_model                 # the table for paper_qwen3_4b and paper_phi4_mini
    .venv/bin/python -m bench.memory_model --validate      # + the model against measured CPU peaks at two sizes

What is counted, term by term: ``bicc/machine/memory.py`` (the same model checks at launch that a run fits its GPU).

``--validate`` builds a Qwen3 of two small sizes on this CPU (fp32, W = 1, activation checkpointing),
runs forward/backward and AdamW steps through the project's own log-prob code, and compares the measured
peak resident memory of each phase (VmHWM, reset between phases; fixed mmap threshold so freed tensors
leave the process) with this model's prediction for the same sizes; and one log-prob head chunk in bf16, eager and
compiled (``measure_head``: no grad, and the update's with the entropy), bytes per logit against the model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import asdict

from bicc.machine.memory import GIB, PHI4_MINI, QWEN3_4B, Arch, Run, peak, phases, prefix_tokens
from bicc.trainer.fit import resolve_checkpoint_layers


def print_table(title: str, arch: Arch, run: Run) -> float:
    print(f"\n{title}: {arch.params() / 1e9:.2f}B parameters, {run.world} GPUs x {run.gpu_gib:.0f} GiB, "
          f"micro-batch {run.micro_batch} x {run.output_tokens} output tokens, BiCC {'on' if run.bicc else 'off'}")
    for name, parts in phases(arch, run).items():
        print(f"  {name:<30} {sum(parts.values()) / GIB:7.2f} GiB")
        for part, value in parts.items():
            if value:
                print(f"      {part:<46} {value / GIB:7.2f}")
    name, value = peak(arch, run)
    print(f"  peak: {value / GIB:.2f} GiB ({name})")
    return value / GIB


CONTEXTS = "BiCC contexts (inputs, K/V, K/V gradient)"
UNCHECKED = "uncheckpointed layers' activations (model.checkpoint_layers)"


def auto_bounds(arch: Arch, run: Run) -> dict[str, float]:
    """``model.checkpoint_layers=auto`` for ``run`` compiled: the layers it checkpoints, the FLOPs an update then runs
    per layer parameter and token (6, and 1.5 more where a layer's forward is recomputed: every projection but the
    MLP's down one), and at its peak the GiB of the two terms that grow with each layer kept: BiCC's contexts, held
    through the minibatch, and the micro-batch's own."""
    run = dataclasses.replace(run, compiled=True)
    n = resolve_checkpoint_layers(arch, run, run.gpu_gib)
    tight = dataclasses.replace(run, checkpoint_layers=n)
    parts = phases(arch, tight)[peak(arch, tight)[0]]
    return {"checkpointed": n, "flops": 6 + 1.5 * n / arch.layers, "contexts": parts.get(CONTEXTS, 0) / GIB,
            "micro-batch": parts.get(UNCHECKED, 0) / GIB}


def print_auto_bounds(name: str, arch: Arch) -> None:
    """What bounds the layers ``auto`` keeps in a preset, and what a smaller micro-batch or fewer contexts held would
    buy (predictions: ``auto``'s trade has not run on a GPU at the presets' width)."""
    for label, run in [(f"train.micro_batch_size={m}", Run(micro_batch=m)) for m in (8, 4, 2, 1)] + [
            ("2 contexts held (one query's; the preset holds 16)", Run(contexts=2))]:
        b = auto_bounds(arch, run)
        print(f"{name} auto, compiled, {label}: {b['checkpointed']} of {arch.layers} layers checkpointed, "
              f"{b['flops']:.2f} FLOPs a layer parameter and token; at the peak the contexts' activations "
              f"{b['contexts']:.1f} GiB, the micro-batch's kept layers' {b['micro-batch']:.1f} GiB")


def step_seconds(arch: Arch, run: Run, mean_output: int, sequences: int = 64, peak_tflops: float = 989.0,
                 mfu: float = 0.4, hbm_tbps: float = 3.35) -> dict[str, float]:
    """Arithmetic estimate of one step's phases on one GPU (H100 SXM figures by default), not a measurement:
    the trainer's passes at ``mfu`` of peak bf16 FLOP/s (2N FLOPs per token forward plus attention, backward
    twice that, checkpointing one more forward), the rollout as vLLM decode at the memory-bandwidth
    roofline (every decode step reads the weights and the KV cache once), ``sequences`` outputs per GPU."""
    n, hq = arch.params(), arch.heads * arch.head_dim
    prefix = prefix_tokens(run)
    out_tokens = sequences * mean_output

    def forward_flops(tokens: int, context: int) -> float:
        return tokens * (2 * n + 4 * arch.layers * hq * context)

    plain = forward_flops(out_tokens + sequences * run.prompt_tokens, run.prompt_tokens + mean_output // 2)
    conditioned = forward_flops(out_tokens + 2 * (sequences // 8) * prefix, prefix + mean_output // 2)
    rate = peak_tflops * 1e12 * mfu
    kv_bytes_per_token = arch.layers * 2 * arch.kv_heads * arch.head_dim * run.compute_bytes
    decode = sum((run.compute_bytes * n + sequences * (run.prompt_tokens + t) * kv_bytes_per_token) / (hbm_tbps * 1e12)
                 for t in range(mean_output))
    phases = {"rollout (vLLM decode, roofline)": decode, "pi_old on q (no grad)": plain / rate}
    if run.reference:
        phases["pi_ref on q (no grad)"] = plain / rate
    if run.no_grad_on_context:
        phases["a no-grad pass on x^c (pi_old there, or RCC's delta on x^c)"] = conditioned / rate
    phases["update (forward + recompute + backward)"] = 4 * (conditioned if run.bicc else plain) / rate
    return phases


# ---- validation on this CPU ----------------------------------------------------------------------------

SIZES = [  # (arch, micro-batch, tokens per row, head chunk): fp32, one process, checkpointing on
    (Arch(hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, intermediate=1152, vocab=32000, tied=True), 8, 384, 512),
    (Arch(hidden=768, layers=4, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=48000, tied=True), 4, 768, 1024),
]


def measure(arch: Arch, micro_batch: int, tokens: int, chunk: int) -> dict[str, float]:
    """Peak resident bytes above the pre-model baseline, per phase, in this (fresh) process."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bicc.model.logprobs import install_logprob_head, token_logprobs
    from bicc.trainer.optim import build_optimizer

    torch.manual_seed(0)
    ids = torch.randint(0, arch.vocab, (micro_batch, tokens))
    mask, pos = torch.ones_like(ids), torch.arange(tokens).expand(micro_batch, tokens)
    base = _resident("VmRSS")
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=arch.vocab, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
                                         num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
                                         head_dim=arch.head_dim, intermediate_size=arch.intermediate,
                                         tie_word_embeddings=arch.tied, max_position_embeddings=tokens + 1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    install_logprob_head(model, chunk)
    optimizer = build_optimizer(model, 1e-4, (0.9, 0.999), 0.01)

    def update():
        logp, _ = token_logprobs(model, ids, mask, pos, tokens - 1, with_entropy=True)
        (-logp.mean()).backward()

    update()
    optimizer.step()  # the moments exist from here on, as in every later step
    optimizer.zero_grad(set_to_none=True)
    out = {}
    update()  # a minibatch's first micro-batch; the model counts a later one's, beside the gradients held
    _reset_peak()
    update()
    out["update"] = _resident("VmHWM") - base
    _reset_peak()
    optimizer.step()
    out["optimizer step"] = _resident("VmHWM") - base
    return out


def predict(arch: Arch, micro_batch: int, tokens: int, chunk: int) -> dict[str, float]:
    run = Run(world=1, micro_batch=micro_batch, output_tokens=tokens, prompt_tokens=0, bicc=False, reference=False,
              chunk_tokens=chunk, compute_bytes=4, sharded=False, vllm=False, runtime_gib=0.0, fragmentation=0.0)
    table = {name: sum(parts.values()) for name, parts in phases(arch, run).items()}
    return {"update": max(table["update: head backward"], table["update: layers backward"]),
            "optimizer step": table["optimizer step"]}


HEAD_SIZE = (512, 32_768, 32)  # a chunk's tokens, the vocabulary, the hidden size: [n, V] buffers of 64 MiB in fp32


def measure_head(compiled: bool, dtype: str) -> dict[str, float]:
    """Peak resident bytes per logit of one log-prob head chunk (``bicc.model.head``, of ``HEAD_SIZE``) above what was
    resident before it, in this (fresh) process: a no-grad chunk without the entropy (a no-grad pass's) and a chunk
    kept for its backward with the entropy, forward and backward (the update's); eager, or compiled as
    ``model.compile`` compiles it (``bicc.kernels.compile.compile_head``; the first calls compile, the measured ones reuse)."""
    import torch

    from bicc.kernels.compile import compile_head
    from bicc.model.head import ChunkLogprobs, LogprobHead

    n, vocab, hidden = HEAD_SIZE
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(getattr(torch, dtype))
    head.__class__ = LogprobHead
    holder = torch.nn.Module()
    holder.get_output_embeddings = lambda: head
    if compiled:
        compile_head(holder, "inductor")
    h = torch.randn(n, hidden, dtype=head.weight.dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    call = head if compiled else None

    def no_grad():
        with torch.no_grad():
            ChunkLogprobs.apply(h, head.weight, None, targets, 1.0, False, False, call)

    def update():
        logp, _ = ChunkLogprobs.apply(h, head.weight, None, targets, 1.0, True, True, call)
        logp.sum().backward()
        h.grad = head.weight.grad = None

    def matmul():  # the chunk's product alone: what the host's GEMM holds beside its output
        with torch.no_grad():
            torch.nn.functional.linear(h, head.weight)

    out = {}
    for name, fn in (("matmul", matmul), ("no-grad log-probs", no_grad), ("update", update)):
        fn()  # compiles where compiled
        base = _resident("VmRSS")
        _reset_peak()
        fn()
        out[name] = (_resident("VmHWM") - base) / (n * vocab)
    return out


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def head_expected(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """What each of ``measure_head``'s phases should peak at on this host: the memory model's count, or the chunk's
    bare matmul's own peak (``measured["matmul"]``) where that is more. A CPU without native bf16 arithmetic computes a
    bf16 product in an fp32 buffer, 4 bytes a logit beside the 2 of its output, for the product's duration; the
    model counts tensors, and a GPU's GEMM keeps no such buffer."""
    return {phase: max(value, measured["matmul"]) for phase, value in predicted.items()}


def predict_head(compiled: bool, dtype: str) -> dict[str, float]:
    """``bicc.machine.memory``'s head chunk per logit for ``measure_head``'s chunk: no grad, and the update's."""
    n, vocab, hidden = HEAD_SIZE
    arch = Arch(hidden=hidden, layers=1, heads=1, kv_heads=1, head_dim=hidden, intermediate=hidden, vocab=vocab, tied=True)
    run = Run(world=1, micro_batch=1, output_tokens=n, prompt_tokens=0, bicc=False, reference=False, chunk_tokens=n,
              compute_bytes=4 if dtype == "float32" else 2, sharded=False, vllm=False, compiled=compiled)
    table = phases(arch, run)
    return {"no-grad log-probs": table["no-grad log-probs"]["log-prob head chunk"] / (n * vocab),
            "update": table["update: head backward"]["log-prob head chunk"] / (n * vocab)}


def head_in_a_process(compiled: bool, dtype: str) -> dict[str, float]:
    """``measure_head`` in a fresh process whose allocator returns freed buffers to the system at once."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "bench.memory_model", "--measure-head", json.dumps([compiled, dtype])],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def validate() -> float:
    worst = 0.0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    for arch, mb, tokens, chunk in SIZES:
        proc = subprocess.run([sys.executable, "-m", "bench.memory_model", "--measure",
                               json.dumps([asdict(arch), mb, tokens, chunk])], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        predicted = predict(arch, mb, tokens, chunk)
        print(f"\nCPU, {arch.params() / 1e6:.0f}M parameters, micro-batch {mb} x {tokens} tokens, chunk {chunk}:")
        for phase in predicted:
            err = predicted[phase] / measured[phase] - 1
            worst = max(worst, abs(err))
            print(f"  {phase:<16} predicted {predicted[phase] / 2**20:8.1f} MiB, measured {measured[phase] / 2**20:8.1f} MiB "
                  f"({100 * err:+.1f}%)")
    n, vocab, _ = HEAD_SIZE
    print(f"\nCPU, one log-prob head chunk of {n} tokens x {vocab} logits, bytes per logit:")
    for compiled in (False, True):
        measured = head_in_a_process(compiled, "bfloat16")
        predicted = head_expected(predict_head(compiled, "bfloat16"), measured)
        if not compiled:
            print(f"  the chunk's bf16 matmul alone: {measured['matmul']:5.2f} (its output 2; more is the host's GEMM)")
        for phase in predicted:
            err = predicted[phase] / measured[phase] - 1
            worst = max(worst, abs(err))
            print(f"  bf16 {'compiled' if compiled else 'eager   '} {phase:<18} predicted {predicted[phase]:5.2f}, "
                  f"measured {measured[phase]:5.2f} ({100 * err:+.1f}%)")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--validate", action="store_true", help="compare with measured CPU peaks at two sizes")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--measure-head", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_head:
        print(json.dumps(measure_head(*json.loads(args.measure_head))))
        return
    if args.measure:
        arch, mb, tokens, chunk = json.loads(args.measure)
        print(json.dumps(measure(Arch(**arch), mb, tokens, chunk)))
        return
    qwen = print_table("paper_qwen3_4b (rollout=vllm, bicc=on rcc=on)", QWEN3_4B, Run())
    phi = print_table("paper_phi4_mini (rollout=vllm, bicc=on rcc=on)", PHI4_MINI, Run())
    for name, arch in (("paper_qwen3_4b", QWEN3_4B), ("paper_phi4_mini", PHI4_MINI)):
        for policy, what in (("save_attention", "attention kept"), ("recompute_mlp", "the attention block kept")):
            phase, value = peak(arch, Run(checkpoint_policy=policy))
            print(f"{name} with model.checkpoint_policy={policy} ({what} through the recompute): "
                  f"peak {value / GIB:.2f} GiB ({phase})")
        for compiled in (False, True):  # model.checkpoint_layers=auto on 80 GiB GPUs
            run = Run(compiled=compiled)
            n = resolve_checkpoint_layers(arch, run, run.gpu_gib)
            phase, value = peak(arch, dataclasses.replace(run, checkpoint_layers=n))
            print(f"{name} with model.checkpoint_layers=auto{' model.compile=on' if compiled else ''}: {n} of "
                  f"{arch.layers} layers checkpointed, peak {value / GIB:.2f} GiB ({phase})")
        print_auto_bounds(name, arch)
        hf = Run(vllm=False, eval_vllm=False)
        evaluation = sum(phases(arch, hf)["evaluation"].values())
        print(f"{name} with rollout=hf: evaluation {evaluation / GIB:.2f} GiB (HF generate, eval.batch_tokens="
              f"{hf.eval_batch_tokens}), peak {peak(arch, hf)[1] / GIB:.2f} GiB ({peak(arch, hf)[0]})")
    for mean_output in (1000, 2048):
        times = step_seconds(QWEN3_4B, Run(), mean_output)
        print(f"\npaper_qwen3_4b step estimate, outputs of {mean_output} tokens on average (arithmetic, H100, 40% MFU):")
        for name, seconds in times.items():
            print(f"  {name:<44} {seconds:6.1f} s")
        print(f"  {'total':<44} {sum(times.values()):6.1f} s")
    if args.validate:
        worst = validate()
        print(f"RESULT memory_model_max_error={worst:.3f} target<=0.15")
    print(f"RESULT paper_phi4_mini_peak_gib={phi:.1f} target<=72")
    print(f"RESULT paper_qwen3_4b_peak_gib={qwen:.1f} target<=72")


if __name__ == "__main__":
    main()
