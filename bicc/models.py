"""Building and loading the policy, its tokenizer and the frozen reference.

``model.tiny`` builds a small Qwen3 from a config (random init) with the local character tokenizer;
``model.path`` loads any HF-format causal LM (an HF id for GPU users, or a local dir such as a
checkpoint written by this project). Both paths go through ``from_pretrained`` once a checkpoint exists.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from bicc.tokenizer import build_char_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_pretrained(path: str, model_cfg, device: torch.device):
    """Policy and tokenizer from an HF id or a local HF-format dir."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[model_cfg.dtype], attn_implementation=resolve_attn_implementation(model_cfg.attn_implementation)
    ).to(device)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer


def tokenizer_and_positions(model_cfg) -> tuple:
    """The tokenizer and the longest sequence the model takes, read without loading any weights, and
    the config field that sets that length."""
    if model_cfg.tiny is not None:
        return build_char_tokenizer(), model_cfg.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_cfg.path)
    return AutoTokenizer.from_pretrained(model_cfg.path), config.max_position_embeddings, f"{model_cfg.path} config.json"


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
    """The reference policy (frozen initial weights), loaded only when something needs it."""
    model, _ = load_pretrained(path, model_cfg, device)
    model.requires_grad_(False).eval()
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
