"""The log-prob head against its own matmuls: eager, compiled (``model.compile``), and on CUDA Liger-Kernel's fused
linear cross-entropy where it is installed, forward + backward over one micro-batch of tokens.

    .venv/bin/python -m bench.head_speed                        # CPU: the CPU bench's head (H 256, V 32,768, fp32)
    python -m bench.head_speed --shape qwen3_4b_width           # CUDA: H 2,560, V 151,936, bf16

Each variant computes log p(target) at ``--tokens`` positions from hidden states [n, H] and the head's weight
[V, H] (bf16 on CUDA, as FSDP2 computes; fp32 on CPU) and the gradients of sum(w log p) for both: ``kept`` is one
chunk (a micro-batch within ``train.logprob_chunk_tokens``: its softmax kept for the backward), ``recomputed``
the same tokens in ``--chunks`` chunks (each recomputed in the backward). The yardstick is the three matmuls
alone (the logits, dh, dW). Liger's ``reduction="none"`` gives each token's cross-entropy, -log p; it recomputes
the logits in its backward, as ``recomputed`` does. Prints, each the median of ``--iters`` timed calls:

- ``RESULT head_eager_vs_matmul=`` and ``RESULT head_compiled_vs_matmul=`` (the kept head's time over its
  matmuls'; the compiled one's target <= 1.3 on CUDA: the head costs its matmuls);
- ``RESULT head_compiled_vs_eager=`` (the eager kept head's time over the compiled one's: its speed-up);
- on CUDA with ``liger_kernel``: ``RESULT head_liger_vs_compiled=`` (the compiled recomputed head's time over
  Liger's: above 1, Liger is faster) and the largest difference of its log-probs from ours.

Every variant's log-probs and weight gradient are checked against the eager kept head's before any timing.
"""

from __future__ import annotations

import argparse

import torch

from bench.update_vs_bare import SHAPES, timed


def variants(device: torch.device, chunks: int, backend: str = "inductor"):
    """name -> fn(hidden, weight, targets) -> log-probs [n], each through the project's head or Liger's."""
    import types

    from bicc.kernels.compile import compile_head
    from bicc.model.head import ChunkLogprobs

    compiled = torch.nn.Linear(1, 1)  # what ChunkLogprobs reads of a head: compile_head's marks
    compile_head(types.SimpleNamespace(get_output_embeddings=lambda: compiled), backend)

    def ours(head, k: int):
        def run(hidden, weight, targets):
            return torch.cat([ChunkLogprobs.apply(h, weight, None, t, 1.0, k == 1, False, head)[0]
                              for h, t in zip(hidden.chunk(k), targets.chunk(k))])
        return run

    out = {"eager kept": ours(None, 1), "compiled kept": ours(compiled, 1),
           "eager recomputed": ours(None, chunks), "compiled recomputed": ours(compiled, chunks)}
    if device.type == "cuda":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError:
            print("[head_speed] liger_kernel is not installed: its row is skipped")
        else:
            out["liger"] = lambda hidden, weight, targets: -liger_fused_linear_cross_entropy(
                hidden, weight, targets, reduction="none", accum_dtype=torch.float32)
    return out


def main() -> None:
    from bicc.machine.host import torch_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: cpu_small on CPU, qwen3_4b_width on CUDA")
    parser.add_argument("--tokens", type=int, default=None, help="default: 2,048 on CPU, 8,192 on CUDA")
    parser.add_argument("--chunks", type=int, default=4, help="the recomputed variants' chunks")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="the compiled forms' torch.compile backend (aot_eager: "
                        "Dynamo's and AOT autograd's trace over eager kernels, no code generation)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(torch_threads(0))
    arch = SHAPES[args.shape or ("qwen3_4b_width" if device.type == "cuda" else "cpu_small")]
    n, H, V = args.tokens or (8192 if device.type == "cuda" else 2048), arch["hidden_size"], arch["vocab_size"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, H, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=gen) / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (n,), device=device, generator=gen)
    w = torch.randn(n, device=device, generator=gen)
    print(f"[head_speed] {device.type}, {n} tokens x H {H} -> V {V}, {dtype}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)

    def step(fn):
        hidden.grad = weight.grad = None
        logp = fn(hidden, weight, targets)
        (logp * w).sum().backward()
        return logp

    fns = variants(device, args.chunks, args.backend)
    want = step(fns["eager kept"]).detach()
    want_grad = weight.grad.float().clone()
    for name, fn in fns.items():  # each variant's values, before any timing (the compiled ones compile here)
        got = step(fn).detach()
        value_err = (got.float() - want.float()).abs().max().item()
        grad_err = ((weight.grad.float() - want_grad).abs().max() / want_grad.abs().max()).item()
        print(f"[head_speed] {name}: log-probs within {value_err:.2e} of the eager kept head's, dW within "
              f"{grad_err:.2e} of its largest")
        assert value_err < (2e-2 if dtype == torch.bfloat16 else 1e-4) and grad_err < 2e-2, name

    def matmuls():
        with torch.no_grad():
            z = hidden @ weight.T
            z @ weight, z.T @ hidden

    seconds = {name: timed(lambda fn=fn: step(fn), device, args.iters) for name, fn in fns.items()}
    seconds["matmuls"] = timed(matmuls, device, args.iters)
    for name, s in seconds.items():
        print(f"[head_speed] {name:<20} {s * 1e3:9.2f} ms ({n / s:,.0f} tokens/s)")
    cuda = device.type == "cuda"
    print(f"RESULT head_eager_vs_matmul={seconds['eager kept'] / seconds['matmuls']:.3f}")
    print(f"RESULT head_compiled_vs_matmul={seconds['compiled kept'] / seconds['matmuls']:.3f}"
          + (" target<=1.3" if cuda else ""))
    print(f"RESULT head_compiled_vs_eager={seconds['eager kept'] / seconds['compiled kept']:.3f}")
    if "liger" in seconds:
        print(f"RESULT head_liger_vs_compiled={seconds['compiled recomputed'] / seconds['liger']:.3f}")


if __name__ == "__main__":
    main()
