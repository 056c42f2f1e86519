"""Training on several processes under ``torchrun``: process group, FSDP2 or DDP, global loss totals,
prompt shards, and checkpoints of a sharded model.

One process (no ``WORLD_SIZE`` above 1) leaves everything as it is: ``Dist()`` is rank 0 of 1 and every
helper here is then the identity.

How a step is split. The ``rollout.shards`` slices of each step's queries are sampled with their own
seeds (``bicc.trainer.collect_rollout``); rank r takes shards ``r*S/W .. (r+1)*S/W - 1``. A whole group
stays on one rank, so advantages, BiCC contexts and RCC's covariance never need another rank. Losses are
normalised by totals summed over all ranks (``global_totals``), and gradients are summed, so one process
running the same shards one after another computes the same update (``tests/test_distributed.py``).

Strategies (``dist.strategy``):

- ``fsdp2``: ``fully_shard`` on every decoder layer and at the root; parameters in ``dist.param_dtype``,
  gradients reduce-scattered in ``dist.reduce_dtype``. The rollout engine keeps its own full copy of the
  weights (``full_state_dict``, gathered one parameter at a time), so sampling needs no collective.
- ``ddp``: every rank holds the whole model; after the micro-batches of an optimizer step the gradients
  are summed over ranks in flat buckets (one all-reduce per bucket, not one per micro-batch, so ranks may
  run different numbers of micro-batches, e.g. after DAPO's dynamic sampling).

Checkpoints: rank 0 writes the HF-format weights (a full state dict) and the trainer state; under FSDP2
the optimizer state is saved sharded with ``torch.distributed.checkpoint`` (``optim_dcp/``), which any
world size, one process included, can load back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bicc.models import DTYPES


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    strategy: str = "none"

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(dist_cfg) -> Dist:
    """Join the process group when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    backend = dist_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist_cfg.strategy)


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def num_shards(rollout_cfg, d: Dist) -> int:
    """Prompt shards per step: ``rollout.shards``, or one per rank when it is null."""
    return rollout_cfg.shards or d.world


def local_shards(rollout_cfg, d: Dist) -> range:
    shards = num_shards(rollout_cfg, d)
    if shards % d.world:
        raise ValueError(f"config field 'rollout.shards': {shards} shards cannot be split over {d.world} processes")
    per_rank = shards // d.world
    return range(d.rank * per_rank, (d.rank + 1) * per_rank)


def wrap(model, dist_cfg, d: Dist):
    """Shard (FSDP2) the model in place; DDP needs no wrapper (see ``sync_gradients``)."""
    if not d.enabled or d.strategy == "ddp":
        if d.enabled:  # identical start on every rank whatever each loaded
            for p in model.parameters():
                dist.broadcast(p.data, 0)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dist_cfg.param_dtype] if dist_cfg.param_dtype else None,
                                  reduce_dtype=DTYPES[dist_cfg.reduce_dtype])
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=dist_cfg.reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=dist_cfg.reshard_after_forward)
    return model


def decoder_layers(model) -> list:
    """The repeated blocks of an HF causal LM (``model.model.layers`` for Qwen3, Phi-3/4, Llama, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard; set dist.strategy=ddp")
    return list(layers)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def global_totals(totals, d: Dist):
    """``StepTotals`` summed over ranks (tokens, sequences); ``max_len`` is a setting, not a count."""
    if not d.enabled:
        return totals
    t = torch.tensor([totals.tokens, totals.seqs], dtype=torch.float64)
    dist.all_reduce(t)
    return type(totals)(tokens=float(t[0]), seqs=float(t[1]), max_len=totals.max_len)


def loss_scale(d: Dist) -> float:
    """FSDP2 averages gradients over ranks; losses normalised by global totals need their sum."""
    return float(d.world) if d.enabled and d.strategy == "fsdp2" else 1.0


def sync_gradients(model, d: Dist, bucket_numel: int = 1 << 24) -> None:
    """DDP: sum every gradient over ranks, in flat buckets of at most ``bucket_numel`` elements."""
    if not d.enabled or d.strategy != "ddp":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if p.grad is None:  # unused on this rank in this step: contributes zero, but must join the sum
            p.grad = torch.zeros_like(p)
        if buckets[-1] and size + p.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(p.grad)
        size += p.numel()
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_sum(value: float, d: Dist) -> float:
    if not d.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


def full_state_dict(model) -> dict:
    """The full, unsharded weights on CPU, on every rank. Under FSDP2 each parameter is all-gathered on
    its own (every rank must call this), so at most one unsharded tensor exists beyond the result."""
    return {name: full_tensor(t).detach().cpu() for name, t in model.state_dict().items()}


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (an FSDP2 parameter, its total gradient norm); a plain tensor as is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def mean_metrics(metrics: dict, d: Dist) -> dict:
    """Each metric averaged over the ranks that report it (rank 0 logs)."""
    if not d.enabled:
        return metrics
    gathered: list[dict | None] = [None] * d.world
    dist.all_gather_object(gathered, metrics)
    out = {}
    for key in gathered[0]:
        values = [g[key] for g in gathered if key in g and isinstance(g[key], (int, float))]
        out[key] = sum(values) / len(values) if values else gathered[0][key]
    return out


def merge_shard_positions(positions: list[int], rollout_cfg, d: Dist) -> list[int]:
    """Every shard's data position as advanced by the rank that owns it (ranks own contiguous blocks)."""
    gathered: list[list[int] | None] = [None] * d.world
    dist.all_gather_object(gathered, positions)
    per_rank = num_shards(rollout_cfg, d) // d.world
    return [gathered[shard // per_rank][shard] for shard in range(len(positions))]


OPTIM_DCP = "optim_dcp"


def save_sharded_optimizer(model, optimizer, ckpt_tmp: Path) -> None:
    """Under FSDP2: every rank writes its optimizer shard with DCP into the checkpoint being written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(ckpt_tmp / OPTIM_DCP))


def load_sharded_optimizer(model, optimizer, ckpt: Path) -> None:
    """Load a DCP optimizer state written by any number of ranks into this run's (sharded or not) one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)  # the target layout (states initialised)
    dcp.load(state, checkpoint_id=str(ckpt / OPTIM_DCP))
    set_optimizer_state_dict(model, optimizer, state)
