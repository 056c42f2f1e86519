"""Per-GPU peak memory of a paper-scale run, phase by phase, from the model's shape and the preset.

    .venv/bin/python -m bench.memory_model                 # the table for paper_qwen3_4b and paper_phi4_mini
    .venv/bin/python -m bench.memory_model --validate      # + the model against measured CPU peaks at two sizes

What is counted (bytes per GPU; N parameters, W ranks, b = compute bytes, 4 = master bytes):

- sharded policy (FSDP2): fp32 master weights 4N/W, fp32 gradients 4N/W (update and optimizer step only),
  AdamW moments 8N/W, and the optimizer step's foreach temporaries (two parameter-sized fp32 buffers / W);
- FSDP2's gathered compute copies: the root's (embeddings, head) for the whole pass, two decoder layers
  at a time (the current one and the prefetched one), and one layer's unsharded gradient in backward;
- the frozen reference: a full copy in the compute dtype on every rank (RCC's delta needs it);
- vLLM: awake during the rollout at ``gpu_memory_utilization`` x the GPU's memory, asleep (level 2:
  weights and KV cache dropped) during the update; the gradients are freed after the optimizer step, but
  FSDP2 leaves the root (embeddings, head) gathered after the last no-grad forward, through the rollout;
- FSDP2's fp32 reduce-scatter (``dist.reduce_dtype``): each layer's unsharded gradient cast to fp32 before it
  is reduced, and the root's at the end of the backward (a V x H fp32 copy);
- evaluation: through vLLM as in the rollout, or through HF generate in calls of ``eval.batch_tokens`` rows x
  (prompt + new tokens): their KV cache, the sampling logits and a layer's prefill;
- a runtime of 2.5 GiB (CUDA context, cuBLAS workspaces, NCCL buffers) and 10% allocator fragmentation on
  the tensors counted;
- activations of a micro-batch under activation checkpointing: every layer's input kept for the backward
  (tokens x H x b per layer), one layer's recomputed activations at a time (per token: 3H + 6Hq + 6Hkv + 4I
  values, plus fp32 copies in the RMSNorms when b < 4), counted at the backward's worst layer, where the
  gradients already produced and the inputs not yet released meet;
- the chunked log-prob head: about four chunk x V fp32 buffers (logits, their log-softmax / exp for the
  entropy, the gradient), plus the chunk's compute-dtype logits when b < 4; in its backward, the head's
  V x H weight gradient and each chunk's contribution to it;
- ``rcc.delta_from_update`` (false in the presets): the update's forwards all run before its backwards, so at
  the first backward every other micro-batch's checkpointed layer inputs, gathered context K/V and final
  hidden states are still held;
- BiCC's KV-reuse packing: the step's distinct contexts (two per group, this GPU's share) computed once per
  minibatch and held through all of its micro-batches: their checkpointed layer inputs, their keys/values
  in every layer and the gradient that the micro-batches leave on those; each completion's gathered copy of
  its context's keys and values, held for its micro-batch's backward; at the end, one backward through the
  context forward (one recomputed layer over all context tokens).

The peak of a phase is the sum of what is alive in it; the run's peak is the largest phase. Attention is
assumed to be flash-attention 2 (no T x T scores kept); SDPA with a padding mask adds the repeated K/V
(2 x Hq per token per recomputed layer).

``--validate`` builds a Qwen3 of two small sizes on this CPU (fp32, W = 1, activation checkpointing),
runs forward/backward and AdamW steps through the project's own log-prob code, and compares the measured
peak resident memory of each phase (VmHWM, reset between phases; fixed mmap threshold so freed tensors
leave the process) with this model's prediction for the same sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's shape (Qwen3 / Phi-3 layout: GQA attention, gated MLP)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    def layer_params(self) -> int:
        h, hq, hkv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * hq + 2 * h * hkv + hq * h + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


# Shapes from the models' config.json (Qwen/Qwen3-4B-Instruct-2507, microsoft/Phi-4-mini-instruct).
QWEN3_4B = Arch(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tied=True)
PHI4_MINI = Arch(hidden=3072, layers=32, heads=24, kv_heads=8, head_dim=128, intermediate=8192, vocab=200064, tied=True)


@dataclass(frozen=True)
class Run:
    """What of the preset sizes memory (conf/experiment/paper_*.yaml, conf/rollout/vllm.yaml)."""

    world: int = 4
    micro_batch: int = 8  # train.micro_batch_size
    output_tokens: int = 2048  # rollout.max_new_tokens (the worst case: every output at the limit)
    prompt_tokens: int = 300  # a long DAPO-Math prompt in the chat template
    context_ratio: float = 0.4  # bicc.context_ratio: the opposite attempts' budget
    bicc: bool = True
    contexts: int = 16  # distinct contexts per GPU: rollout.prompts_per_step x 2 sides / world
    reference: bool = True  # RCC's delta (or a KL term) loads the frozen reference
    chunk_tokens: int = 1024  # train.logprob_chunk_tokens
    vllm_utilization: float = 0.4  # rollout.gpu_memory_utilization
    gpu_gib: float = 80.0
    compute_bytes: int = 2  # bf16
    rows: int = 64  # this GPU's sequences per step: rollout.prompts_per_step x G / world
    delta_from_update: bool = False  # rcc.delta_from_update: every micro-batch's graph held until the advantages
    master_bytes: int = 4  # fp32
    sharded: bool = True
    vllm: bool = True
    runtime_gib: float = 2.5  # CUDA context, cuBLAS workspaces, NCCL buffers: 2-3 GiB on H100 (not measured here)
    fragmentation: float = 0.10  # the caching allocator's reserved-over-allocated, on the tensors counted
    eval_vllm: bool = True  # evaluation through vLLM (the presets), else HF generate under eval.batch_tokens
    eval_batch_tokens: int = 131_072  # eval.batch_tokens (conf/eval/paper.yaml): rows x (prompt + new tokens)
    eval_new_tokens: int = 4096  # eval.max_new_tokens
    eval_rows: int = 0  # rows there are to evaluate at most (eval.limit x samples per problem); 0 = no fewer than fit


def _layer_bytes_per_token(arch: Arch, b: int) -> int:
    """Bytes of one recomputed layer's activations per token."""
    h, hq, hkv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    per_token = (3 * h + 6 * hq + 6 * hkv + 4 * arch.intermediate) * b
    if b < 4:  # RMSNorm computes in fp32: input and normalised copies of the two layer norms and q/k norms
        per_token += 8 * (2 * h + hq + hkv)
    return per_token


def _activations(arch: Arch, run: Run) -> tuple[int, int, int, int]:
    """(tokens in a micro-batch's forward, bytes of one recomputed layer, bytes of the micro-batch's gathered
    context K/V, context tokens held per minibatch)."""
    b, hkv = run.compute_bytes, arch.kv_heads * arch.head_dim
    prefix = run.prompt_tokens + (int(run.context_ratio * run.output_tokens) if run.bicc else 0)
    # KV-reuse packing: the contexts are computed apart, once per minibatch (bicc.rows.contexts_once)
    tokens = run.micro_batch * run.output_tokens if run.bicc else run.micro_batch * (run.output_tokens + run.prompt_tokens)
    kv = run.micro_batch * prefix * arch.layers * 2 * hkv * b if run.bicc else 0
    return tokens, tokens * _layer_bytes_per_token(arch, b), kv, (run.contexts * prefix if run.bicc else 0)


def phases(arch: Arch, run: Run) -> dict[str, dict[str, float]]:
    """Bytes alive in each phase, by component."""
    n, w, b = arch.params(), run.world if run.sharded else 1, run.compute_bytes
    master = run.master_bytes * n / w
    adam = 2 * 4 * n / w
    grads = 4 * n / w
    static = {"policy master weights (fp32, sharded)": master, "AdamW moments (sharded)": adam}
    if run.reference:
        static["reference (full, compute dtype)"] = b * n
    static["runtime"] = run.runtime_gib * GIB
    gathered = {}
    if not run.sharded and b < run.master_bytes:  # one process, autocast: compute-dtype copies of the weights
        gathered = {"autocast weight copies (compute dtype)": b * n}
    if run.sharded:
        gathered = {"FSDP2 gathered root (embeddings, head)": b * arch.root_params(),
                    "FSDP2 gathered layers (current + prefetch)": 2 * b * arch.layer_params()}
    tokens, layer_act, prefix_kv, context_tokens = _activations(arch, run)
    context_kv = context_tokens * arch.layers * 2 * arch.kv_heads * arch.head_dim * b
    # held through the minibatch: the context forward's checkpointed inputs, its K/V and their gradient
    contexts = {"BiCC contexts (inputs, K/V, K/V gradient)": context_tokens * arch.layers * arch.hidden * b + 2 * context_kv}
    chunk = min(run.chunk_tokens, tokens)
    head = chunk * arch.vocab * (4 * 4 + (b if b < 4 else 0))
    # the backward's worst layer: gradients of the layers above it done, inputs of the layers below it kept
    inputs_per_layer, grads_per_layer = tokens * arch.hidden * b, 4 * arch.layer_params() / w
    head_grads = 4 * arch.root_params() / w
    # rcc.delta_from_update: at the first backward every other micro-batch's graph is still held
    held = {}
    if run.delta_from_update:
        others = -(-run.rows // run.micro_batch) - 1
        held["other micro-batches' graphs (rcc.delta_from_update)"] = others * (
            arch.layers * inputs_per_layer + prefix_kv + tokens * arch.hidden * b)
    worst = max(range(arch.layers), key=lambda i: (i + 1) * inputs_per_layer + (arch.layers - 1 - i) * grads_per_layer)
    update = {**static, **gathered,
              "gradients so far (fp32, sharded)": head_grads + (arch.layers - 1 - worst) * grads_per_layer,
              "checkpointed layer inputs": (worst + 1) * inputs_per_layer,
              "one layer's recomputed activations": layer_act,
              "BiCC prefix keys/values": prefix_kv, **contexts, **held}
    if run.sharded:
        update["unsharded layer gradient (compute dtype)"] = b * arch.layer_params()
    # the head's weight gradient (unsharded, in the compute dtype, until FSDP2 reduce-scatters it at the end of the
    # root's backward; fp32 in one process) and each chunk's V x H contribution before it is accumulated
    head_grad_bytes = (b if run.sharded else 4) * arch.vocab * arch.hidden
    head_phase = {**static, **gathered, "head weight gradient + one chunk's": 2 * head_grad_bytes,
                  "checkpointed layer inputs": arch.layers * inputs_per_layer,
                  "log-prob head chunk": head, "BiCC prefix keys/values": prefix_kv, **contexts, **held}
    # the contexts' own backward, after the last micro-batch: one recomputed layer over all context tokens
    context_phase = {**static, **gathered, "gradients so far (fp32, sharded)": grads,
                     "BiCC contexts (inputs, K/V, K/V gradient)": contexts and sum(contexts.values()),
                     "one context layer's recomputed activations": context_tokens * _layer_bytes_per_token(arch, b)}
    logprob = {**static, **gathered, "one layer's activations (no grad)": layer_act / 2, "log-prob head chunk": head / 2,
               "BiCC contexts' K/V (no grad)": context_kv}
    if run.sharded:  # reduce_dtype fp32: the unsharded gradient is cast before the reduce-scatter
        update["fp32 reduce-scatter staging (one layer)"] = 4 * arch.layer_params()
    # the root's reduce-scatter, at the end of the backward: its compute-dtype gradient and the fp32 staging copy
    root_phase = {**static, **gathered, "gradients so far (fp32, sharded)": grads - head_grads,
                  "root gradient (compute dtype, unsharded)": b * arch.root_params(),
                  "fp32 reduce-scatter staging (root)": 4 * arch.root_params(), **contexts}
    optimizer = {**static, "gradients (fp32, sharded)": grads, "AdamW step temporaries": 2 * 4 * n / w}
    # FSDP2 keeps the root unsharded after a forward with no backward (the last no-grad pass) until the next one
    awake = {**static, **({"FSDP2 root left gathered": b * arch.root_params()} if run.sharded else {})}
    rollout = dict(awake)
    if run.vllm:
        rollout["vLLM (awake: weights + KV cache)"] = run.vllm_utilization * run.gpu_gib * GIB
    out = {"rollout": rollout, "no-grad log-probs": logprob, "update: head backward": head_phase,
           "update: layers backward": update, "update: contexts backward": context_phase}
    if run.sharded:
        out["update: root reduce-scatter"] = root_phase
    out["optimizer step"] = optimizer
    out["evaluation"] = _evaluation(arch, run, awake, gathered)
    if not run.bicc:
        del out["update: contexts backward"]
    for parts in out.values():  # the caching allocator's slack on what the phase allocates
        tensors = sum(v for k, v in parts.items() if k not in ("runtime", "vLLM (awake: weights + KV cache)"))
        parts["allocator fragmentation"] = run.fragmentation * tensors
    return out


def _evaluation(arch: Arch, run: Run, awake: dict, gathered: dict) -> dict[str, float]:
    """The initial and final evaluation: vLLM's share as in the rollout, or HF generate with calls of at most
    ``eval_batch_tokens`` rows x (prompt + new tokens): their KV cache, the last position's fp32 logits
    (sampling keeps two copies) and one layer's prefill activations."""
    if run.eval_vllm:
        return {**awake, "vLLM (awake: weights + KV cache)": run.vllm_utilization * run.gpu_gib * GIB}
    b = run.compute_bytes
    rows = max(1, run.eval_batch_tokens // (run.prompt_tokens + run.eval_new_tokens))
    rows = min(rows, run.eval_rows) if run.eval_rows else rows
    kv = rows * (run.prompt_tokens + run.eval_new_tokens) * arch.layers * 2 * arch.kv_heads * arch.head_dim * b
    return {**awake, **gathered, "HF generate KV cache (eval.batch_tokens)": kv,
            "sampling logits (fp32, two copies)": 2 * 4 * rows * arch.vocab,
            "one layer's prefill activations": rows * run.prompt_tokens * _layer_bytes_per_token(arch, b) / 2}


def peak(arch: Arch, run: Run) -> tuple[str, float]:
    table = {name: sum(parts.values()) for name, parts in phases(arch, run).items()}
    name = max(table, key=table.get)
    return name, table[name]


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


def step_seconds(arch: Arch, run: Run, mean_output: int, sequences: int = 64, peak_tflops: float = 989.0,
                 mfu: float = 0.4, hbm_tbps: float = 3.35) -> dict[str, float]:
    """Arithmetic estimate of one step's phases on one GPU (H100 SXM figures by default), not a measurement:
    the trainer's passes at ``mfu`` of peak bf16 FLOP/s (2N FLOPs per token forward plus attention, backward
    twice that, checkpointing one more forward), the rollout as vLLM decode at the memory-bandwidth
    roofline (every decode step reads the weights and the KV cache once), ``sequences`` outputs per GPU."""
    n, hq = arch.params(), arch.heads * arch.head_dim
    prefix = run.prompt_tokens + (int(run.context_ratio * run.output_tokens) if run.bicc else 0)
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
    if run.bicc:
        phases["theta_old on x^c for RCC's delta (no grad)"] = conditioned / rate
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

    from bicc.logprobs import install_logprob_head, token_logprobs
    from bicc.optim import build_optimizer

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def reset_peak():
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")

    torch.manual_seed(0)
    ids = torch.randint(0, arch.vocab, (micro_batch, tokens))
    mask, pos = torch.ones_like(ids), torch.arange(tokens).expand(micro_batch, tokens)
    base = rss("VmRSS")
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
    reset_peak()
    update()
    out["update"] = rss("VmHWM") - base
    reset_peak()
    optimizer.step()
    out["optimizer step"] = rss("VmHWM") - base
    return out


def predict(arch: Arch, micro_batch: int, tokens: int, chunk: int) -> dict[str, float]:
    run = Run(world=1, micro_batch=micro_batch, output_tokens=tokens, prompt_tokens=0, bicc=False, reference=False,
              chunk_tokens=chunk, compute_bytes=4, sharded=False, vllm=False, runtime_gib=0.0, fragmentation=0.0)
    table = {name: sum(parts.values()) for name, parts in phases(arch, run).items()}
    return {"update": max(table["update: head backward"], table["update: layers backward"]),
            "optimizer step": table["optimizer step"]}


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
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--validate", action="store_true", help="compare with measured CPU peaks at two sizes")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        arch, mb, tokens, chunk = json.loads(args.measure)
        print(json.dumps(measure(Arch(**arch), mb, tokens, chunk)))
        return
    qwen = print_table("paper_qwen3_4b (rollout=vllm, bicc=on rcc=on)", QWEN3_4B, Run())
    phi = print_table("paper_phi4_mini (rollout=vllm, bicc=on rcc=on)", PHI4_MINI, Run())
    for name, arch in (("paper_qwen3_4b", QWEN3_4B), ("paper_phi4_mini", PHI4_MINI)):
        phase, value = peak(arch, Run(delta_from_update=True))
        print(f"{name} with rcc.delta_from_update=true (the presets keep false): peak {value / GIB:.2f} GiB ({phase})")
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
