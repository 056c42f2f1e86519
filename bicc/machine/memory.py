"""Per-GPU peak memory of a run, phase by phase, from the model's shape and the config (``phases``, ``peak``,
``allocated``); ``bicc.trainer.fit`` checks at launch that a run fits its GPU. ``python -m bench.memory_model`` prints
the tables for the paper presets and validates the model against measured peaks.

What is counted (bytes per GPU; N parameters, W ranks, b = compute bytes, 4 = master bytes):

- sharded policy (FSDP2): fp32 master weights 4N/W, fp32 gradients 4N/W (update and optimizer step only), AdamW
  moments 8N/W (AdamW is fused, ``bicc.trainer.optim``: its step allocates no parameter-sized temporaries);
- FSDP2's gathered compute copies: the root's (embeddings, head) for the whole pass, two decoder layers at a time
  (the current one and the prefetched one), and one layer's unsharded gradient in backward. Kept gathered
  (``dist.reshard_after_forward=false``): every layer from the no-grad passes and each forward to its backward;
  (``dist.reshard_after_backward=false``): every layer through a minibatch's backwards but its last;
- ``dist.reduce_grads=step``: from the second micro-batch of a minibatch every gradient is held unreduced (fp32,
  unsharded) until the minibatch's last backward reduce-scatters it;
- the frozen reference: a full copy in the compute dtype on every rank (RCC's delta needs it);
- vLLM: awake during the rollout at ``gpu_memory_utilization`` x the GPU's memory, asleep (level 2: weights and KV
  cache dropped) during the update; the gradients are freed after the optimizer step, and the root (embeddings,
  head), which FSDP2 leaves gathered after a no-grad forward, is resharded by the update's backward before the
  next rollout (``bench.memory_tracker`` traces it so);
- FSDP2's fp32 reduce-scatter (``dist.reduce_dtype``): each layer's unsharded gradient cast to fp32 before it
  is reduced, and the root's at the end of the backward (a V x H fp32 copy);
- evaluation: through vLLM as in the rollout, or through HF generate in calls of ``eval.batch_size`` rows (fewer
  under ``eval.batch_tokens``, ``eval.limit``): their KV cache, the sampling logits and a layer's prefill;
- a runtime of 2.5 GiB (CUDA context, cuBLAS workspaces, NCCL buffers) and 10% allocator fragmentation on the
  tensors counted;
- activations of a micro-batch under activation checkpointing: every layer's input kept for the backward
  (tokens x H x b per layer), one layer's recomputed activations at a time (per token: 3H + 6Hq + 6Hkv + 4I
  values, plus fp32 copies in the RMSNorms when b < 4), counted at the backward's worst point: the top layer's
  backward in a minibatch's second micro-batch or later, where every layer's input is kept and the earlier
  micro-batches' gradients are held (``bench.memory_tracker`` traces the peak there);
- the chunked log-prob head (``bicc.model.head``): in the update, three chunk x V fp32 buffers (the logits, their
  exponentials, and the entropy's product of the two, multiplied before it is summed); compiled (``model.compile``),
  the matmul's output (compute dtype) and the exponentials (fp32), which one fused pass writes from it; in a no-grad
  pass the fp32 logits beside the matmul's output, compiled the output alone; in the update's backward, the head's
  V x H weight gradient and each chunk's contribution to it;
- BiCC's KV-reuse packing: the step's distinct contexts (two per group, this GPU's share) computed once per minibatch
  and held through all of its micro-batches: their checkpointed layer inputs, their keys/values in every layer and
  the gradient that the micro-batches leave on those (each completion's rows of its context's keys/values are picked
  inside its layer's call, and their gradient scattered back in the layer's backward: nothing of them outlives the
  layer); at the end, one backward through the context forward (one recomputed layer over all context tokens);
- ``model.checkpoint_layers`` below the model's depth (0 without ``model.gradient_checkpointing``): each layer left
  out of the checkpoint (the top ones) keeps what its backward reads (``saved_per_token``: what autograd saves,
  counted on CPU for the eager and the compiled layer), for the micro-batch and the contexts, in place of its
  input. The layers' backward peaks at the top layer's, every such layer's activations held beside its gradients
  (half a recomputed layer's count), or at the first checkpointed layer's recompute, the layers above it done;
- ``model.checkpoint_policy=save_attention``: beside every layer's checkpointed input, its attention's output
  (tokens x Hq x b) and log-sum-exp (4 bytes per token and head), held as the inputs are; ``recompute_mlp``: its
  q/k/v projections' outputs (Hq + 2 Hkv) and its output projection's (H) too;
- ``model.compile`` (``bicc.kernels.fuse``): a layer's q/k/v and gate/up weights concatenated in its forward (again in the
  recompute) and, in its backward, their gradient before it is split, one layer at a time;
- ``model.lora``: the master weights, moments and gradients are the adapters'; the base is frozen in the compute dtype,
  with no reference copy (pi_ref is the base) and no head gradient.

The peak of a phase is the sum of what is alive in it; the run's peak is the largest phase. Attention keeps no
T x T scores (flash-attention 2, or SDPA's fused kernels); under SDPA (``flash`` false) a recomputed layer holds the
keys/values repeated to every query head and their gradient (4 x Hq per token). Under FSDP2 the root's gradient (V x
H, compute dtype, tied) is held unsharded from the head's backward to the embeddings'. ``allocated``: what
``torch.cuda.max_memory_allocated`` sees (no runtime, no allocator slack).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def fused_params(self) -> int:
        """A layer's q/k/v and gate/up weights: what ``model.compile`` concatenates (``bicc.kernels.fuse``)."""
        return self.hidden * ((self.heads + 2 * self.kv_heads) * self.head_dim + 2 * self.intermediate)

    def lora_params(self, rank: int, targets) -> int:
        """LoRA adapters of ``rank`` on the named projections of every layer: r x (in + out) each."""
        h, hq, hkv, m = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        sums = {"q_proj": h + hq, "k_proj": h + hkv, "v_proj": h + hkv, "o_proj": hq + h, "gate_proj": h + m,
                "up_proj": h + m, "down_proj": m + h}  # a projection's in + out features
        return self.layers * rank * sum(v for k, v in sums.items() if k in targets or list(targets) == ["all-linear"])


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
    vllm_utilization: float = 0.4  # rollout.vllm.gpu_memory_utilization
    gpu_gib: float = 80.0
    compute_bytes: int = 2  # bf16
    rows: int = 64  # this GPU's sequences per step: rollout.prompts_per_step x G / world
    no_grad_on_context: bool = False  # a no-grad pass on x^c (bicc.old_on_context, RCC's delta on x^c)
    master_bytes: int = 4  # fp32
    sharded: bool = True
    vllm: bool = True
    runtime_gib: float = 2.5  # CUDA context, cuBLAS workspaces, NCCL buffers: 2-3 GiB on H100 (not measured here)
    fragmentation: float = 0.10  # the caching allocator's reserved-over-allocated, on the tensors counted
    eval_vllm: bool = True  # evaluation through vLLM (the presets), else HF generate under eval.batch_tokens
    eval_batch_tokens: int = 131_072  # eval.batch_tokens (conf/eval/paper.yaml): rows x (prompt + new tokens); 0: none
    eval_new_tokens: int = 4096  # eval.max_new_tokens
    eval_rows: int = 0  # rows per HF generate call at most (eval.batch_size, eval.limit x samples); 0: no cap
    flash: bool = True  # flash-attention 2 (the presets on a GPU with flash-attn); false: SDPA repeats K/V per head
    rollout_batch: int = 64  # rollout.batch_size: most rows per HF generate call (rollout=hf)
    compiled: bool = False  # model.compile on (or auto, on a GPU): a layer's fused projection weights (bicc.kernels.fuse)
    reshard_after_forward: bool = True  # dist.reshard_after_forward (FSDP2)
    reshard_after_backward: bool = True  # dist.reshard_after_backward (FSDP2)
    reduce_per_step: bool = False  # dist.reduce_grads=step (FSDP2): gradients unreduced until a minibatch's last backward
    checkpoint_policy: str = "full"  # model.checkpoint_policy: what every checkpointed layer keeps from its forward
    checkpoint_layers: int | None = None  # model.checkpoint_layers: how many layers are checkpointed (None: every one)
    push_bucket_bytes: int = 0  # rollout workers: rollout.push_bucket_mib (0: none, no push from the trainer)
    lora_rank: int = 0  # model.lora.r: adapters alone train, over a frozen base in the compute dtype (0: none)
    lora_targets: tuple = ()  # model.lora.target_modules


def kept_per_token(arch: Arch, b: int, policy: str) -> int:
    """Bytes a checkpointed layer keeps per token beside its input under ``model.checkpoint_policy``: attention's
    output and fp32 log-sum-exp per head (``save_attention``), and the q/k/v and output projections' outputs
    (``recompute_mlp``)."""
    hq, hkv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    attention = hq * b + 4 * arch.heads
    return {"full": 0, "save_attention": attention, "recompute_mlp": attention + (hq + 2 * hkv + arch.hidden) * b}[policy]


def saved_per_token(arch: Arch, b: int, compiled: bool, autocast: bool = False, flash: bool = True) -> int:
    """Bytes a layer outside the checkpoint keeps per token for its backward (computing in ``b`` bytes): its input,
    the normalised inputs of its projections (their outputs: q/k/v, q and k normed and rotated, attention's output,
    gate and up, the MLP's product) and fp32 per-row scales (the RMSNorms' and attention's log-sum-exp). Eager it
    also keeps each RMSNorm's fp32 input and the gate's activation; under autocast in one process (``autocast``)
    the residual stream is fp32 and each linear keeps its own bf16 copy of its input; under SDPA (not ``flash``)
    the keys and values are kept repeated to every query head."""
    h, hq, hkv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    per_token = (4 * h + 3 * hq + 3 * hkv + (3 if compiled else 4) * arch.intermediate) * b
    per_token += 4 * (2 + 2 * arch.heads + arch.kv_heads) + (0 if compiled else 4 * (2 * h + hq + hkv))
    if autocast:
        per_token += (2 if compiled else 10) * h
    return per_token + (0 if flash else 2 * (hq - hkv) * b)


def _layer_bytes_per_token(arch: Arch, b: int) -> int:
    """Bytes of one recomputed layer's activations per token."""
    h, hq, hkv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    per_token = (3 * h + 6 * hq + 6 * hkv + 4 * arch.intermediate) * b
    if b < 4:  # RMSNorm computes in fp32: input and normalised copies of the two layer norms and q/k norms
        per_token += 8 * (2 * h + hq + hkv)
    return per_token


def prefix_tokens(run: Run) -> int:
    """What an output attends to before itself: the prompt, and under BiCC the opposite attempts' budget."""
    return run.prompt_tokens + (int(run.context_ratio * run.output_tokens) if run.bicc else 0)


def _activations(arch: Arch, run: Run) -> tuple[int, int, int]:
    """(tokens in a micro-batch's forward, bytes of one recomputed layer, context tokens held per minibatch)."""
    # KV-reuse packing: the contexts are computed apart, once per minibatch (bicc.kernels.rows.contexts_once)
    tokens = run.micro_batch * run.output_tokens if run.bicc else run.micro_batch * (run.output_tokens + run.prompt_tokens)
    contexts = run.contexts * prefix_tokens(run) if run.bicc else 0
    return tokens, tokens * _layer_bytes_per_token(arch, run.compute_bytes), contexts


def phases(arch: Arch, run: Run) -> dict[str, dict[str, float]]:
    """Bytes alive in each phase, by component."""
    n, w, b = arch.params(), run.world if run.sharded else 1, run.compute_bytes
    # model.lora: what trains is the adapters (master weights, moments, gradients); the base is frozen in the compute
    # dtype, and pi_ref is the same module with the adapters off
    trains = arch.lora_params(run.lora_rank, run.lora_targets) if run.lora_rank else n
    adam = 2 * 4 * trains / w
    grads = 4 * trains / w
    static = {"frozen base (compute dtype)": b * n / w, "LoRA adapters (fp32)": run.master_bytes * trains / w} \
        if run.lora_rank else {"policy master weights (fp32, sharded)": run.master_bytes * n / w}
    static["AdamW moments (sharded)"] = adam
    if run.reference:
        static["reference (full, compute dtype)"] = b * n
    if run.sharded and not run.vllm:  # rollout=hf beside FSDP2: the sampler is a full copy (bicc.model.load.compute_copy)
        static["HF sampler copy (full, compute dtype)"] = b * n
    static["runtime"] = run.runtime_gib * GIB
    gathered = {}
    if not run.sharded and b < run.master_bytes:  # one process, autocast: compute-dtype copies of the weights
        gathered = {"autocast weight copies (compute dtype)": b * trains}
    if run.sharded:
        gathered = {"FSDP2 gathered root (embeddings, head)": b * arch.root_params(),
                    "FSDP2 gathered layers (current + prefetch)": 2 * b * arch.layer_params()}
    layer_bytes, keep_fwd = b * arch.layer_params(), run.sharded and not run.reshard_after_forward
    keep_bwd = run.sharded and not run.reshard_after_backward

    def kept(every_layer: bool) -> dict:
        """``gathered``, or with every decoder layer held gathered (where FSDP2's reshard options keep them)."""
        if not every_layer:
            return gathered
        return {"FSDP2 gathered root (embeddings, head)": b * arch.root_params(),
                "FSDP2 gathered layers (kept: dist.reshard_after_*=false)": arch.layers * layer_bytes}

    # dist.reduce_grads=step: from a minibatch's second micro-batch on every gradient is held unreduced
    unreduced = {"unreduced gradients (fp32, unsharded: dist.reduce_grads=step)": 4 * trains} if run.reduce_per_step else {}
    tokens, layer_act, context_tokens = _activations(arch, run)
    fused = (b if run.sharded else run.master_bytes) * arch.fused_params() if run.compiled else 0
    fused_pair = {"fused projection weights + their gradient (model.compile)": 2 * fused} if fused else {}
    context_kv = context_tokens * arch.layers * 2 * arch.kv_heads * arch.head_dim * b
    # held through the minibatch: the context forward's checkpointed inputs, its K/V and their gradient
    kept_attention = kept_per_token(arch, b, run.checkpoint_policy)  # per token and layer
    # compiled, the contexts' (recording) pass is replayed by the eager checkpoint, whose policy sees attention alone
    policy = "save_attention" if run.compiled and run.checkpoint_policy != "full" else run.checkpoint_policy
    # model.checkpoint_layers: the first n layers are checkpointed, the rest keep what their backward reads
    n = arch.layers if run.checkpoint_layers is None else min(run.checkpoint_layers, arch.layers)
    autocast = not run.sharded and b < run.master_bytes
    unchecked = (arch.layers - n) * saved_per_token(arch, b, run.compiled, autocast, run.flash)  # per token
    contexts = {"BiCC contexts (inputs, K/V, K/V gradient)":
                context_tokens * (n * (arch.hidden * b + kept_per_token(arch, b, policy)) + unchecked) + 2 * context_kv}
    chunk = min(run.chunk_tokens, tokens)
    # eager: fp32 logits, exponentials, their product (the entropy); compiled: the matmul's output, the exponentials
    head = chunk * arch.vocab * ((b + 4) if run.compiled else 3 * 4)
    inputs = n * tokens * arch.hidden * b  # every checkpointed layer's input
    attention = n * tokens * kept_attention
    saved = {"kept activations (model.checkpoint_policy)": attention} if attention else {}
    if unchecked:
        saved["uncheckpointed layers' activations (model.checkpoint_layers)"] = tokens * unchecked
    # from a minibatch's second micro-batch on, the gradients of the ones before are held throughout its backward;
    # its worst point is the top layer's backward: every layer's input kept, every layer gathered that is kept so
    held_grads = unreduced or {"gradients (fp32, sharded)": grads}
    # layers outside the checkpoint (the top ones) run their backwards first: at the top one's, every one's
    # activations are held and its gradients (half a recomputed layer's count) are made; they are freed before the
    # first checkpointed layer recomputes
    working, layers_saved = {"one layer's recomputed activations": layer_act}, dict(saved)
    if unchecked and (n == 0 or tokens * unchecked >= layer_act / 2):
        working = {"an uncheckpointed layer's gradients": layer_act / 2}
    elif unchecked:
        del layers_saved["uncheckpointed layers' activations (model.checkpoint_layers)"]
    update = {**static, **kept(keep_fwd or keep_bwd), **held_grads,
              "checkpointed layer inputs": inputs, **layers_saved, **working, **contexts, **fused_pair}
    hq = arch.heads * arch.head_dim
    if not run.flash:  # SDPA: K/V repeated to every query head, and their gradient, in the recomputed layer
        update["SDPA repeated K/V and their gradient"] = run.micro_batch * (prefix_tokens(run) + run.output_tokens) * 4 * hq * b
    if run.sharded:
        update["unsharded layer gradient (compute dtype)"] = b * arch.layer_params()
        update["root gradient (compute dtype, unsharded)"] = b * arch.root_params()
    # the head's weight gradient (unsharded, in the compute dtype, until FSDP2 reduce-scatters it at the end of the
    # root's backward; fp32 in one process) and each chunk's V x H contribution before it is accumulated
    head_grad_bytes = 0 if run.lora_rank else (b if run.sharded else 4) * arch.vocab * arch.hidden  # LoRA: frozen
    head_phase = {**static, **kept(keep_fwd or keep_bwd), **held_grads,
                  "head weight gradient + one chunk's": 2 * head_grad_bytes, "checkpointed layer inputs": inputs,
                  **saved, "log-prob head chunk": head, **contexts}
    # the contexts' own backward, after the last micro-batch: one recomputed layer over all context tokens
    context_phase = {**static, **kept(keep_bwd), **held_grads,
                     "BiCC contexts (inputs, K/V, K/V gradient)": contexts and sum(contexts.values()),
                     "one context layer's recomputed activations": context_tokens * _layer_bytes_per_token(arch, b),
                     **fused_pair}
    if not run.flash:
        context_phase["SDPA repeated K/V and their gradient"] = context_tokens * 4 * hq * b
    if run.sharded:
        context_phase["root gradient (compute dtype, unsharded)"] = b * arch.root_params()
    # no grad, no entropy: the chunk's fp32 logits, exponentiated in place, beside the compute-dtype ones they came
    # from; compiled, those alone (the fused reduction writes nothing of [n, V])
    logprob = {**static, **kept(keep_fwd), "one layer's activations (no grad)": layer_act / 2,
               "log-prob head chunk": chunk * arch.vocab * (b if run.compiled else 4 + (b if b < 4 else 0)),
               "BiCC contexts' K/V (no grad)": context_kv if run.no_grad_on_context else 0,
               **({"fused projection weights (model.compile)": fused} if fused else {})}
    if run.sharded:  # reduce_dtype fp32: the unsharded gradient is cast before the reduce-scatter
        update["fp32 reduce-scatter staging (one layer)"] = 4 * arch.layer_params()
    # the root's reduce-scatter, at the end of the backward: its compute-dtype gradient and the fp32 staging copy
    root_phase = {**static, **kept(keep_bwd), **held_grads,
                  "root gradient (compute dtype, unsharded)": b * arch.root_params(),
                  "fp32 reduce-scatter staging (root)": 4 * arch.root_params(), **contexts}
    optimizer = {**static, "gradients (fp32, sharded)": grads}
    # between steps (rollout, evaluation): the update's backward has resharded every FSDP2 unit, the root included
    awake = dict(static)
    if run.vllm:
        rollout = {**awake, "vLLM (awake: weights + KV cache)": run.vllm_utilization * run.gpu_gib * GIB}
    else:  # HF generate: rollout.batch_size rows at a time, from the sampler copy (FSDP2) or the policy (autocast)
        rollout = {**awake, **({} if run.sharded else gathered),
                   **hf_generate(arch, run, min(run.rows, run.rollout_batch), run.output_tokens, "rollout.batch_size")}
    out = {"rollout": rollout, "no-grad log-probs": logprob, "update: head backward": head_phase,
           "update: layers backward": update, "update: contexts backward": context_phase,
           **({"update: root reduce-scatter": root_phase} if run.sharded else {}), "optimizer step": optimizer}
    out["evaluation"] = _evaluation(arch, run, awake, gathered)
    if run.push_bucket_bytes:  # rank 0 gathers each tensor in the master dtype, casts it and packs it (vLLM: 2 buffers)
        largest = arch.vocab * arch.hidden  # the embedding: a dense decoder's largest tensor
        out["weight push"] = {**awake, "largest tensor, gathered and cast": (run.master_bytes + b) * largest,
                              "transfer buffers": (2 if run.vllm else 1) * run.push_bucket_bytes}
    if not run.bicc:
        del out["update: contexts backward"]
    for parts in out.values():  # the caching allocator's slack on what the phase allocates
        tensors = sum(v for k, v in parts.items() if k not in ("runtime", "vLLM (awake: weights + KV cache)"))
        parts["allocator fragmentation"] = run.fragmentation * tensors
    return out


def hf_generate(arch: Arch, run: Run, rows: int, new_tokens: int, knob: str) -> dict[str, float]:
    """One HF generate call of ``rows`` rows x (prompt + ``new_tokens``): its KV cache (and, while it grows, one
    layer's old copy beside the new), the last position's fp32 logits (sampling keeps two copies) and one layer's
    prefill activations."""
    b = run.compute_bytes
    per_layer = rows * (run.prompt_tokens + new_tokens) * 2 * arch.kv_heads * arch.head_dim * b
    return {f"HF generate KV cache ({knob})": (arch.layers + 1) * per_layer,
            "sampling logits (fp32, two copies)": 2 * 4 * rows * arch.vocab,
            "one layer's prefill activations": rows * run.prompt_tokens * _layer_bytes_per_token(arch, b) / 2}


def _evaluation(arch: Arch, run: Run, awake: dict, gathered: dict) -> dict[str, float]:
    """The initial and final evaluation: vLLM's share as in the rollout, or HF generate (from the sampler copy
    under FSDP2) in calls of ``eval_rows`` rows, fewer where ``eval_batch_tokens`` caps rows x tokens."""
    if run.eval_vllm:
        return {**awake, "vLLM (awake: weights + KV cache)": run.vllm_utilization * run.gpu_gib * GIB}
    rows = run.eval_batch_tokens // (run.prompt_tokens + run.eval_new_tokens) if run.eval_batch_tokens else run.eval_rows
    rows = max(1, min(rows, run.eval_rows) if run.eval_rows else rows)
    return {**awake, **({} if run.sharded else gathered),
            **hf_generate(arch, run, rows, run.eval_new_tokens, "eval.batch_tokens")}


NOT_ALLOCATED = ("runtime", "allocator fragmentation")  # outside torch.cuda.max_memory_allocated


def allocated(arch: Arch, run: Run) -> dict[str, float]:
    return {name: sum(v for k, v in parts.items() if k not in NOT_ALLOCATED) for name, parts in phases(arch, run).items()}


def peak(arch: Arch, run: Run) -> tuple[str, float]:
    return max(((name, sum(parts.values())) for name, parts in phases(arch, run).items()), key=lambda kv: kv[1])
