"""vLLM's own weight transfer, for vLLM rollout workers on GPUs (``bicc.rollout.weight_sync`` carries every other
push): the trainer's side is vLLM's ``NCCLTrainerWeightTransferEngine`` over the policy (``PolicySource``: each
tensor once, gathered under FSDP2 and cast to the sampler's dtype), and its ``VLLMWeightSyncClient`` is
``WorkersClient``, which sends each call of the protocol (init, start, update, finish) to every worker over the
rollout line and waits for their answers. Each worker (``bicc.rollout.worker.transfer_call``) hands the call to its
engine, built with ``weight_transfer_config={"backend": "nccl"}``: vLLM receives the packed broadcasts straight into
its model, with no HF copy of the policy and no host copy of the weights. Worker i is rank i + 1 of the NCCL group,
and reaches its rendezvous at the host it reached the trainer's store at. vLLM is imported here only: the module
loads on a CUDA machine with vLLM workers alone.
"""

from __future__ import annotations

import socket

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from bicc.machine import distributed
from bicc.rollout.weight_sync import pushed


class PolicySource(WeightSource):
    """The push's tensors (``bicc.rollout.weight_sync.manifest``) in the sampler's dtype, gathered one at a time."""

    def __init__(self, model, entries, dtype):
        self.model, self.entries, self.dtype = model, entries, dtype

    def metadata(self) -> list:
        return [ParamMeta(e.name, self.dtype, tuple(e.shape)) for e in self.entries]

    def __iter__(self):
        tensor = pushed(self.model)
        for e in self.entries:
            yield e.name, tensor(e.name).detach().to(self.dtype)


class WorkersClient:
    """vLLM's ``VLLMWeightSyncClient`` over the rollout line: each call goes to every worker, answered ``done``."""

    def __init__(self, workers):
        self.workers, self.version = workers, None

    def _call(self, call: str, per_worker=None, **fields) -> None:
        line = self.workers.line
        for link in line.links:
            link.inbox.send("transfer", call=call, **(per_worker(link) if per_worker else {}), **fields)
        line.wait(lambda: line.all("done", call), f"the weight transfer's {call} (version {self.version})")
        line.acks.pop(("done", call), None)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", per_worker=lambda link: {"info": {**init_info, "master_address": link.connect_host,
                                                            "rank_offset": 1 + link.index}})

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info) -> None:
        self._call("update", info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", version=self.version)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def trainer_engine(workers, model, d) -> NCCLTrainerWeightTransferEngine:
    """vLLM's trainer-side engine on every trainer rank (rank 0 sends, the others join the gathers), joined with the
    workers (rank 0 only)."""
    count, port = distributed.broadcast_object((workers.workers, free_port()) if d.is_main else None, d)
    info = NCCLTrainerInitInfo(master_address="0.0.0.0", master_port=port, world_size=count + 1, rank=d.rank,
                               packed=True, packed_buffer_size_bytes=workers.capacity * workers.dtype.itemsize)
    source = PolicySource(model, workers.entries, workers.dtype)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=WorkersClient(workers) if d.is_main else None,
                                                        source=source)
