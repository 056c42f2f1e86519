"""The weight push (``bicc.rollout.weight_sync``): what it sends, how it cuts it into buckets, and that a receiver ends
with the trainer's weights in the sampler's dtype, over a real gloo group (threads of this process as its ranks)."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from bicc.model.load import build_tiny
from bicc.rollout.weight_sync import Entry, bucket_elems, manifest, plan, receive, send, tensors_of, weight_group
from tests.helpers import ARCH


def test_buckets_cover_every_element_once_and_cut_large_tensors():
    """Sizes 5, 3, 9 in buckets of 4: [a 0-4], [a 4-5, b 0-3], [c 0-4], [c 4-8], [c 8-9]."""
    entries = [Entry("a", (5,)), Entry("b", (3,)), Entry("c", (3, 3))]
    buckets = plan(entries, 4)
    assert buckets == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(2, 0, 4)], [(2, 4, 8)], [(2, 8, 9)]]
    assert all(sum(b - a for _, a, b in bucket) <= 4 for bucket in buckets)
    assert plan(entries, 100) == [[(0, 0, 5), (1, 0, 3), (2, 0, 9)]]
    assert bucket_elems(1, torch.bfloat16) == 2**19 and bucket_elems(1, torch.float32) == 2**18


def test_a_tied_output_projection_is_sent_once():
    model, _ = build_tiny(ARCH, seed=0)
    names = [e.name for e in manifest(model)]
    assert model.config.tie_word_embeddings and "lm_head.weight" not in names
    assert names.count("model.embed_tokens.weight") == 1
    assert sum(e.numel for e in manifest(model)) == sum(p.numel() for p in model.parameters())  # each once, all
    untied, _ = build_tiny(ARCH.__class__(**{**vars(ARCH), "tie_word_embeddings": False}), seed=0)
    assert "lm_head.weight" in [e.name for e in manifest(untied)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_receivers_end_with_the_trainers_weights_in_the_samplers_dtype(dtype):
    """A trainer (fp32 master weights) pushes to two workers over gloo in buckets smaller than the embedding: one
    receives into its own module in ``dtype`` (an HF worker), the other into new tensors (vLLM's loader). Both hold
    exactly the trainer's weights cast to ``dtype``; the push sent 2 bytes a parameter in bf16 (4 in fp32)."""
    trainer, _ = build_tiny(ARCH, seed=0)
    worker, _ = build_tiny(ARCH, seed=1)  # other weights, which the push must replace
    worker = worker.to(dtype)
    entries = manifest(trainer)
    capacity = 1000  # elements: the embedding (96 x 32) spans four buckets
    buckets = plan(entries, capacity)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    got, sent = {}, {}

    def rank(r):  # each rank a store client of its own, as each process has
        client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
        group = weight_group(client, r, 3, "gloo", 30)
        if r == 0:
            sent["bytes"] = send(trainer, entries, buckets, group, dtype, torch.device("cpu"), capacity)
        elif r == 1:
            for _ in receive(group, entries, buckets, dtype, torch.device("cpu"), capacity, into=tensors_of(worker)):
                pass
        else:
            got.update({name: t.clone() for name, t in receive(group, entries, buckets, dtype, torch.device("cpu"),
                                                                capacity)})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(buckets) > 4 and any(stop - start < e.numel for bucket in buckets for i, start, stop in bucket
                                    for e in [entries[i]])  # some tensor was cut
    params = sum(p.numel() for p in trainer.parameters())
    assert sent["bytes"] == params * dtype.itemsize
    theirs = dict(worker.named_parameters())
    for name, p in trainer.named_parameters():
        assert torch.equal(theirs[name], p.detach().to(dtype)), name
        assert got[name].dtype == dtype and torch.equal(got[name], p.detach().to(dtype)), name
    assert torch.equal(worker.lm_head.weight, worker.model.embed_tokens.weight)  # still tied, and pushed
