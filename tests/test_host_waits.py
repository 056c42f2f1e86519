"""Nothing in the update or the no-grad passes makes the host wait for the GPU once per micro-batch.

On CUDA, a blocking copy between host and device (``.to(device)`` of a host tensor, ``torch.tensor(..., device=)``)
and a read of a tensor's value (``int(t)``, ``.item()``) synchronise the stream: the GPU drains its queue, then
idles while the host prepares what follows (the next micro-batch's inputs, the forward's prologue). This machine
has no GPU, so the audit counts, in one update on CPU, what would wait there:

- reads: the aten op that reads a value back (``_local_scalar_dense``), from anywhere;
- blocking copies that bicc's own code asks for, to a device, other than through ``bicc.model.logprobs.on_device`` (which
  on CUDA copies from pinned memory without a sync).

The same update cut into one micro-batch and into four must count the same: what waits, waits once per step.
(Indexing a GPU tensor with a host index also copies the index with a sync; on CPU that cannot be told apart, so the
update indexes with ``on_device`` rows by construction, and the GPU bench counts every sync: ``bench.update_vs_bare``.)
"""

import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from bicc.kernels.batching import logprobs_no_grad
from bicc.kernels.rows import ContextRows, QueryRows
from bicc.method.conditioning import ConditionedPrompts
from bicc.model.load import build_tiny
from bicc.model.logprobs import make_token_batch, on_device
from bicc.trainer.optim import warmup_cosine
from bicc.trainer.state import RLState
from bicc.trainer.update import update_policy
from tests.conftest import compose_cfg
from tests.helpers import ARCH, ROOT, rows

BICC = str(ROOT / "bicc")


def _moves_to_a_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (a device, its name, or a tensor whose device it takes)."""
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in (*args, kwargs.get("device")))


def _from_bicc() -> bool:
    """Whether the call being audited comes from bicc's code, other than ``on_device``."""
    code = sys._getframe(2).f_code
    return code.co_filename.startswith(BICC) and code.co_name != "on_device"


class Audit(TorchDispatchMode):
    """Counts, while active, the reads and the blocking copies described above."""

    def __init__(self):
        super().__init__()
        self.reads, self.copies = 0, []
        self.patch = pytest.MonkeyPatch()
        to, tensor = torch.Tensor.to, torch.tensor

        def audited_to(t, *args, **kwargs):
            if _moves_to_a_device(args, kwargs) and not kwargs.get("non_blocking") and _from_bicc():
                self.copies.append(sys._getframe(1).f_lineno)
            return to(t, *args, **kwargs)

        def audited_tensor(*args, **kwargs):
            if kwargs.get("device") is not None and _from_bicc():
                self.copies.append(sys._getframe(1).f_lineno)
            return tensor(*args, **kwargs)

        self.patch.setattr(torch.Tensor, "to", audited_to)
        self.patch.setattr(torch, "tensor", audited_tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        self.patch.undo()
        return super().__exit__(*exc)


def numerators(form: str, batch, prompts, completions):
    if form == "q":
        return QueryRows(batch)
    packing = {"kv": (True, "kv"), "mask": (True, "mask"), "rows": (False, "kv")}[form]
    contexts = ConditionedPrompts([p + [50, 51, 52] for p in prompts], [i // 4 for i in range(len(prompts))],
                                  torch.ones(len(prompts), dtype=torch.bool))
    cfg = OmegaConf.create({"context_packing": packing[0], "context_packing_impl": packing[1], "max_packed_len": 64})
    return ContextRows(contexts, completions, batch.completion_len, cfg, 0, torch.device("cpu"))


def audited_update(form: str, micro: int, algo: str = "grpo"):
    cfg = compose_cfg([f"algo={algo}", f"train.micro_batch_size={micro}", "rollout.max_new_tokens=12"])
    prompts, completions = rows()
    prompts = [prompts[i // 4] for i in range(12)]  # 3 prompts x 4 outputs: contexts and prompts to share
    batch = make_token_batch(prompts, completions, 0)
    numerator = numerators(form, batch, prompts, completions)
    model = build_tiny(ARCH, seed=0)[0].double()
    adv = torch.linspace(-1.5, 1.5, 12, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = RLState(model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 0, 100, 1.0))
    ref_logp = logprobs_no_grad(build_tiny(ARCH, seed=1)[0].double(), QueryRows(batch), 12, 12, 1.0)  # a KL's
    with Audit() as update:
        update_policy(state, batch, numerator, None, ref_logp, adv, cfg, step_seed=0)
    with Audit() as no_grad:
        logprobs_no_grad(model, numerator, 12, micro, 1.0)
    return update, no_grad


@pytest.mark.parametrize("form", ["q", "kv", "mask", "rows"])
def test_nothing_waits_once_per_micro_batch(form):
    """One micro-batch of 12 rows and four of 3: the same reads and blocking copies, in the update and in the
    no-grad passes, for the rows on q (one padded row each), KV reuse, mask packing and BiCC's plain rows."""
    one, one_no_grad = audited_update(form, 12)
    four, four_no_grad = audited_update(form, 3)
    assert four.copies == one.copies and four.reads == one.reads, (form, one.copies, four.copies, one.reads, four.reads)
    assert four_no_grad.copies == one_no_grad.copies and four_no_grad.reads == one_no_grad.reads


@pytest.mark.parametrize("algo", ["dr_grpo", "dapo", "gspo", "gmpo", "aspo"])
def test_no_loss_waits_once_per_micro_batch(algo):
    """Every other registered variant's loss (GRPO's above), on KV reuse: nothing per micro-batch either."""
    one, _ = audited_update("kv", 12, algo)
    four, _ = audited_update("kv", 3, algo)
    assert four.copies == one.copies and four.reads == one.reads, (algo, one.copies, four.copies, one.reads, four.reads)


def test_the_audit_sees_a_blocking_copy_and_a_read():
    """The audit counts what it must: a copy asked for in bicc's code, through a module of bicc (``on_device`` on
    CPU is the plain copy, and does not count), and ``int`` of a tensor."""
    import bicc.kernels.batching

    t = torch.arange(3)
    with Audit() as audit:
        on_device(t, "cpu")
        bicc.kernels.batching.to_grid(t[None].double(), torch.ones(1, 3), 3)  # no copy to a device: not counted
        int(t.sum())
    assert audit.copies == [] and audit.reads == 1
    with Audit() as audit:
        bicc.kernels.batching.trim_rows(make_token_batch([[1, 2]], [[3]], 0))  # reads the widths off the batch: 2 reads
    assert audit.reads == 2


def test_on_device_copies_to_cuda_from_pinned_memory_without_a_sync():
    """On CUDA the host tensor is pinned and copied with ``non_blocking``; a tensor already there, or a CPU target,
    is moved as ``Tensor.to`` moves it. (No GPU here: the pinning and the copy are recorded, not run.)"""
    calls = []

    class Host(torch.Tensor):
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, *args, **kwargs):
            calls.append((str(args[0]), kwargs.get("non_blocking", False)))
            return self

    t = torch.arange(3).as_subclass(Host)
    on_device(t, "cuda:0")
    assert calls == ["pin", ("cuda:0", True)]
    calls.clear()
    on_device(t, "cpu")
    assert calls == [("cpu", False)]
