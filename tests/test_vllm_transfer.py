"""vLLM's weight transfer for vLLM rollout workers on GPUs (``bicc.rollout.vllm_transfer``), in the parts that run
without a GPU: the source it streams (held to vLLM's own check that metadata and iteration agree) and the client
that carries vLLM's protocol to every worker over the rollout line. The NCCL broadcast itself needs GPUs."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from bicc.model.load import build_tiny  # noqa: E402
from bicc.rollout.vllm_transfer import PolicySource, WorkersClient  # noqa: E402
from bicc.rollout.weight_sync import manifest  # noqa: E402
from tests.helpers import ARCH  # noqa: E402


def test_the_source_streams_each_tensor_once_in_the_samplers_dtype():
    """What vLLM's trainer engine broadcasts: the push's manifest (the tied head once), in bf16, in the order its
    metadata declares; ``NCCLTrainerWeightTransferEngine._checked_iter`` (vLLM's check that the two agree, which
    otherwise splits the stream differently on each side) passes it whole."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    model, _ = build_tiny(ARCH, seed=0)
    source = PolicySource(model, manifest(model), torch.bfloat16)
    meta = source.metadata()
    assert [m.name for m in meta] == [e.name for e in manifest(model)] and "lm_head.weight" not in [m.name for m in meta]
    assert all(m.dtype == torch.bfloat16 for m in meta)
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    params = dict(model.named_parameters())
    assert [n for n, _ in sent] == [m.name for m in meta]
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, params[n].detach().to(torch.bfloat16)) for n, t in sent)


class FakeLine:
    """The rollout line's surface the client uses: links with an inbox, ``wait`` and ``all`` over ``acks``."""

    def __init__(self, hosts):
        self.sent, self.acks = [], {}
        self.links = [SimpleNamespace(index=i, connect_host=h, inbox=SimpleNamespace(
            send=lambda kind, i=i, **fields: self.sent.append((i, kind, fields)))) for i, h in enumerate(hosts)]

    def all(self, kind, key=None):
        return len(self.acks.get((kind, key), ())) == len(self.links)

    def wait(self, done, what):
        self.acks[("done", self.sent[-1][2]["call"])] = {link.index for link in self.links}  # every worker answers
        assert done(), what


def test_the_client_carries_each_call_to_every_worker():
    """vLLM's init info reaches worker i as NCCL rank 1 + i, its rendezvous at the host the worker reached the
    trainer's store at (a worker on another node cannot reach 0.0.0.0); start, update and finish go to every worker,
    finish with the version being pushed, and each call waits for every worker's answer."""
    line = FakeLine(["127.0.0.1", "node0"])
    client = WorkersClient(SimpleNamespace(line=line))
    client.version = 7
    client.init_weight_transfer_engine({"master_address": "0.0.0.0", "master_port": 1234, "world_size": 3})
    client.start_weight_update()
    client.update_weights({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    client.finish_weight_update()
    inits = [(i, f["info"]) for i, kind, f in line.sent if f["call"] == "init"]
    assert inits == [(0, {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 3, "rank_offset": 1}),
                     (1, {"master_address": "node0", "master_port": 1234, "world_size": 3, "rank_offset": 2})]
    assert [f["call"] for i, _, f in line.sent] == ["init", "init", "start", "start", "update", "update", "finish",
                                                    "finish"]
    assert all(f["version"] == 7 for _, _, f in line.sent if f["call"] == "finish")
    assert all(kind == "transfer" for _, kind, _ in line.sent) and line.acks == {}  # each round's answers cleared
