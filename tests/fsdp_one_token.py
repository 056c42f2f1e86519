"""Run by torchrun (2 CPU processes, gloo): FSDP2 log-probs and a backward where rank 0's outputs are all one
token and rank 1's are longer. Each rank writes its output rows' log-prob sum and the sum of its gradient shards
to ``<out>/rank<r>.txt`` (a file each: two unbuffered processes printing to one pipe can interleave their lines).
Usage: ``torchrun ... tests/fsdp_one_token.py <timeout_s> <padded|padding_free> <out>``. Used by
``tests/test_distributed.py``."""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bicc.config import DistConfig
from bicc.machine.distributed import Dist, wrap
from tests.helpers import prefix_cache_case, prefix_cache_logprobs, tiny

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[1])))
    rank = dist.get_rank()
    model, tok = tiny("flash_attention_2" if sys.argv[2] == "padding_free" else "sdpa")
    if sys.argv[2] == "padding_free":
        import transformers.modeling_flash_attention_utils as fa

        from tests.test_flash_path import reference_dense, reference_varlen

        fa._lazy_imports = lambda *a, **k: (reference_dense, reference_varlen, None, fa._pad_input, fa._unpad_input)
        fa._loaded_implementation = None
    model = wrap(model, DistConfig(), Dist(rank, 2, rank, "fsdp2"))
    _, distinct, prefix_of, completions = prefix_cache_case()
    if rank == 0:
        completions = [c[:1] for c in completions]
    logp, _ = prefix_cache_logprobs(model, distinct, prefix_of, completions, 9, tok.pad_token_id)
    logp.sum().backward()
    grads = sum(p.grad.to_local().double().sum().item() for p in model.parameters() if p.grad is not None)
    Path(sys.argv[3], f"rank{rank}.txt").write_text(f"{logp.sum().item():.6f} {grads:.6f}\n")
    dist.barrier()
    # Both ranks are done and have written their results. Leave without the interpreter's teardown: in the full
    # suite a gloo thread was sometimes still joinable when its destructor ran ("terminate called without an active
    # exception", SIGABRT after the results were written), which says nothing about the step being tested.
    os._exit(0)
