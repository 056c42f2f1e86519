"""Training on several processes under ``torchrun``: process group, FSDP2 or DDP, prompt shards, and checkpoints of
a sharded model (what the ranks share inside a step: ``bicc.machine.ranks``).

A process started without torchrun leaves everything as it is: ``Dist()`` is rank 0 of 1 and every helper here
is then the identity. Under torchrun every process joins the process group, one process included
(``--nproc_per_node=1``): it wraps the model as 4 GPUs do (FSDP2 with its mixed-precision policy: bf16 parameters
for compute over fp32 master weights, no autocast re-casting every op), so a one-GPU check runs the multi-GPU
code.

How a step is split. The ``rollout.shards`` slices of each step's queries are sampled with their own
seeds (``bicc.rollout.collect.collect_rollout``); rank r takes shards ``r*S/W .. (r+1)*S/W - 1``. A whole group
stays on one rank, so advantages, BiCC contexts and RCC's covariance never need another rank. Losses are
normalised by totals summed over all ranks (``bicc.machine.ranks.Ranks``), and gradients are summed, so one process
running the same shards one after another computes the same update (``tests/test_distributed.py``).

Strategies (``dist.strategy``):

- ``fsdp2``: ``fully_shard`` on every decoder layer and at the root; parameters in ``dist.param_dtype``,
  gradients reduce-scattered in ``dist.reduce_dtype``. The rollout engine keeps its own full copy of the
  weights (``full_state_dict``, gathered one parameter at a time), so sampling needs no collective.
- ``ddp``: every rank holds the whole model; after the micro-batches of an optimizer step the gradients
  are summed over ranks in flat buckets (one all-reduce per bucket, not one per micro-batch, so ranks may
  run different numbers of micro-batches, e.g. after DAPO's dynamic sampling).

Checkpoints: rank 0 writes the HF-format weights (a full state dict) and the trainer state; under FSDP2
the optimizer state is saved sharded with ``torch.distributed.checkpoint`` (``bicc.machine.dcp``), which any
world size, one process included, can load back.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The dtype names configs use (model.dtype, dist.param_dtype, ...) and what they mean.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``device``: where the process group's collectives take their
    tensors (``cuda:<local_rank>`` under NCCL, which has no CPU path; ``cpu`` under gloo)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    strategy: str = "none"
    device: str = "cpu"
    cpu_group: object = None  # a gloo group over the same ranks, for Python objects (None: the default group)
    joined: bool = False  # in a process group (torchrun), even of one process

    @property
    def enabled(self) -> bool:
        return self.joined or self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(dist_cfg) -> Dist:
    """Join the process group when launched by torchrun (``LOCAL_RANK`` set), with any number of processes."""
    if "LOCAL_RANK" not in os.environ:  # not started by torchrun
        return Dist()
    backend = dist_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # on this node; RANK is over all nodes
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    timeout = timedelta(minutes=dist_cfg.timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    # objects (evaluation scores, metrics) travel over gloo: pickled on the CPU, never staged through CUDA
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dist_cfg.strategy, device, cpu_group, joined=True)


def shutdown(d: Dist) -> None:
    """Leave the process group. The run's model sits in reference cycles (modules and their FSDP/DDP hooks) that
    still hold the groups and their pending work; collecting them first frees all of it while the groups and the
    interpreter are whole. Left to interpreter exit, gloo's teardown now and then aborts a finished run (SIGABRT,
    "terminate called without an active exception")."""
    if d.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def num_shards(rollout_cfg, d: Dist) -> int:
    """Prompt shards per step: ``rollout.shards``, or one per rank when it is null; each takes an equal share of
    ``rollout.prompts_per_step``."""
    shards = rollout_cfg.shards or d.world
    if rollout_cfg.prompts_per_step % shards:
        raise ValueError(f"config field 'rollout.prompts_per_step': {rollout_cfg.prompts_per_step} queries cannot be "
                         f"split into {shards} prompt shards (rollout.shards, null = one per process); use a multiple "
                         f"of {shards}")
    return shards


def local_shards(rollout_cfg, d: Dist) -> range:
    return shards_of_rank(num_shards(rollout_cfg, d), d, "rollout.shards")


def shards_of_rank(shards: int, d: Dist, field_name: str = "eval.shards") -> range:
    """The shards rank ``d.rank`` takes of ``shards``: a contiguous run of shards / world."""
    if shards % d.world:
        raise ValueError(f"config field '{field_name}': {shards} shards cannot be split over {d.world} processes")
    per_rank = shards // d.world
    return range(d.rank * per_rank, (d.rank + 1) * per_rank)


def wrap(model, dist_cfg, d: Dist, compute_dtype: torch.dtype | None = None, mesh=None):
    """Shard (FSDP2) the model in place; DDP needs no wrapper (see ``sync_gradients``). Under FSDP2 the
    parameters keep their (master) dtype and compute runs in ``dist.param_dtype``, else ``compute_dtype``;
    ``mesh``: the device mesh to shard over (None: every rank of the default group)."""
    if not d.enabled or d.strategy == "ddp":
        if d.enabled:  # identical start on every rank whatever each loaded
            for p in model.parameters():
                dist.broadcast(p.data, 0)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype = DTYPES[dist_cfg.param_dtype] if dist_cfg.param_dtype else compute_dtype
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[dist_cfg.reduce_dtype])
    model.__dict__.pop("bicc_compute_dtype", None)  # FSDP2 casts the gathered parameters itself
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=dist_cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=dist_cfg.reshard_after_forward)
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


def reshard(model) -> None:
    """FSDP2: free every gathered parameter, so that ``model.parameters()`` are this rank's shards again (under
    ``dist.reshard_after_forward=false`` a forward leaves them gathered, in the compute dtype); else nothing."""
    for module in model.modules():
        if is_sharded(module):
            module.reshard()


def broadcast_object(obj, d: Dist):
    """``obj`` as rank 0 has it, on every rank."""
    if not d.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=d.cpu_group)
    return box[0]


def all_gather_objects(obj, d: Dist) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not d.enabled:
        return [obj]
    gathered: list = [None] * d.world
    dist.all_gather_object(gathered, obj, group=d.cpu_group)
    return gathered


def full_state_dict(model, dtype: torch.dtype | None = None, keep: bool = True) -> dict:
    """The full, unsharded weights on CPU (in ``dtype`` if given). Under FSDP2 each parameter is all-gathered on its
    own (every rank must call this), so at most one unsharded tensor exists beyond the result; a rank that does not
    ``keep`` them (all but the one that writes) drops each as soon as it is gathered and returns {}."""
    out = {}
    for name, t in model.state_dict().items():
        full = full_tensor(t)
        if keep:
            out[name] = full.detach().to("cpu", dtype or t.dtype)
    return out


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (an FSDP2 parameter, its total gradient norm); a plain tensor as is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def mean_metrics(metrics: dict, d: Dist) -> dict:
    """Each metric averaged over the ranks that report it (rank 0 logs)."""
    if not d.enabled:
        return metrics
    gathered = all_gather_objects(metrics, d)
    out = {}
    for key in gathered[0]:
        values = [g[key] for g in gathered if key in g and isinstance(g[key], (int, float))]
        out[key] = sum(values) / len(values) if values else gathered[0][key]
    return out


def merge_shard_positions(positions: list[int], rollout_cfg, d: Dist) -> list[int]:
    """Every shard's data position as advanced by the rank that owns it (ranks own contiguous blocks)."""
    gathered = all_gather_objects(positions, d)
    per_rank = num_shards(rollout_cfg, d) // d.world
    return [gathered[shard // per_rank][shard] for shard in range(len(positions))]

