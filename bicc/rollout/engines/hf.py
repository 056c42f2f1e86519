"""Rollout with HF ``generate`` on the training module itself (no second copy of the weights).

Usually the engine samples from the very module being trained, so ``update_weights`` has nothing to
copy. Under FSDP2 the trained module is sharded and the engine holds a full copy, which
``update_weights`` refreshes from the gathered full state dict. Prompts are left-padded per chunk of at most
``rollout.batch_size`` output rows. With ``rollout.old_from_sampler`` it also returns each sampled token's
log-prob, log softmax(logits / T), recorded during sampling (``_RecordLogprobs``) so that the trainer can
skip its own pi_old pass. ``rollout.hf.static_cache`` generates into a KV cache allocated whole for each call (rows x
(longest prompt + max new tokens)), the form transformers compiles the decoding steps for on CUDA.
"""

from __future__ import annotations

import torch

from bicc.model.logprobs import compute_precision
from bicc.rollout import ENGINES, Engine, EngineOptions, RolloutOutput, SamplingParams, end_ids_of


@ENGINES.register("hf")
class HFEngine(Engine):
    def __init__(self, model, tokenizer, rollout_cfg, options: EngineOptions = EngineOptions()):
        self.model = model
        self.tokenizer = tokenizer
        self.max_rows = rollout_cfg.batch_size
        self.end_ids = end_ids_of(tokenizer, options)
        # an evaluation's engine config has neither switch (bicc.rollout.eval_engine_config)
        self.returns_logprobs = bool(getattr(rollout_cfg, "old_from_sampler", False)) or options.logprobs
        # a KV cache of the whole length up front, which transformers compiles the decoding steps for on CUDA
        self.cache = "static" if getattr(getattr(rollout_cfg, "hf", None), "static_cache", False) else None

    def update_weights(self, model, version: int) -> None:
        if model is not self.model:  # a copy beside a sharded policy: streamed in, one gathered tensor at a time
            from bicc.machine.distributed import full_tensor

            self.load_weights(((name, full_tensor(t)) for name, t in model.state_dict().items()), version)
        self.version = version

    @torch.no_grad()
    def load_weights(self, weights, version: int) -> None:
        from bicc.rollout.weight_sync import tensors_of

        params = tensors_of(self.model)
        for name, tensor in weights:
            if params[name] is not tensor:  # a push received in place needs no copy
                params[name].copy_(tensor)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        from transformers import LogitsProcessorList  # here: the engine registry is read before a run loads

        device = next(self.model.parameters()).device
        pad_id, end_ids = self.tokenizer.pad_token_id, self.end_ids
        greedy = sampling.temperature == 0
        n = 1 if greedy else sampling.n
        prompts_per_chunk = max(1, self.max_rows // n)
        # Seeding from the call's seed makes a rollout a function of (weights, prompts, seed).
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        out = RolloutOutput([], [], [], [], logprobs=[] if self.returns_logprobs and not greedy else None)
        try:
            for start in range(0, len(prompts), prompts_per_chunk):
                chunk = prompts[start : start + prompts_per_chunk]
                width = max(len(p) for p in chunk)
                input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [P, W]
                attention_mask = torch.zeros_like(input_ids)  # [P, W]
                for i, p in enumerate(chunk):
                    input_ids[i, width - len(p) :] = torch.tensor(p)
                    attention_mask[i, width - len(p) :] = 1
                record = _RecordLogprobs(sampling.temperature) if out.logprobs is not None else None
                with compute_precision(self.model):
                    sequences = self.model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        do_sample=not greedy,
                        temperature=sampling.temperature if not greedy else None,
                        top_p=sampling.top_p if not greedy else None,
                        top_k=0 if not greedy else None,  # 0 = no top-k cut (None may mean HF's default, 50)
                        num_return_sequences=n,
                        max_new_tokens=sampling.max_new_tokens,
                        pad_token_id=pad_id,
                        eos_token_id=end_ids,
                        logits_processor=LogitsProcessorList([record] if record else []),
                        cache_implementation=self.cache,
                    )  # [P*n, W + L]
                token_logprobs = record.finish(sequences[:, width:]).tolist() if record else None
                new_tokens = sequences[:, width:].tolist()
                for row, ids in enumerate(new_tokens):
                    stop = next((t for t, tok in enumerate(ids) if tok in end_ids), None)  # first end token
                    finished = stop is not None
                    ids = ids[: stop + 1] if finished else ids
                    out.prompt_ids.append(chunk[row // n])
                    out.completion_ids.append(ids)
                    out.finished.append(finished)
                    if token_logprobs is not None:
                        out.logprobs.append(token_logprobs[row][: len(ids)])
            out.texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        except RuntimeError as err:
            if "probability tensor contains" not in str(err):
                raise
            raise FloatingPointError(
                f"sampling at weight version {self.version}: the policy's next-token probabilities are not finite "
                "(inf or NaN logits): its weights have diverged, most often from optim.lr too high for the model; "
                "the last checkpoint is the resume point") from err
        finally:
            torch.random.set_rng_state(generator_state)
            self.model.train(was_training)
        if greedy and sampling.n > 1:
            out = _repeat(out, sampling.n)
        return out


class _RecordLogprobs:
    """A logits processor for HF generate (a callable ``(input_ids, scores) -> scores``): each sampled token's log
    softmax(logits / T). Called with the logits of step t (before the temperature warper, which HF applies after
    custom processors), it keeps their log-softmax and reads the previous step's at the token sampled since (the
    last column of ``input_ids``)."""

    def __init__(self, temperature: float):
        self.temperature, self.last, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, L] log-probs of the generated tokens ``new_tokens`` [B, L]."""
        if self.last is not None and new_tokens.shape[1] > len(self.steps):
            self.steps.append(self.last.gather(-1, new_tokens[:, len(self.steps)].unsqueeze(-1)).squeeze(-1))
        return torch.stack(self.steps, dim=1).cpu() if self.steps else new_tokens.new_zeros(new_tokens.shape[0], 0).float()


def _repeat(out: RolloutOutput, n: int) -> RolloutOutput:
    """Greedy decoding is deterministic: one decode per prompt stands for all n samples."""
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    return RolloutOutput(rep(out.prompt_ids), rep(out.completion_ids), rep(out.texts), rep(out.finished))
