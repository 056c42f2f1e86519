"""Weights from the trainer to its rollout workers over a process group that joins them: NCCL between GPUs, gloo
on CPU (and where NCCL cannot go: a worker sharing a training GPU). The group is a ``torch.distributed`` one of its
own (``weight_group``), built on the rollout store (``bicc.rollout.channel``): trainer rank 0 is its rank 0, worker
i its rank i + 1; the trainer's own process group is not touched. vLLM workers on CUDA use vLLM's weight transfer
instead (``bicc.rollout.vllm_transfer``).

What a push sends (``manifest``): each parameter once (a tied output projection is the embedding, sent once) and
each persistent buffer, under the names of the HF module, in the dtype the sampler computes in (``model.dtype``),
never the fp32 master. It streams: the tensors are cast into one bucket of ``rollout.push_bucket_mib`` at a time,
cut across buckets where a tensor is larger (``plan``), and each full bucket is broadcast from rank 0; under FSDP2
every trainer rank gathers each tensor in turn (``full_tensor``, a collective) and only rank 0 sends. So the
trainer holds one bucket and one gathered tensor beyond its model, on the device it sends from, and no copy of the
model anywhere. A worker receives into its own parameters (HF) or hands each tensor, whole, to its engine as it
completes (vLLM's loader).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from bicc.machine.distributed import full_tensor
from bicc.model.lora import adapted_layers, fold, plain_name


@dataclass(frozen=True)
class Entry:
    """One tensor of a push: its name in the HF module and its shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def manifest(model) -> list[Entry]:
    """What a push sends, in order: every parameter once (``named_parameters`` lists a tied weight under its first
    name only) and every floating-point persistent buffer (what the state dict holds beside the parameters; an
    integer one, such as a table of positions, is no weight and never changes). Under ``model.lora`` the names and
    shapes of the model without adapters: a push sends each adapted weight with its adapters folded in (``pushed``)."""
    every = dict(model.named_parameters(remove_duplicate=False))
    entries = [Entry(plain_name(name), tuple(p.shape)) for name, p in model.named_parameters() if ".lora_" not in name]
    buffers = dict(model.named_buffers())
    entries += [Entry(name, tuple(buffers[name].shape)) for name in model.state_dict()
                if name not in every and name in buffers and buffers[name].is_floating_point()]
    return entries


def tensors_of(model) -> dict:
    """Name -> tensor (a DTensor shard under FSDP2) for every name a manifest of a model without adapters holds (a
    receiver's own parameters)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def pushed(model):
    """A function: a manifest's name -> the whole tensor a push sends under it (gathered under FSDP2, a collective of
    every rank); under ``model.lora`` an adapted layer's weight with its adapters folded in."""
    tensors = {plain_name(name): t for name, t in tensors_of(model).items() if ".lora_" not in name}
    layers = adapted_layers(model)
    return lambda name: fold(layers[name], full_tensor) if name in layers else full_tensor(tensors[name])


def plan(entries: list[Entry], bucket_elems: int) -> list[list[tuple[int, int, int]]]:
    """The buckets of a push: each a list of (entry index, first element, end element), in order, at most
    ``bucket_elems`` elements a bucket; a tensor larger than what is left of a bucket continues in the next."""
    buckets, current, room = [], [], bucket_elems
    for i, entry in enumerate(entries):
        start = 0
        while start < entry.numel:
            stop = min(entry.numel, start + room)
            current.append((i, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                buckets.append(current)
                current, room = [], bucket_elems
    if current:
        buckets.append(current)
    return buckets


def bucket_elems(bucket_mib: float, dtype: torch.dtype, entries: list[Entry] | None = None) -> int:
    """Elements of ``dtype`` in a bucket of ``bucket_mib``; no more than ``entries`` hold in all."""
    elems = max(1, int(bucket_mib * 2**20) // dtype.itemsize)
    return min(elems, max(1, sum(e.numel for e in entries))) if entries else elems


def weight_group(store, rank: int, world: int, backend: str, timeout_s: float):
    """The push's process group: ``rank`` of ``world`` (trainer 0, worker i at i + 1) over ``backend``."""
    prefix = dist.PrefixStore("line/weights", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world, options)
    return dist.ProcessGroupGloo(prefix, rank, world, timeout)


def broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


@torch.no_grad()
def send(model, entries: list[Entry], buckets, group, dtype: torch.dtype, device, capacity: int) -> int:
    """Push ``model``'s weights: every trainer rank calls this (under FSDP2 each tensor is gathered by all); rank 0
    passes the ``group`` and broadcasts, the others pass None. Returns the bytes sent (0 off rank 0)."""
    tensor = pushed(model)
    buffer = torch.empty(capacity, dtype=dtype, device=device) if group is not None else None
    current, flat, sent = -1, None, 0
    for bucket in buckets:
        offset = 0
        for i, start, stop in bucket:
            if i != current:  # gathered once, however many buckets it spans
                current, flat = i, tensor(entries[i].name).detach().reshape(-1)
            if buffer is not None:
                buffer[offset : offset + stop - start].copy_(flat[start:stop])
            offset += stop - start
        if buffer is not None:
            broadcast(group, buffer[:offset])
            sent += offset * dtype.itemsize
    return sent


@torch.no_grad()
def receive(group, entries: list[Entry], buckets, dtype: torch.dtype, device, capacity: int,
            into: dict | None = None, staging=None) -> Iterator[tuple[str, torch.Tensor]]:
    """A worker's side of ``send``: yields each (name, tensor) once it is whole. ``into``: name -> the tensor to
    fill in place (an HF worker's parameters, in ``dtype``), else each is a new tensor on ``device``; ``staging``: where
    the bucket is received (gloo: the CPU), default ``device``."""
    buffer = torch.empty(capacity, dtype=dtype, device=staging or device)
    filling: dict[int, torch.Tensor] = {}
    for bucket in buckets:
        size = sum(stop - start for _, start, stop in bucket)
        broadcast(group, buffer[:size])
        offset = 0
        for i, start, stop in bucket:
            entry = entries[i]
            if i not in filling:
                target = into[entry.name] if into is not None else torch.empty(entry.shape, dtype=dtype, device=device)
                filling[i] = target
            filling[i].view(-1)[start:stop].copy_(buffer[offset : offset + stop - start])
            offset += stop - start
            if stop == entry.numel:
                yield entry.name, filling.pop(i)
