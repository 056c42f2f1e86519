"""Building and loading the policy, its tokenizer and the frozen reference.

``model.tiny`` builds a small Qwen3 from a config (random init) with the local character tokenizer;
``model.path`` loads any HF-format causal LM (an HF id for GPU users, or a local dir such as a
checkpoint written by this project). Both paths go through ``from_pretrained`` once a checkpoint exists.

Precision. ``model.dtype`` is the compute dtype; ``model.master_dtype`` (fp32) is the dtype the trainable
policy's weights, gradients and optimizer state are held in. At lr 1e-6 a bf16 weight rounds most updates
away (a weight near 1 has a bf16 spacing of 2^-7), so the policy keeps fp32 master weights and computes
in bf16: under autocast in one process or DDP (``bicc_compute_dtype``, ``bicc.model.logprobs.compute_precision``),
and through FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when sharded. The frozen
reference, the rollout engines and the HF weights in checkpoints use the compute dtype.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from bicc.machine.distributed import DTYPES
from bicc.model.logprobs import DEFAULT_CHUNK_TOKENS, install_logprob_head
from bicc.model.lora import add_adapters, base_path
from bicc.model.tokenizer import build_char_tokenizer


def build_tiny(tiny_cfg, seed: int):
    """A random-init Qwen3 sized by ``tiny_cfg`` and the character tokenizer."""
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny_cfg.hidden_size,
        intermediate_size=tiny_cfg.intermediate_size,
        num_hidden_layers=tiny_cfg.num_hidden_layers,
        num_attention_heads=tiny_cfg.num_attention_heads,
        num_key_value_heads=tiny_cfg.num_key_value_heads,
        head_dim=tiny_cfg.head_dim,
        max_position_embeddings=tiny_cfg.max_position_embeddings,
        tie_word_embeddings=tiny_cfg.tie_word_embeddings,
        attention_dropout=tiny_cfg.attention_dropout,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def load_pretrained(path: str, model_cfg, device: torch.device, dtype: torch.dtype | None = None):
    """Model (in ``dtype``, default the compute dtype ``model.dtype``) and tokenizer from an HF id or a local
    HF-format dir."""
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or DTYPES[model_cfg.dtype],
        attn_implementation=resolve_attn_implementation(model_cfg.attn_implementation)
    ).to(device)
    model.bicc_padding_free = model_cfg.padding_free  # read by bicc.kernels.packing.padding_free
    if model_cfg.gradient_checkpointing:
        enable_checkpointing(model, model_cfg.checkpoint_policy, model_cfg.checkpoint_layers)
    return model, tokenizer


def load_tokenizer(path: str):
    """The tokenizer of an HF id or dir, padding on the left (generation), EOS as the pad token where it has none."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def checkpointed_layers(setting, layers: int) -> int:
    """How many of a model's ``layers`` decoder layers ``model.checkpoint_layers`` checkpoints: ``all`` (and
    ``auto`` where no memory budget resolved it at launch, ``bicc.trainer.fit.resolve_checkpoint_layers``) or a number."""
    if str(setting) in ("all", "auto"):
        return layers
    if not str(setting).isdigit() or int(setting) > layers:
        raise ValueError(f"config field 'model.checkpoint_layers': {setting!r} is not all, auto or a number of layers "
                         f"from 0 to {layers}")
    return int(setting)


def enable_checkpointing(model, policy: str = "full", layers="all") -> int:
    """Activation checkpointing under ``model.checkpoint_policy`` on the first ``layers`` decoder layers
    (``model.checkpoint_layers``, from the embeddings up); the layers above keep their activations for the backward
    and recompute nothing. Returns how many layers are checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy))
    decoder = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    n = checkpointed_layers(layers, len(decoder))
    for layer in decoder[n:]:
        layer.gradient_checkpointing = False
    return n


CHECKPOINT_POLICIES = ("full", "save_attention", "recompute_mlp")


def checkpoint_kwargs(policy: str = "full") -> dict:
    """``torch.utils.checkpoint``'s keywords for ``model.checkpoint_policy``. ``full``: a layer's backward recomputes
    its whole forward. ``save_attention``: the attention kernel's outputs (output, log-sum-exp) are kept from the
    forward (selective activation checkpointing), so the recompute runs every op of the layer but attention.
    ``recompute_mlp``: the attention block's matmul outputs (q/k/v and output projections) are kept too, so only
    the MLP's matmuls run again."""
    kwargs = {"use_reentrant": False}
    if policy in ("save_attention", "recompute_mlp"):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        keep = _keep_attention if policy == "save_attention" else _KeepAttentionBlock
        kwargs["context_fn"] = functools.partial(_contexts, create_selective_checkpoint_contexts, keep)
    elif policy != "full":
        raise ValueError(f"model.checkpoint_policy: {policy!r} is none of {', '.join(CHECKPOINT_POLICIES)}")
    return kwargs


def _contexts(create, keep):
    """A checkpointed call's selective-checkpoint contexts; ``keep`` a policy, or a class of stateful ones (each
    call gets its own)."""
    return create(keep() if isinstance(keep, type) else keep)


def _is_attention(op) -> bool:
    """An attention kernel's forward (SDPA's flash, efficient, cuDNN and CPU kernels; flash-attn's)."""
    name = str(op)
    return ("scaled_dot_product" in name or "flash_attn" in name) and "backward" not in name


def _keep_attention(ctx, op, *args, **kwargs):
    """The selective checkpoint's policy: an attention kernel's forward is kept, every other op recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if _is_attention(op) else CheckpointPolicy.PREFER_RECOMPUTE


class _KeepAttentionBlock:
    """A policy for one checkpointed layer call: every matmul up to attention (the q/k/v projections, fused or
    not), attention, and the first matmul after it (the output projection) are kept; the rest (the MLP) is
    recomputed. A layer runs its ops in that order; the forward and the recompute each keep their own count."""

    def __init__(self):
        self.stage = {False: 0, True: 0}  # per ctx.is_recompute: 0 before attention, 1 after it, 2 in the MLP

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        recompute, stage = ctx.is_recompute, self.stage[ctx.is_recompute]
        if _is_attention(op) and stage == 0:
            self.stage[recompute] = 1
            return CheckpointPolicy.MUST_SAVE
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and stage < 2:
            self.stage[recompute] = 2 if stage == 1 else 0
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def load_policy(path: str, model_cfg, device: torch.device, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
    """The trainable policy: weights in ``model.master_dtype``, compute in ``model.dtype`` (autocast when
    they differ), and the chunked log-prob head; under ``model.lora`` its adapters alone train (a checkpoint of
    adapters loads its base and them)."""
    master, compute = DTYPES[model_cfg.master_dtype], DTYPES[model_cfg.dtype]
    lora = model_cfg.lora.r > 0 or base_path(path) != path  # adapters, new or a checkpoint's
    model, tokenizer = load_pretrained(path, model_cfg, device, dtype=compute if lora else master)  # LoRA: frozen base
    if lora:
        add_adapters(model, model_cfg.lora, master)
    if master != compute:
        model.bicc_compute_dtype = compute
    install_logprob_head(model, chunk_tokens)
    return model, tokenizer


def compute_copy(model, model_cfg):
    """A full copy of the policy in the compute dtype (the HF sampler beside a sharded policy)."""
    import copy

    sampler = copy.deepcopy(model).to(DTYPES[model_cfg.dtype])
    sampler.__dict__.pop("bicc_compute_dtype", None)
    return sampler


def end_token_ids(tokenizer, model_or_config=None) -> list[int]:
    """Every token that ends a turn: the tokenizer's EOS and each one the generation config lists
    (Phi-4-mini lists both <|end|> and <|endoftext|>), in that order, without repeats."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    generation = getattr(model_or_config, "generation_config", model_or_config)
    listed = getattr(generation, "eos_token_id", None)
    for token in ([listed] if isinstance(listed, int) else list(listed or [])):
        if token is not None and token not in ids:
            ids.append(int(token))
    return ids


def tokenizer_and_positions(model_cfg, path: str | None = None) -> tuple:
    """The tokenizer and the longest sequence the model takes, read without loading any weights, the config
    field that sets that length, and the LongRoPE short-factor range (``longrope_limit``; None for other
    models). ``path``: another dir of the same model (a checkpoint) instead of ``model.path``."""
    if model_cfg.tiny is not None and path is None:
        return build_char_tokenizer(), model_cfg.tiny.max_position_embeddings, "model.tiny.max_position_embeddings", None
    from transformers import AutoConfig

    path = path or model_cfg.path
    config = AutoConfig.from_pretrained(base_path(path))  # an adapter checkpoint's: its base's
    return (AutoTokenizer.from_pretrained(path), config.max_position_embeddings, f"{path} config.json",
            longrope_limit(config))


def longrope_limit(config) -> int | None:
    """``original_max_position_embeddings`` of a LongRoPE model (Phi-3/4): transformers rotates positions below it
    with the short factors and only longer sequences with the long ones, while vLLM uses the long factors for
    every position once its ``max_model_len`` exceeds it. None for any other model."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    original = original or getattr(config, "original_max_position_embeddings", None)
    return int(original) if kind == "longrope" and original else None


def resolve_attn_implementation(name: str) -> str:
    """flash_attention_2 only where it can run (CUDA and the flash-attn package); SDPA otherwise."""
    if name != "flash_attention_2":
        return name
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return name if torch.cuda.is_available() else "sdpa"


def frozen_copy(path: str, model_cfg, device: torch.device):
    """The reference policy (frozen initial weights, compute dtype), loaded only when something needs it."""
    model, _ = load_pretrained(path, model_cfg, device)
    install_logprob_head(model)
    model.requires_grad_(False).eval()
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
