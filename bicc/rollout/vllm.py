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

With ``rollout.sleep`` (GPU only) the engine frees its KV cache and weights while the trainer updates
(``sleep`` / ``wake_up``).
"""

from __future__ import annotations

import os

import torch

from bicc.distributed import full_tensor
from bicc.rollout import ENGINES, RolloutOutput, SamplingParams


def named_parameters_full(model):
    """(name, full tensor) pairs of the policy, HF names, gathered one at a time under FSDP2; the tied
    output projection is added as ``lm_head.weight``."""
    names = set()
    for name, tensor in model.state_dict().items():
        names.add(name)
        yield name, full_tensor(tensor).detach()  # an FSDP2 DTensor: this parameter gathered alone
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        yield "lm_head.weight", model.get_input_embeddings().weight.detach()


@ENGINES.register("vllm")
class VLLMEngine:
    def __init__(self, model, tokenizer, rollout_cfg):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        try:
            from vllm import LLM
        except ImportError:
            raise ImportError("rollout=vllm needs vLLM: pip install -r requirements-gpu.txt (GPU) or "
                              "-r requirements-vllm-cpu.txt (CPU)") from None
        path = getattr(model, "name_or_path", None) or model.config._name_or_path
        if not path or not os.path.isdir(path):
            raise ValueError(f"rollout=vllm builds its engine from the policy's HF dir; got {path!r}")
        self.tokenizer = tokenizer
        self.sleep_enabled = bool(rollout_cfg.sleep) and torch.cuda.is_available()
        kwargs = dict(model=path, tokenizer=path, dtype=str(model.dtype).replace("torch.", ""), seed=0,
                      max_model_len=rollout_cfg.max_model_len or None, enforce_eager=rollout_cfg.enforce_eager,
                      enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                      # on the CPU backend this is the share of host memory it reserves
                      gpu_memory_utilization=rollout_cfg.gpu_memory_utilization)
        if torch.cuda.is_available():
            kwargs.update(enable_sleep_mode=self.sleep_enabled)
        else:
            # vllm-cpu 0.32: a seeded request whose prefill is split over steps crashes the CPU sampler
            # ("CPU Generator does not use offset"); whole prefills avoid it
            kwargs.update(enable_chunked_prefill=False)
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        self.model = None  # no HF module: evaluation with this engine samples through vLLM as well

    def update_weights(self, model) -> None:
        """Push ``model``'s current parameters into vLLM and drop prefix-cache entries of the old ones."""
        if self.sleep_enabled:
            self.llm.wake_up()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_parameters_full(model)})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if self.sleep_enabled:
            self.llm.sleep(level=1)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        from vllm import SamplingParams as VSampling

        greedy = sampling.temperature == 0
        eos = self.tokenizer.eos_token_id
        requests, params = [], []
        for i, ids in enumerate(prompts):
            requests.append({"prompt_token_ids": list(ids)})
            params.append(VSampling(n=1 if greedy else sampling.n, temperature=0.0 if greedy else sampling.temperature,
                                    top_p=1.0 if greedy else sampling.top_p,
                                    max_tokens=sampling.max_new_tokens, seed=sampling.seed * 1_000_003 + i, logprobs=0,
                                    stop_token_ids=[eos], skip_special_tokens=True, detokenize=False))
        results = self.llm.generate(requests, params, use_tqdm=False)
        out = RolloutOutput([], [], [], [], logprobs=[])
        for ids, result in zip(prompts, results):
            samples = list(result.outputs) * (sampling.n if greedy else 1)
            for sample in samples:
                tokens = list(sample.token_ids)
                finished = sample.finish_reason == "stop"
                if finished and (not tokens or tokens[-1] != eos):
                    tokens.append(eos)  # a stop on EOS: keep it, as HF generate does
                out.prompt_ids.append(list(ids))
                out.completion_ids.append(tokens)
                out.finished.append(finished)
                lp = [d[t].logprob if d and t in d else float("nan") for t, d in zip(tokens, sample.logprobs or [])]
                out.logprobs.append(lp + [float("nan")] * (len(tokens) - len(lp)))
        out.texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return out
