"""LoRA adapters on the policy (``model.lora``, bicc/model/lora.py): they start as the base to the bit, their
gradient is the hand-written one, pi_ref with them off is the base, the sampler draws with them on, a checkpoint holds
them and loads back to the same policy, a merged export is the adapted policy without them, and a bad setting is
refused naming the field."""

import copy
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from bicc.config import LoraConfig
from bicc.data import encode_prompt
from bicc.model.load import build_tiny, load_policy
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.model.lora import AdaptersOff, add_adapters, export, has_adapters, module_of
from bicc.trainer.checkpoint import save_hf
from bicc.trainer.optim import build_optimizer
from bicc.trainer.validation import validate
from tests.conftest import compose_cfg
from tests.helpers import ARCH

LORA = OmegaConf.structured(LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))


def adapted(seed=0):
    """A tiny model, a copy of it without adapters, and a batch of two prompts with outputs."""
    model, tok = build_tiny(ARCH, seed=seed)
    base = copy.deepcopy(model).eval()
    add_adapters(model, LORA)
    prompts = [encode_prompt(tok, f"Compute {i}+1.") for i in (3, 14)]
    batch = make_token_batch(prompts, [[5, 9, 17, 4], [23, 8]], tok.pad_token_id)
    return model.eval(), base, tok, batch


def perturb(model, seed=1):
    """Every adapter matrix drawn at random (B starts at zero: the adapters change nothing until it moves)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_a_new_adapter_is_the_base_to_the_bit_and_alone_trains():
    model, base, _, batch = adapted()
    assert torch.equal(batch_logprobs(model, batch)[0], batch_logprobs(base, batch)[0])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # q, v and the MLP's down projection of each of the 2 layers: A and B each
    assert len(trainable) == 2 * 3 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = build_optimizer(model, 1e-3, (0.9, 0.999), 0.0)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters() if p.requires_grad) < sum(p.numel() for p in base.parameters()) / 10


def test_the_adapters_gradient_is_the_hand_written_one():
    """One adapted projection, y = W x + (alpha / r) B A x: with g = dL/dy read at the layer, dL/dB = s g^T (A x)
    and dL/dA = s B^T g^T x, summed over tokens; the adapters' .grad equals them."""
    model, _, _, batch = adapted()
    perturb(model)
    layer = model.model.layers[1].self_attn.q_proj
    seen = {}
    hook = layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out))
    logp = batch_logprobs(model, batch)[0]
    y = seen["y"]
    y.retain_grad()
    (logp * batch.completion_mask).sum().backward()
    hook.remove()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    s = LORA.alpha / LORA.r
    x, g = seen["x"].reshape(-1, a.shape[1]).double(), y.grad.reshape(-1, b.shape[0]).double()
    assert torch.allclose(b.grad.double(), s * g.T @ (x @ a.double().T), rtol=1e-5, atol=1e-7)
    assert torch.allclose(a.grad.double(), s * (b.double().T @ g.T) @ x, rtol=1e-5, atol=1e-7)
    assert a.grad.abs().sum() > 0 and layer.base_layer.weight.grad is None  # the base does not train


def test_pi_ref_is_the_policy_with_its_adapters_off_and_they_come_back_on():
    model, base, _, batch = adapted()
    perturb(model)
    on = batch_logprobs(model, batch)[0]
    with module_of(AdaptersOff(model)) as module:
        assert module is model and torch.equal(batch_logprobs(module, batch)[0], batch_logprobs(base, batch)[0])
    assert torch.equal(batch_logprobs(model, batch)[0], on) and not torch.equal(on, batch_logprobs(base, batch)[0])
    with module_of(base) as module:  # a reference of its own runs as it is
        assert module is base


def test_the_sampler_draws_with_the_adapters_on():
    """The HF engine samples from the policy's own module: its sampling log-probs are the trainer's with the adapters,
    not the base's."""
    from bicc.rollout import SamplingParams, build_engine

    model, base, tok, _ = adapted()
    perturb(model)
    engine = build_engine("hf", model, tok, SimpleNamespace(batch_size=8, old_from_sampler=True))
    prompts = [encode_prompt(tok, "Compute 2+2.")]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0))
    batch = make_token_batch(out.prompt_ids, out.completion_ids, tok.pad_token_id)
    mask = batch.completion_mask.bool()
    sampled = torch.nn.utils.rnn.pad_sequence([torch.tensor(lp) for lp in out.logprobs], batch_first=True)
    trainer, plain = batch_logprobs(model, batch)[0], batch_logprobs(base, batch)[0]
    assert torch.allclose(sampled[mask], trainer[mask], atol=1e-5)
    assert not torch.allclose(sampled[mask], plain[mask], atol=1e-3)


def test_a_checkpoint_holds_the_adapters_and_loads_back_to_the_same_policy(tmp_path):
    """load_policy under model.lora puts adapters on the loaded base; save_pretrained writes them and the base's path;
    load_policy reads base and adapters back (a resume, ``eval.py ckpt=``), the adapters alone trainable again; a
    merged export loads in bare transformers as the adapted policy."""
    from transformers import AutoModelForCausalLM

    _, base, tok, batch = adapted()
    save_hf(base, tok, tmp_path / "base")
    on = compose_cfg(["sft.cache_dir=/tmp/x", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"]).model
    model, _ = load_policy(str(tmp_path / "base"), on, torch.device("cpu"))
    assert has_adapters(model) and torch.equal(batch_logprobs(model.eval(), batch)[0], batch_logprobs(base, batch)[0])
    perturb(model)
    save_hf(model, tok, tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").glob("*.safetensors")} == {"adapter_model.safetensors"}
    from bicc.model.load import tokenizer_and_positions
    from eval import resolve_checkpoint

    assert resolve_checkpoint(str(tmp_path / "ckpt"), "/tmp/x") == tmp_path / "ckpt"  # eval.py ckpt= takes it
    assert tokenizer_and_positions(on, str(tmp_path / "ckpt"))[1] == ARCH.max_position_embeddings  # the base's config
    off = compose_cfg(["sft.cache_dir=/tmp/x"]).model  # model.lora off: the checkpoint's own adapters load
    back, _ = load_policy(str(tmp_path / "ckpt"), off, torch.device("cpu"))
    assert has_adapters(back)
    assert torch.equal(batch_logprobs(back.eval(), batch)[0], batch_logprobs(model, batch)[0])
    assert {n for n, p in back.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad}
    export(str(tmp_path / "ckpt"), str(tmp_path / "export"))  # python -m bicc.model.lora CKPT OUT
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert not has_adapters(exported) and not (tmp_path / "export" / "adapter_config.json").exists()
    assert torch.allclose(batch_logprobs(exported, batch)[0], batch_logprobs(model, batch)[0], atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export(str(tmp_path / "export"), str(tmp_path / "again"))


@pytest.mark.parametrize("override, field", [("model.lora.r=-1", "model.lora.r"),
                                             ("model.lora.dropout=1", "model.lora.dropout"),
                                             ("model.lora.alpha=0", "model.lora.alpha")])
def test_a_bad_adapter_setting_is_refused_naming_it_and_every_path_composes(override, field):
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        validate(compose_cfg(["sft.cache_dir=/tmp/x", override]))
    for path in (["bicc=on", "rcc=on", "rollout=vllm"], ["rollout.async_steps=2"], ["model.compile=on"]):
        validate(compose_cfg(["sft.cache_dir=/tmp/x", "model.lora.r=8", *path]))


def test_the_memory_model_counts_the_adapters_the_model_has():
    """Arch.lora_params against the adapters add_adapters puts on a tiny model, and by hand at Qwen3-4B: r x (in + out)
    per projection, 36 layers."""
    from bicc.machine.memory import QWEN3_4B, Arch

    model, _ = build_tiny(ARCH, seed=0)
    trains = add_adapters(model, LORA)
    arch = Arch(hidden=ARCH.hidden_size, layers=ARCH.num_hidden_layers, heads=ARCH.num_attention_heads,
                kv_heads=ARCH.num_key_value_heads, head_dim=ARCH.head_dim, intermediate=ARCH.intermediate_size,
                vocab=100, tied=True)
    assert arch.lora_params(LORA.r, LORA.target_modules) == trains == 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    per_layer = 64 * ((2560 + 4096) * 2 + (2560 + 1024) * 2 + (2560 + 9728) * 3)
    assert QWEN3_4B.lora_params(64, every) == QWEN3_4B.lora_params(64, ["all-linear"]) == 36 * per_layer == 132_120_576


def test_the_lora_preset_is_predicted_to_fit_one_80_gib_gpu_and_full_fine_tuning_is_not():
    """experiment=paper_qwen3_4b_lora in one process on an 80 GiB GPU: adapters' master weights, moments and gradients,
    a bf16 base, no reference copy; the same preset trained whole needs more than the GPU."""
    from bicc.config import StepConfig
    from bicc.machine.memory import GIB, QWEN3_4B, peak, phases
    from bicc.trainer.fit import run_of

    def predicted(*overrides):
        cfg = compose_cfg(["sft.cache_dir=/tmp/x", "algo=dapo", *overrides])
        run = run_of(StepConfig.of(cfg), cfg.model, cfg.eval, cfg.dist, 1, False, 80.0, 300)
        return run, peak(QWEN3_4B, run)[1] / GIB

    run, lora = predicted("experiment=paper_qwen3_4b_lora")
    static = phases(QWEN3_4B, run)["optimizer step"]
    assert not run.reference and static["LoRA adapters (fp32)"] == 4 * 132_120_576
    assert static["AdamW moments (sharded)"] == 8 * 132_120_576 and static["frozen base (compute dtype)"] == 2 * QWEN3_4B.params()
    assert lora < 80 - 8  # a margin of 8 GiB or more
    assert predicted("experiment=paper_qwen3_4b")[1] > 80


def test_vllm_serving_the_adapters_is_built_for_their_rank_and_refused_beside_rollout_workers():
    """rollout.vllm.lora_adapters: the engine is built with vLLM's LoRA layers at the least rank vLLM takes that holds
    model.lora.r (12 -> 16), one adapter at a time; rollout workers are pushed merged weights, so the setting is
    refused beside them, naming the field; a rank vLLM cannot serve is refused naming it too."""
    pytest.importorskip("vllm")
    from bicc.rollout import EngineOptions
    from bicc.rollout.engines.vllm import engine_args, served_rank

    on = ["sft.cache_dir=/tmp/x", "model.lora.r=12", "rollout=vllm", "rollout.vllm.lora_adapters=true"]
    validate(compose_cfg(on))
    with pytest.raises(ValueError, match="config field 'rollout.vllm.lora_adapters'.*rollout.async_steps=2"):
        validate(compose_cfg([*on, "rollout.async_steps=2"]))
    assert [served_rank(r) for r in (1, 2, 12, 16, 17, 64)] == [1, 8, 16, 16, 32, 64]
    with pytest.raises(ValueError, match="'rollout.vllm.lora_adapters'.*model.lora.r is 600"):
        served_rank(600)
    rollout = compose_cfg(on).rollout
    args = engine_args("m", "float32", rollout, EngineOptions(), cuda=False, lora_rank=16)
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 16, 1)
    assert "enable_lora" not in engine_args("m", "float32", rollout, EngineOptions(), cuda=False)


def test_vllm_serving_the_adapters_sleeps_keeping_its_base_and_merged_drops_it():
    """Under rollout.vllm.sleep (GPU) the engine serving adapters sleeps at level 1: its base weights go to host memory
    and come back, since no sync pushes them again; pushed merged weights at every sync, it drops them (level 2)."""
    pytest.importorskip("vllm")
    from bicc.rollout.engines.vllm import VLLMEngine

    calls = []
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.sleep_enabled, engine.llm = True, SimpleNamespace(sleep=lambda level: calls.append(level))
    for engine.adapters in (True, False):
        engine.sleep()
    assert calls == [1, 2]


def test_each_sync_writes_the_adapters_alone_in_the_engines_dtype_as_a_new_lora(tmp_path):
    """What an engine serving the adapters loads at each sync: PEFT's file of the adapters alone (the names
    ``adapter_model.safetensors`` gives them, each tensor equal to the policy's, cast to the engine's dtype) beside
    the adapter config, under a LoRA id one higher than the last, so vLLM loads it rather than serve the cached one."""
    pytest.importorskip("vllm")
    import json

    from safetensors.torch import load_file

    from bicc.rollout.engines.vllm import VLLMEngine

    model, _, _, _ = adapted()
    perturb(model)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.dtype, engine.adapter_dir, engine.adapter_pushes = "bfloat16", str(tmp_path), 0
    for pushes in (1, 2):
        engine.write_adapters(model)
        assert engine.lora_request.lora_int_id == pushes and engine.lora_request.lora_path == str(tmp_path)
    written = load_file(tmp_path / "adapter_model.safetensors")
    own = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert len(written) == len(own) == 3 * 2 * ARCH.num_hidden_layers  # A and B of three projections a layer
    for name, p in own.items():
        tensor = written["base_model.model." + name.replace(".default.", ".")]
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, p.detach().to(torch.bfloat16))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, ["down_proj", "q_proj", "v_proj"])
