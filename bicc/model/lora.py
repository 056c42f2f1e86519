"""LoRA adapters on the policy (``model.lora``), through transformers' PEFT integration (``add_adapter``; peft is the
dependency): the adapters are put into the module in place, so every forward of the trainer (packed rows, shared
prompts, BiCC's contexts, the chunked log-prob head) runs through them unchanged.

- **What trains** is the adapters alone: the base's parameters are frozen, so the optimizer, its state and gradient
  clipping hold only the adapters (``bicc.trainer.optim.build_optimizer`` takes what requires grad).
- **pi_ref** is the same module with its adapters off (``AdaptersOff``): no second copy of the base. The adapters
  start at zero (B = 0), so pi_ref is the initial policy, to the bit.
- **A checkpoint** holds the adapters (``adapter_model.safetensors``, and ``adapter_config.json`` naming the base) with
  the trainer state; transformers loads base and adapters from it (``from_pretrained``), so a resume and ``eval.py
  ckpt=`` read it as any checkpoint.
- **An export** folds each adapter into its layer's weight (``merged_state_dict``; ``python -m bicc.model.lora CKPT
  OUT`` writes the plain model dir), for bare transformers or vLLM.
"""

from __future__ import annotations

import contextlib

ADAPTER_CONFIG = "adapter_config.json"


def add_adapters(model, lora_cfg, dtype=None) -> int:
    """Adapters of ``model.lora`` (r, alpha, dropout, target modules) on ``model``, or, for a model loaded from an
    adapter checkpoint, its adapters; they alone train, kept in ``dtype`` (the master dtype; the frozen base stays in
    the compute dtype). Returns how many parameters train."""
    if not has_adapters(model):
        from peft import LoraConfig

        target = lora_cfg.target_modules
        model.add_adapter(LoraConfig(r=int(lora_cfg.r), lora_alpha=float(lora_cfg.alpha),
                                     lora_dropout=float(lora_cfg.dropout),
                                     target_modules="all-linear" if list(target) == ["all-linear"] else list(target)))
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
        if param.requires_grad and dtype is not None:
            param.data = param.data.to(dtype)
        trainable += param.numel() if param.requires_grad else 0
    if not trainable:
        raise ValueError(f"config field 'model.lora.target_modules': {list(lora_cfg.target_modules)} matched no layer "
                         f"of {type(model).__name__}")
    return trainable


def has_adapters(model) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def base_path(path: str) -> str:
    """The dir (or HF id) of an adapter checkpoint's base model, which ``adapter_config.json`` names; any other path
    as it is."""
    import json
    from pathlib import Path

    config = Path(path) / ADAPTER_CONFIG
    return json.loads(config.read_text(encoding="utf-8"))["base_model_name_or_path"] if config.exists() else path


def model_base(model) -> str:
    """The HF id or dir ``model`` was loaded from; with adapters, that of the base they sit on."""
    if has_adapters(model):
        return model.peft_config["default"].base_model_name_or_path
    return getattr(model, "name_or_path", None) or model.config._name_or_path


class AdaptersOff:
    """pi_ref as the policy's own module with its adapters off; ``with AdaptersOff(model) as module:`` runs ``module``
    so, and turns them back on after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.disable_adapters()
        return self.model

    def __exit__(self, *exc) -> None:
        self.model.enable_adapters()


def module_of(model):
    """A context that gives the module to run: ``model`` itself, or, for ``AdaptersOff``, the policy with its
    adapters off."""
    return model if isinstance(model, AdaptersOff) else contextlib.nullcontext(model)


def adapted_layers(model) -> dict:
    """The name a model without adapters gives each adapted layer's weight (``...q_proj.weight``) -> that LoRA layer;
    empty for a model without adapters."""
    if not has_adapters(model):
        return {}
    from peft.tuners.lora import LoraLayer

    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def plain_name(name: str) -> str:
    """A parameter's name in the model without adapters (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def fold(layer, gather=lambda t: t):
    """An adapted layer's weight with its active adapters folded in, W + (alpha / r) B A, summed in fp32 and returned
    in W's dtype; ``gather`` gives each tensor whole (``full_tensor`` under FSDP2, a collective)."""
    import torch

    with torch.no_grad():
        weight = gather(layer.base_layer.weight).detach()
        total = weight.float()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                a, b = gather(layer.lora_A[adapter].weight), gather(layer.lora_B[adapter].weight)
                total = total + (b.float() @ a.float()) * layer.scaling[adapter]
        return total.to(weight.dtype)


def merged_weights(model, gather=lambda t: t):
    """(name, tensor) pairs of the base model's state dict (its own parameter names), each adapter folded into its
    layer's weight (``fold``, each tensor through ``gather``: ``full_tensor`` under FSDP2): what a model without
    adapters loads. One merged tensor at a time (a push streams them)."""
    layers = adapted_layers(model)
    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            name = plain_name(key)
            yield name, fold(layers[name], gather) if name in layers else gather(value)


def adapter_weights(model, gather=lambda t: t):
    """(name, tensor) pairs of the active adapters under the names PEFT's ``adapter_model.safetensors`` gives them
    (``base_model.model.<layer>.lora_A.weight``), each whole (``gather``: ``full_tensor`` under FSDP2, a collective):
    what an engine serving the adapters itself loads (``rollout.vllm.lora_adapters``)."""
    (adapter,) = model.active_adapters()
    for name, param in model.named_parameters():
        if ".lora_" in name:
            yield "base_model.model." + name.replace(f".{adapter}.", "."), gather(param).detach()


def merged_state_dict(model) -> dict:
    """``merged_weights`` as a state dict: an export's."""
    return dict(merged_weights(model))


def export(ckpt: str, out: str) -> None:
    """A checkpoint of adapters as a plain HF model dir (what ``save_pretrained`` writes for a model without adapters):
    the base's weights with the adapters folded in, its config, and the checkpoint's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapted = AutoModelForCausalLM.from_pretrained(ckpt)  # the base, then the adapters on it
    if not has_adapters(adapted):
        raise ValueError(f"{ckpt}: no LoRA adapters ({ADAPTER_CONFIG}) to merge")
    plain = AutoModelForCausalLM.from_pretrained(base_path(ckpt), dtype=adapted.dtype)
    plain.load_state_dict(merged_state_dict(adapted), strict=True)
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)


if __name__ == "__main__":  # python -m bicc.model.lora CKPT OUT
    import argparse

    parser = argparse.ArgumentParser(description="Merge a checkpoint's LoRA adapters into a plain HF model dir.")
    parser.add_argument("ckpt", help="a checkpoint of adapters (run_dir/checkpoints/step_N)")
    parser.add_argument("out", help="the model dir to write")
    args = parser.parse_args()
    export(args.ckpt, args.out)
    print(f"[lora] {args.ckpt}: adapters merged into {args.out}")
