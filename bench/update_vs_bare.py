"""Our policy update against a bare transformers loop on the same rows, in one run, on CPU or CUDA.

    .venv/bin/python -m bench.update_vs_bare                     # CPU: a small Qwen3 shape (below)
    python -m bench.update_vs_bare --shape qwen3_0.6b            # CUDA: the rehearsal's shape
    python -m bench.update_vs_bare --shape qwen3_4b_width --layers 12
    python -m bench.update_vs_bare --fsdp --compile --shape qwen3_4b_width --layers fit model.checkpoint_layers=auto

The rows: ``--prompts`` prompts of ``--prompt-tokens`` tokens, G = ``--group`` outputs each, of lengths drawn
evenly in [``--output-tokens`` / 2, ``--output-tokens``] (a reasoning batch is ragged), random token ids.

- **ours**: ``bicc.trainer.update.update_policy`` as a GRPO step runs it (pi_old from the update's own forward, the
  registered loss, micro-batches of ``train.micro_batch_size`` rows and ``train.micro_batch_tokens``, each prompt
  computed once for its G outputs under ``train.share_prompts``, the chunked log-prob head), then AdamW; fp32
  master weights, bf16 compute on CUDA (the presets' setting), fp32 on CPU. ``--fsdp``: wrapped as
  ``torchrun --nproc_per_node=1 train.py`` wraps it (FSDP2 over a one-rank process group, bf16 parameters for
  compute on CUDA), else unwrapped under autocast.
- **bare**: what a user writes in 40 lines: micro-batches of the same rows in order, each one padded row per
  output (prompt included), ``model(...).logits``, a full-vocab fp32 log-softmax and gather, a masked mean,
  backward; then AdamW. The same weights and dtype policy (autocast to bf16 on CUDA), the same activation
  checkpointing.

Both are timed over ``--iters`` updates after one warm-up. Tokens are the rows' real tokens (prompt + output per
row), the same count for both. Prints

- ``RESULT update_vs_bare=<ours tokens/s / bare tokens/s>`` (target >= 1.0 on CPU, >= 1.5 on the H100);
- ``RESULT update_ops_per_token=<aten ops one of our updates launches per 1,000 tokens>`` (``torch.profiler``,
  every ``aten::`` event, nested ones included);
- on CUDA ``RESULT update_gpu_busy_share=`` (the time the GPU runs at least one kernel / the wall time of an update
  profiled with the GPU's activity only, the host's ops not recorded; target >= 0.9) and
  ``RESULT update_mfu=`` (PaLM count: 6 N + 12 x layers x heads x head_dim x T per token, T the mean row length,
  over the device's bf16 peak; target >= 0.40), per token ours computes: under ``train.share_prompts`` each
  distinct prompt counts once, not once per output; and ``RESULT update_hfu=``, the FLOPs the GPU ran over the
  same time and peak: those of one more update as ``torch.utils.flop_counter`` counts them (every matmul and
  attention kernel, the backward's recompute and the padding included; the count is printed on any device). Where
  the MFU falls short and the HFU does not, the FLOPs spent beyond the model's (the recompute that memory asks
  for) are the limit;
- on CUDA ``RESULT update_allocated_vs_model=`` (``torch.cuda.max_memory_allocated`` over ours' timed updates, before
  the bare loop's model is built, over ``bicc.machine.memory``'s allocated bytes for ours here: every output at
  ``--output-tokens``, no reference, no rollout; target 0.9-1.1).

**Depth.** Two models of Qwen3-4B's width and depth, with their AdamW states, do not fit one GPU together.
``--no-bare`` times ours alone (no ``update_vs_bare``). ``--layers fit`` takes the most layers, up to the shape's,
at which ``bicc.machine.memory`` says ours fits ``train.memory_gib`` (else the GPU's memory) as ``model.checkpoint_layers=auto``
fills it (90%), every layer checkpointed; it leaves the bare loop out. ``model.checkpoint_layers=auto`` is resolved
here as ``train.py`` resolves it at launch: the fewest checkpointed layers whose predicted peak fits (on CPU only
under ``train.memory_gib``; else every layer). The log-prob chunk is a micro-batch's outputs (one chunk, kept for its
backward): ``train.logprob_chunk_tokens`` lower leaves room for more layers.

On CUDA it also prints how many times one update makes the host wait for the GPU (``host_syncs``, CUDA's sync debug
mode). ``--top N`` prints the profiled update's N most frequent aten ops and, on CUDA, its N longest kernels, the N
longest stretches between its first and last kernel in which the GPU ran none (the kernels on either side name
where) and the N lines the update waits for the GPU at most often. ``--compile``
compiles ours' decoder layers (``model.compile=on``, ``bicc.kernels.compile``) before the timed calls; the warm-up call pays
the compilation.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections import Counter
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import GIB, PEAK_TFLOPS, QWEN3_06B

SHAPES = {
    # what this bench runs by default on CPU: a Qwen3 of 23M parameters, 32k vocabulary
    "cpu_small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=768, vocab_size=32_768, tie_word_embeddings=True, max_position_embeddings=4096),
    # Qwen3-4B's proportions at a quarter of its width, a small vocabulary: the layers' matmuls, not the head's,
    # set the update's time on a CPU (what the checkpoint policies change)
    "cpu_quarter_4b": dict(hidden_size=640, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=128, intermediate_size=2432, vocab_size=8192, tie_word_embeddings=True,
                           max_position_embeddings=4096),
    "qwen3_0.6b": QWEN3_06B,
    # Qwen3-4B's width (--layers sets how many layers: as many as fit one GPU)
    "qwen3_4b_width": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=9728, vocab_size=151_936, tie_word_embeddings=True,
                           max_position_embeddings=40_960),
}


def make_rows(prompts: int, group: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int = 0):
    """(prompt ids, output ids) per row: G rows per prompt, outputs of lengths even in [L/2, L]."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids, completion_ids = [], []
    for _ in range(prompts):
        prompt = torch.randint(4, vocab, (prompt_tokens,), generator=gen).tolist()
        for _ in range(group):
            n = int(torch.randint(output_tokens // 2, output_tokens + 1, (1,), generator=gen))
            prompt_ids.append(prompt)
            completion_ids.append(torch.randint(4, vocab, (n,), generator=gen).tolist())
    return prompt_ids, completion_ids


def update_cfg(prompt_tokens: int, output_tokens: int, micro_rows: int, checkpointing: bool, overrides=()):
    """Our update's config here: a GRPO step, micro-batches of ``micro_rows`` rows (and their tokens at the longest),
    one log-prob chunk per micro-batch's outputs, then ``overrides``; ``model.gradient_checkpointing`` as ``build``
    sets it up (``bicc.machine.memory`` reads it)."""
    from bench.common import compose_cfg

    cfg = compose_cfg(["algo=grpo", "bicc=off", "rcc=off", f"rollout.max_new_tokens={output_tokens}",
                       f"train.micro_batch_size={micro_rows}",
                       f"train.micro_batch_tokens={micro_rows * (prompt_tokens + output_tokens)}",
                       f"train.logprob_chunk_tokens={micro_rows * output_tokens}", *overrides])
    cfg.model.gradient_checkpointing = checkpointing
    return cfg


def memory_arch(arch: dict, layers: int | None = None):
    """``bicc.machine.memory``'s shape of ``arch`` (an HF config's fields, read by ``bicc.trainer.fit.arch_of``), at ``layers``
    decoder layers where given."""
    from types import SimpleNamespace

    from bicc.trainer.fit import arch_of

    shape = {"model_type": "qwen3", **arch, "num_hidden_layers": layers or arch["num_hidden_layers"]}
    return arch_of(SimpleNamespace(**shape))


def memory_run(cfg, rows, prompt_tokens: int, sharded: bool, compiled: bool, device: torch.device):
    """What ``bicc.machine.memory`` counts for ours in this bench (``cfg`` its update's config): one process, every output at
    ``rollout.max_new_tokens``, ``rows``' count, no reference, no BiCC contexts, the bench's compute dtype (bf16 on
    CUDA, fp32 on CPU); no sampler, rollout or evaluation (vLLM's share of the GPU 0: those phases hold only the
    weights and AdamW's moments)."""
    from bicc.config import StepConfig
    from bicc.trainer.fit import run_of

    run = run_of(StepConfig.of(cfg), cfg.model, cfg.eval, cfg.dist, 1, sharded, 0.0, prompt_tokens)
    return dataclasses.replace(run, rows=len(rows[1]), compute_bytes=2 if device.type == "cuda" else 4, reference=False,
                               bicc=False, no_grad_on_context=False, compiled=compiled,
                               vllm=True, eval_vllm=True, vllm_utilization=0.0)


def fit_layers(arch: dict, run, budget_gib: float) -> int:
    """``--layers fit``: the most decoder layers, up to ``arch``'s, at which ours' predicted peak (``run``'s
    checkpointing; under ``model.checkpoint_layers=auto`` every layer checkpointed, the most it can be) fits the
    share of ``budget_gib`` that ``model.checkpoint_layers=auto`` fills; ValueError where not even one layer does."""
    from bicc.machine.memory import peak
    from bicc.trainer.fit import AUTO_SHARE

    for layers in range(arch["num_hidden_layers"], 0, -1):
        if peak(memory_arch(arch, layers), run)[1] <= AUTO_SHARE * budget_gib * GIB:
            return layers
    phase, value = peak(memory_arch(arch, 1), run)
    raise ValueError(f"--layers fit: one layer's predicted peak, {value / GIB:.1f} GiB ({phase}), exceeds "
                     f"{AUTO_SHARE:.0%} of {budget_gib:.1f} GiB (train.memory_gib or the GPU's memory)")


def layer_count(value: str) -> int | str:
    """``--layers``: a positive count or ``fit``."""
    if value == "fit" or (value.isdigit() and int(value) > 0):
        return value if value == "fit" else int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is neither a positive number of layers nor fit")


def build(arch: dict, device: torch.device, checkpointing: bool, policy: str = "full", layers: str = "all"):
    """A random Qwen3 of shape ``arch`` in train mode; ``policy``, ``layers``: ``model.checkpoint_policy`` and
    ``model.checkpoint_layers`` (ours' only)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bicc.model.load import enable_checkpointing

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**arch, pad_token_id=0))
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model, policy, layers)
    return model.train()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def our_update(model, rows, cfg, device):
    """A function running one of our GRPO updates on ``rows`` (pi_old from its own first forward)."""
    from bicc.kernels.rows import query_rows
    from bicc.machine.distributed import Dist
    from bicc.machine.ranks import Ranks
    from bicc.model.logprobs import make_token_batch
    from bicc.trainer.optim import build_optimizer, warmup_cosine
    from bicc.trainer.state import RLState
    from bicc.trainer.update import update_policy

    prompts, outputs = rows
    batch = make_token_batch(prompts, outputs, 0).to(device)
    numerator = query_rows(batch, prompts, outputs, cfg.train.share_prompts, 0, device)
    advantages = torch.linspace(-1, 1, len(outputs), device=device)
    optimizer = build_optimizer(model, 1e-6, (0.9, 0.999), 0.01)
    state = RLState(model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 0, 10_000, 1.0),
                    ranks=Ranks.of(Dist(), cfg.dist))
    return lambda: update_policy(state, batch, numerator, None, None, advantages, cfg, step_seed=0)


def bare_update(model, rows, micro_rows: int, device):
    """A function running one bare update: micro-batches of ``micro_rows`` padded rows, full-vocab log-softmax."""
    from bicc.model.logprobs import make_token_batch

    prompts, outputs = rows
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    parts = [make_token_batch(prompts[i : i + micro_rows], outputs[i : i + micro_rows], 0).to(device)
             for i in range(0, len(outputs), micro_rows)]
    tokens = sum(len(c) for c in outputs)

    def run():
        for b in parts:
            L = b.completion_len
            with cast:
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
            logp = torch.log_softmax(logits[:, -L - 1 : -1].float(), -1).gather(-1, b.input_ids[:, -L:, None]).squeeze(-1)
            loss = -(logp * b.completion_mask).sum() / tokens
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def fsdp_one_rank(model, cfg, device, compute):
    """``model`` sharded as ``bicc.machine.distributed.wrap`` shards it under torchrun, in a process group of this one
    process (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    from bicc.machine.distributed import Dist, wrap

    if not dist.is_initialized():
        tmp = tempfile.mkdtemp(prefix="update_vs_bare_")
        atexit.register(shutil.rmtree, tmp, True)
        store = dist.FileStore(f"{tmp}/store", 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    d = Dist(strategy="fsdp2", device=str(device) if device.type == "cuda" else "cpu", joined=True)
    return wrap(model, cfg.dist, d, compute_dtype=compute)


def timed(fn, device, iters: int, label: str = "") -> float:
    """Seconds per call, the median of ``iters`` after one warm-up call; ``label``: print both as they come (a run
    cut short still says how far it got, and what compiling cost the first call). On CUDA the allocator's peak is
    reset after the warm-up call: ``torch.cuda.max_memory_allocated()`` then reads the timed calls' peak."""
    times = []
    for i in range(iters + 1):
        synchronize(device)
        if i == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    warm_up, times = times[0], sorted(times[1:])
    median = times[len(times) // 2]
    if label:
        print(f"[update_vs_bare] {label}: {median:.3f} s per update, its warm-up call {warm_up:.1f} s", flush=True)
    return median


def covered(spans) -> list[list]:
    """The stretches that ``spans`` ((start, end, ...) tuples: kernels) cover, where kernels overlap (several
    streams) or touch merged into one, in order: [start, end, the span that began it, the span that ended it]."""
    stretches = []
    for span in sorted(spans):
        if stretches and span[0] <= stretches[-1][1]:
            if span[1] > stretches[-1][1]:
                stretches[-1][1], stretches[-1][3] = span[1], span
        else:
            stretches.append([span[0], span[1], span, span])
    return stretches


def busy_seconds(intervals) -> float:
    """The time that at least one of ``intervals`` ((start, end, ...) tuples) covers: kernels that overlap count
    once."""
    return sum(end - start for start, end, *_ in covered(intervals))


def idle_gaps(spans, top: int) -> list[tuple[float, float, str, str]]:
    """The ``top`` longest stretches in which no kernel of ``spans`` ((start, end, name) tuples) runs, between the
    first kernel's start and the last one's end, longest first: (length, its start since the first kernel's, the
    kernel it follows, the kernel it precedes)."""
    busy = covered(spans)
    gaps = [(after[0] - before[1], before[1] - busy[0][0], before[3][2], after[2][2])
            for before, after in zip(busy, busy[1:])]
    return sorted(gaps, reverse=True)[:top]


def print_gaps(spans, wall: float, top: int) -> None:
    """Where the GPU idled in a profiled call of ``wall`` seconds: its kernels' span and the ``top`` longest stretches
    in it without a kernel (``idle_gaps``)."""
    if not spans:
        return
    span = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    print(f"[update_vs_bare] its kernels span {span * 1e3:.0f} ms of the {wall * 1e3:.0f}; the {top} longest "
          f"stretches in that span without a kernel ({busy_seconds(spans) * 1e3:.0f} ms busy):")
    for gap, at, before, after in idle_gaps(spans, top):
        print(f"    {gap * 1e3:7.1f} ms at +{at * 1e3:.0f} ms, after {before[:60]}, before {after[:60]}")


class Profile(NamedTuple):
    ops: int  # aten events
    compiled: int  # calls into compiled graphs (Dynamo's "Torch-Compiled Region" events)
    kernels: float  # CUDA kernel seconds summed
    busy: float  # seconds the GPU ran at least one kernel
    wall: float  # seconds of the call itself, the profiler's start and stop left out
    spans: list  # the kernels' (start, end, name) in seconds


def profiled(fn, device, top: int = 0, ops: bool = True) -> Profile:
    """One call under torch.profiler; ``top``: print its most frequent aten ops and longest kernels. ``ops=False``
    records the GPU's activity only (CUDA), not the host's ops, whose recording lengthens a call that the host paces
    (and counts neither ops nor compiled calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = ([ProfilerActivity.CPU] if ops else []) + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - start
    op_counts, kernel_counts, kernel_ms, spans = Counter(), Counter(), Counter(), []  # one pass over the events
    compiled = 0
    for e in prof.events():
        if e.name.startswith("aten::"):
            op_counts[e.name] += 1
        elif e.name.startswith("Torch-Compiled Region"):
            compiled += 1
        elif e.device_type.name == "CUDA":
            kernel_counts[e.name] += 1
            kernel_ms[e.name] += e.device_time / 1e3
            spans.append((e.time_range.start / 1e6, e.time_range.end / 1e6, e.name))
    n_ops, kernels = sum(op_counts.values()), sum(kernel_ms.values()) / 1e3
    if top:
        print(f"[update_vs_bare] the {top} most frequent of {n_ops} aten ops in one update:")
        for name, count in op_counts.most_common(top):
            print(f"    {count:8d}  {name}")
        if kernel_ms:
            print(f"[update_vs_bare] the {top} longest kernels (ms in all, count) of {kernels * 1e3:.0f} ms, wall "
                  f"{wall * 1e3:.0f} ms:")
            for name, ms in kernel_ms.most_common(top):
                print(f"    {ms:9.1f} ms {kernel_counts[name]:7d}  {name[:100]}")
    return Profile(n_ops, compiled, kernels, busy_seconds(spans), wall, spans)


def host_syncs(fn, top: int = 0) -> int:
    """How many times one call of ``fn`` makes the host wait for the GPU (CUDA's sync debug mode warns at each: a
    blocking copy between host and device, a read of a value, a data-dependent shape); ``top``: print the lines they
    come from, most frequent first. A sync drains the GPU's queue, which then idles while the host prepares what
    follows."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    if top and sites:
        print(f"[update_vs_bare] where one update waits for the GPU ({sum(sites.values())} times):")
        for site, count in sites.most_common(top):
            print(f"    {count:5d}  {site}")
    return sum(sites.values())


def computed_tokens(prompt_ids: list[list[int]], completion_ids: list[list[int]], share: bool) -> int:
    """The tokens ours' forward runs over: every output's, and each distinct prompt's once under
    ``train.share_prompts`` (its keys and values read by its G outputs), else each row's prompt."""
    prompts = {tuple(p) for p in prompt_ids} if share else [tuple(p) for p in prompt_ids]
    return sum(map(len, completion_ids)) + sum(map(len, prompts))


def palm_flops_per_token(arch: dict, mean_len: float) -> float:
    """6 N (non-embedding parameters plus the output projection) + 12 x layers x heads x head_dim x T."""
    h, i = arch["hidden_size"], arch["intermediate_size"]
    hq, hkv = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    n = arch["num_hidden_layers"] * (h * hq + 2 * h * hkv + hq * h + 3 * h * i) + h * arch["vocab_size"]
    return 6.0 * n + 12.0 * arch["num_hidden_layers"] * hq * mean_len


def update_mfu(arch: dict, rows, share: bool, seconds: float, peak_tflops: float) -> float:
    """The PaLM count of an update of ``rows`` in ``seconds`` over the peak: per token ours computes (each distinct
    prompt once under ``share``, not once per output), T the mean row length."""
    mean_len = sum(len(p) + len(c) for p, c in zip(*rows)) / len(rows[1])
    return computed_tokens(*rows, share) / seconds * palm_flops_per_token(arch, mean_len) / (peak_tflops * 1e12)


def counted_flops(fn) -> int:
    """The FLOPs one call of ``fn`` runs as ``torch.utils.flop_counter``'s formulas count them: the dispatched matmuls
    and attention kernels, compiled graphs' included (Inductor calls them as aten ops), with what a checkpointed
    backward recomputes; attention by ``attention_formulas``. Counted in ``FlopCount``, which compiled code runs
    through: under torch's ``FlopCounterMode`` Dynamo would run the compiled layers eagerly, and go on doing so for
    the rest of the process."""
    with FlopCount(attention_formulas()) as counter:
        fn()
    if counter.uncounted:
        print(f"[update_vs_bare] FLOPs not counted inside the higher-order ops {sorted(counter.uncounted)}", flush=True)
    return counter.total


RNG_WRAPPERS = ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state")


class FlopCount(TorchDispatchMode):
    """Sums ``torch.utils.flop_counter``'s formulas (``flop_registry``, and ``formulas`` by op: called on shapes)
    over the aten ops dispatched while it is on. It says it ignores compile internals, so Dynamo runs compiled
    frames under it as compiled (a frame met under any other dispatch mode is skipped, and its code marked to be
    skipped from then on) and it sees the aten ops their graphs call; compilation itself does not pass through it.
    A compiled checkpoint wraps each op that draws random numbers (attention's kernel among them) in an RNG
    higher-order op (on CUDA the graph-safe one), which runs as it would and counts the op it wraps; ``uncounted``
    names any other higher-order op met (run, its FLOPs not counted)."""

    supports_higher_order_operators = True

    def __init__(self, formulas: dict):
        super().__init__()
        from torch.utils import flop_counter

        self.formulas = {**flop_counter.flop_registry, **{op: flop_counter.shape_wrapper(f) for op, f in formulas.items()}}
        self.total, self.uncounted = 0, set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # called with this mode off
            out = func(*args, **kwargs)
            wrapped = [i for i, a in enumerate(args) if isinstance(a, torch._ops.OpOverload)]
            if func.name() in RNG_WRAPPERS and wrapped:
                self.count(args[wrapped[0]], args[wrapped[0] + 1:], kwargs, None)
            else:
                self.uncounted.add(func.name())
            return out
        if func._overloadpacket not in self.formulas and func is not torch.ops.prim.device.default:
            with self:  # a composite op: its parts are counted
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out)
        return out

    def count(self, func, args, kwargs, out) -> None:
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)


def attention_formulas() -> dict:
    """torch's SDPA FLOP formulas (forward and backward), for every SDPA kernel ours may run: CUDA's flash,
    efficient and cuDNN, and the CPU's fused kernel, which torch leaves uncounted. Grouped-query K/V heads count as
    the query's (each query head attends over its group's keys); torch before 2.12 rejects fewer K/V heads than
    query heads, which transformers passes to SDPA (``enable_gqa``) where a pass has no mask."""
    from torch.utils import flop_counter

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(*query_heads(query_shape, key_shape, value_shape))

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, *query_heads(query_shape, key_shape, value_shape))

    aten = torch.ops.aten
    kernels = [getattr(aten, f"_scaled_dot_product_{k}") for k in ("flash_attention", "efficient_attention",
                                                                      "cudnn_attention", "flash_attention_for_cpu")]
    return {**{op: forward for op in kernels},
            **{getattr(aten, f"{op.__name__}_backward"): backward for op in kernels}}


def query_heads(query, key, value) -> tuple:
    """Attention's [batch, heads, length, dim] shapes with grouped K/V heads repeated to the query's."""
    return tuple(query), (key[0], query[1], *key[2:]), (value[0], query[1], *value[2:])


def main() -> None:
    from bicc.machine.host import torch_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: cpu_small on CPU, qwen3_0.6b on CUDA")
    parser.add_argument("--layers", type=layer_count, default=None,
                        help="override the shape's layer count; fit: the most that bicc.machine.memory says fit ours "
                        "(train.memory_gib, else the GPU's memory), the bare loop left out")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=None, help="default: 256 on CPU, 1,024 on CUDA")
    parser.add_argument("--micro-rows", type=int, default=8, help="rows per micro-batch (both; ours also caps tokens)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--no-bare", action="store_true",
                        help="ours alone (its MFU, ops, busy share and memory): no bare loop beside it in memory")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--fsdp", action="store_true", help="ours wrapped in FSDP2 over one rank, as train.py under torchrun")
    parser.add_argument("--compile", action="store_true", help="ours with its decoder layers compiled (model.compile=on)")
    parser.add_argument("--top", type=int, default=0,
                        help="print the profiled update's most frequent ops, longest kernels and idle stretches")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides of our update's config (train.*, dist.*, model.checkpoint_policy, "
                        "model.checkpoint_layers)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(torch_threads(0))
    arch = dict(SHAPES[args.shape or ("qwen3_0.6b" if device.type == "cuda" else "cpu_small")])
    output_tokens = args.output_tokens or (1024 if device.type == "cuda" else 256)
    rows = make_rows(args.prompts, args.group, args.prompt_tokens, output_tokens, arch["vocab_size"])
    tokens = sum(len(p) + len(c) for p, c in zip(*rows))
    checkpointing = not args.no_checkpointing
    cfg = update_cfg(args.prompt_tokens, output_tokens, args.micro_rows, checkpointing, args.overrides)
    budget = cfg.train.memory_gib or (torch.cuda.get_device_properties(0).total_memory / GIB
                                      if device.type == "cuda" else None)
    run = memory_run(cfg, rows, args.prompt_tokens, args.fsdp, args.compile, device)
    if args.layers == "fit":
        if budget is None:
            parser.error("--layers fit sizes ours to train.memory_gib or the GPU's memory: on CPU set train.memory_gib")
        try:
            arch["num_hidden_layers"] = fit_layers(arch, run, budget)
        except ValueError as err:
            parser.error(str(err))
        print(f"[update_vs_bare] --layers fit: {arch['num_hidden_layers']} layers fit ours in {budget:.1f} GiB "
              "(bicc.machine.memory); the bare loop, a second model in memory, left out")
    elif args.layers:
        arch["num_hidden_layers"] = args.layers
    with_bare = not args.no_bare and args.layers != "fit"
    if checkpointing and str(cfg.model.checkpoint_layers) == "auto" and budget is not None:  # as train.py resolves it
        from bicc.trainer.fit import resolve_checkpoint_layers

        chosen = resolve_checkpoint_layers(memory_arch(arch), run, budget)
        cfg.model.checkpoint_layers, run = str(chosen), dataclasses.replace(run, checkpoint_layers=chosen)
        print(f"[update_vs_bare] model.checkpoint_layers=auto: {chosen} of {arch['num_hidden_layers']} layers "
              f"checkpointed ({budget:.1f} GiB)")
    computed = computed_tokens(*rows, cfg.train.share_prompts)  # each distinct prompt once under share_prompts
    print(f"[update_vs_bare] {device.type}, {arch['num_hidden_layers']} layers x {arch['hidden_size']}, "
          f"vocab {arch['vocab_size']}; {len(rows[1])} rows, {tokens} tokens (ours computes "
          f"{computed}); checkpointing {checkpointing} (ours: "
          f"{cfg.model.checkpoint_policy}, layers {cfg.model.checkpoint_layers}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    ours_model = build(arch, device, checkpointing, cfg.model.checkpoint_policy, cfg.model.checkpoint_layers)
    if args.compile:  # before the wrap, as bicc.trainer.state.build_rl_state does
        from bicc.kernels.compile import compile_layers

        compile_layers(ours_model, checkpoint_in_graph=cfg.model.checkpoint_in_graph)
    compute = torch.bfloat16 if device.type == "cuda" else None  # fp32 master weights, bf16 compute (bicc.model.load)
    if args.fsdp:
        ours_model = fsdp_one_rank(ours_model, cfg, device, compute)
    elif compute is not None:
        ours_model.bicc_compute_dtype = compute
    from bicc.machine.distributed import is_sharded

    print("[update_vs_bare] ours: " + ("sharded by FSDP2 over a one-rank process group" if is_sharded(ours_model)
                                      else "unwrapped" + (", under autocast" if compute is not None else ""))
          + (", decoder layers compiled" if args.compile else ""), flush=True)
    from bicc.machine.memory import allocated, peak
    from bicc.model.logprobs import install_logprob_head

    install_logprob_head(ours_model, cfg.train.logprob_chunk_tokens)
    phase, predicted = peak(memory_arch(arch), run)
    predicted_allocated = max(allocated(memory_arch(arch), run).values())
    print(f"[update_vs_bare] bicc.machine.memory: ours' peak {predicted / GIB:.2f} GiB ({phase}), "
          f"{predicted_allocated / GIB:.2f} GiB of it allocated tensors", flush=True)
    ours = our_update(ours_model, rows, cfg, device)
    ours_s, bare_s, bare, ours_peak = [], [], None, None
    for round_ in (1, 2) if with_bare else (1,):  # alternate, so that drift hits both
        ours_s.append(timed(ours, device, args.iters, f"round {round_}, ours"))
        if round_ == 1 and device.type == "cuda":  # the timed calls', before the bare loop's model is built
            ours_peak = torch.cuda.max_memory_allocated()
        if args.compile and round_ == 1:
            from bicc.trainer.step import compiled_graphs

            print(f"[update_vs_bare] ours compiled {compiled_graphs()} Dynamo graphs", flush=True)
        if with_bare:
            bare = bare or bare_update(build(arch, device, checkpointing), rows, args.micro_rows, device)
            bare_s.append(timed(bare, device, args.iters, f"round {round_}, bare"))
    ours_rate = tokens / min(ours_s)
    # what the timed rounds give, printed before the profiles (the slow part at depth), which a time limit may cut
    if with_bare:
        bare_rate = tokens / min(bare_s)
        print(f"[update_vs_bare] ours {min(ours_s):.3f} s ({ours_rate:.0f} tokens/s), bare {min(bare_s):.3f} s "
              f"({bare_rate:.0f} tokens/s)")
        print(f"RESULT update_vs_bare={ours_rate / bare_rate:.3f} target>={1.5 if device.type == 'cuda' else 1.0}")
    else:
        print(f"[update_vs_bare] ours {min(ours_s):.3f} s ({ours_rate:.0f} tokens/s); no bare loop")
    if ours_peak is not None:
        print(f"[update_vs_bare] ours' timed updates peaked at {ours_peak / GIB:.2f} GiB allocated")
        print(f"RESULT update_allocated_vs_model={ours_peak / predicted_allocated:.3f} target>=0.9 target<=1.1")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(0)
        tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))
        print(f"RESULT update_mfu={update_mfu(arch, rows, cfg.train.share_prompts, min(ours_s), tflops):.3f} target>=0.40")
    flops = counted_flops(ours)
    print(f"[update_vs_bare] one update of ours runs {flops:.4g} FLOPs (torch.utils.flop_counter), "
          f"{flops / computed:.4g} a token it computes", flush=True)
    if device.type == "cuda":
        print(f"RESULT update_hfu={flops / min(ours_s) / (tflops * 1e12):.3f}")
    print("[update_vs_bare] profiling one update of ours", flush=True)
    prof = profiled(ours, device, args.top)
    print(f"[update_vs_bare] ours launches {prof.ops} aten ops in one update"
          + (f", {prof.compiled} calls into compiled graphs" if args.compile else ""))
    print(f"RESULT update_ops_per_token={1000 * prof.ops / tokens:.1f}")
    if device.type == "cuda":
        kernels, busy, wall = prof.kernels, prof.busy, prof.wall
        print(f"[update_vs_bare] the profiled update's kernels: {kernels * 1e3:.0f} ms, {kernels / min(ours_s):.3f} of ours' "
              f"timed update ({min(ours_s) * 1e3:.0f} ms); the GPU busy {busy * 1e3:.0f} ms of its {wall * 1e3:.0f} ms "
              f"({busy / wall:.3f}) with the host's ops recorded")
        print(f"[update_vs_bare] one update waits for the GPU {host_syncs(ours, args.top)} times (CUDA's sync debug "
              f"mode; none per micro-batch is the aim: {len(rows[1])} rows in micro-batches of at most {args.micro_rows})")
        _, _, _, busy, wall, spans = profiled(ours, device, ops=False)
        print(f"[update_vs_bare] an update with the GPU's activity recorded only: busy {busy * 1e3:.0f} ms of "
              f"{wall * 1e3:.0f} ms")
        if args.top:
            print_gaps(spans, wall, args.top)
        print(f"RESULT update_gpu_busy_share={busy / wall:.3f} target>=0.9")


if __name__ == "__main__":
    main()
