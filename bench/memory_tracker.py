"""The real RL step of a preset, traced for memory on fake tensors: what one GPU of a multi-GPU FSDP2 run
allocates, phase by phase, measured on this CPU without the GPUs or the weights, beside ``bicc.machine.memory``'s
prediction for the same run.

    .venv/bin/python -m bench.memory_tracker                          # paper_qwen3_4b, dapo, bicc=on rcc=on, 4 ranks
    .venv/bin/python -m bench.memory_tracker --layers 4 rcc=off       # fewer layers; any override of the run

How: the model of the preset's width (``bicc.machine.memory.QWEN3_4B``) is built inside ``FakeTensorMode`` (shapes,
dtypes and storages, no data) and sharded by ``bicc.machine.distributed.wrap`` over W ranks of torch's ``fake`` process
group; ``bicc.trainer.step.rl_step`` then runs as a run would, steps 1 and 2 (the second with AdamW's moments), under
torch's ``FSDPMemTracker``, which counts every tensor alive on this rank. The rollout is replayed: every output
at ``rollout.max_new_tokens`` tokens (the worst case the model assumes) and half of each group right, so that
every sample is conditioned on the other half's attempts. Data-dependent values read back from the model (the
loss, the gradient norm for metrics) are placeholders: nothing branches on them but the non-finite guard, which
is told that they are finite. What it does not count: the CUDA context and workspaces, the caching allocator's
fragmentation, vLLM's share (the rollout and evaluation are not run), and kernels' own workspaces (attention is
dispatched as on a CPU). Its tensors are the ones the model's terms stand for, so the comparison is term for term.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bicc.machine.memory import GIB, QWEN3_4B, Arch, Run, phases
from bicc.rollout import Engine
from bicc.trainer.fit import run_of

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qwen3_4b": QWEN3_4B,  # make gpu-check's rehearsal: Qwen3-0.6B's shape (bench.gpu_check.QWEN3_06B)
          "qwen3_0.6b": Arch(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                             tied=True)}
PRESET = ["experiment=paper_qwen3_4b", "algo=dapo", "bicc=on", "rcc=on", "rollout=hf", "train.steps=2"]
PROMPT_CHARS = 300  # a long DAPO-Math prompt, one token per character under the character tokenizer


class ReplayEngine(Engine):
    """Every prompt's G outputs at ``max_new_tokens`` tokens, the first half of each group right."""

    returns_logprobs = False

    def generate(self, prompts, sampling):
        from bicc.rollout import RolloutOutput

        rows = [p for p in prompts for _ in range(sampling.n)]
        outputs = [[5 + (i + t) % 60 for t in range(sampling.max_new_tokens)] for i in range(len(rows))]
        texts = ["right" if i % sampling.n < sampling.n // 2 else "wrong" for i in range(len(rows))]
        return RolloutOutput(rows, outputs, texts, [False] * len(rows))

    def update_weights(self, model, version):
        self.version = version


@dataclasses.dataclass
class Problem:
    id: int
    prompt: str
    answer: str = "right"


class HalfRightTask:
    answer_anchors = ()

    def train_problem(self, i: int) -> Problem:
        return Problem(i, "q" * PROMPT_CHARS)

    def reward(self, completion: str, problem: Problem) -> float:
        return float(completion == problem.answer)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from bicc.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose(config_name="train", overrides=overrides)


def hf_config(arch: Arch, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=arch.vocab, hidden_size=arch.hidden, num_hidden_layers=layers,
                       num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                       intermediate_size=arch.intermediate, tie_word_embeddings=arch.tied, max_position_embeddings=8192)


def trace(cfg, arch: Arch, layers: int, world: int, steps: int = 2) -> tuple[dict[str, float], dict[str, dict]]:
    """Peak bytes alive on rank 0 in each phase of ``steps`` RL steps (the largest over the steps), and what was
    alive at each peak by the tracker's categories."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Qwen3ForCausalLM

    import bicc.trainer.step
    from bicc.config import StepConfig
    from bicc.machine import distributed
    from bicc.machine.distributed import DTYPES
    from bicc.machine.ranks import Ranks
    from bicc.model.load import enable_checkpointing
    from bicc.model.logprobs import install_logprob_head
    from bicc.model.tokenizer import build_char_tokenizer
    from bicc.rollout.collect import Collection
    from bicc.trainer.optim import build_optimizer, warmup_cosine
    from bicc.trainer.plan import loads_reference
    from bicc.trainer.state import RLState, peak_lr

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))  # before FakeTensorMode: the mesh is built from real ranks
    d = distributed.Dist(0, world, 0, "fsdp2", "cpu", joined=True)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        anchor = torch.empty(0)
        model = Qwen3ForCausalLM(hf_config(arch, layers))
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(model, cfg.model.checkpoint_policy, cfg.model.checkpoint_layers)
        install_logprob_head(model, cfg.train.logprob_chunk_tokens)
        model = distributed.wrap(model, cfg.dist, d, DTYPES[cfg.model.dtype], mesh)
        optimizer = build_optimizer(model, peak_lr(cfg.optim, cfg.bicc), cfg.optim.betas, cfg.optim.weight_decay)
        with torch.no_grad():  # FSDP2's lazy init: its persistent all-gather buffers are fake from here on
            model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        ref = None
        if loads_reference(StepConfig.of(cfg)):  # as bicc.trainer.state.build_rl_state loads it: RCC's delta or a KL term
            previous = torch.get_default_dtype()
            torch.set_default_dtype(DTYPES[cfg.model.dtype])
            ref = Qwen3ForCausalLM(hf_config(arch, layers))
            torch.set_default_dtype(previous)
            install_logprob_head(ref)
            ref.requires_grad_(False).eval()

    def allocate(self, size, *, dtype, device):  # FSDP2's per-call collective buffers: fake, and seen by the tracker
        return anchor.new_empty(tuple(size), dtype=dtype, device=device)

    _fsdp_collectives.DefaultAllocMixin.allocate = allocate
    _fsdp_collectives.ProcessGroupAllocMixin.allocate = allocate

    def to_fake(module, args, kwargs):  # the rows are built from real token ids; the model sees them as fake
        convert = lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t  # noqa: E731
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    for m in (model, ref) if ref is not None else (model,):
        m.register_forward_pre_hook(to_fake, with_kwargs=True, prepend=True)

    class Placeholders(TorchDispatchMode):
        """A fake tensor's value read back: finite (True, 1, 1.0)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                return True if args[0].dtype == torch.bool else (1.0 if args[0].dtype.is_floating_point else 1)
            return func(*args, **(kwargs or {}))

    class Tracker(FSDPMemTracker):
        """FSDPMemTracker for a step with many forwards of the root (no-grad passes, micro-batches): each
        forward starts the module's statistics afresh instead of refusing a second iteration."""

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                if not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return again

    class NoHandle:
        def remove(self):
            pass

    # torch's ModTracker (inside the tracker) hooks every module's inputs and outputs to learn when backward reaches
    # it; in this trace those hooks keep each decoder layer's input of every micro-batch alive past its backward
    # (16 of [8, 2047, 2560] bf16 at the optimizer step with 2 layers; none in a real run, FSDP2 or not). Without
    # them the tracker counts the same tensors, but cannot tell a recomputation from a forward (not needed here).
    register_multi_grad_hook = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = lambda *args, **kwargs: NoHandle()
    tracker = Tracker(model, optimizer)
    for t in (*ref.parameters(), *ref.buffers()) if ref is not None else ():  # the reference: a full copy on every rank
        tracker._update_and_maybe_create_winfos(t, _FSDPRefType.UNSHARDED_PARAM)
    peaks: dict[str, float] = {}
    breakdown: dict[str, dict] = {}
    stack: list[tuple[int, dict]] = []
    device = torch.device("cpu")

    @contextmanager
    def window(name: str):
        """The peak inside: the tracker's running peak restarted at what is alive now, the outer window's kept."""
        stack.append((tracker._peak_mem.get(device, 0), tracker._peak_mem_snap.get(device, {})))
        now = tracker.get_tracker_snapshot()[device]
        tracker._peak_mem[device], tracker._peak_mem_snap[device] = now["Total"], now
        try:
            yield
        finally:
            inner, snap = tracker._peak_mem.get(device, 0), tracker._peak_mem_snap.get(device, {})
            if inner >= peaks.get(name, 0):
                peaks[name], breakdown[name] = inner, {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}
            outer, outer_snap = stack.pop()
            if outer > inner:
                tracker._peak_mem[device], tracker._peak_mem_snap[device] = outer, outer_snap

    def phase(name: str, fn):
        def timed(*args, **kwargs):
            with window(name):
                return fn(*args, **kwargs)

        return timed

    originals = {name: getattr(bicc.trainer.step, name) for name in ("collect_rollout", "step_logprobs", "update_policy")}
    bicc.trainer.step.collect_rollout = phase("rollout", originals["collect_rollout"])
    bicc.trainer.step.step_logprobs = phase("no-grad log-probs", originals["step_logprobs"])
    bicc.trainer.step.update_policy = phase("update", originals["update_policy"])
    scheduler = warmup_cosine(optimizer, 1, max(2, steps), 0.0)
    step = optimizer.step
    optimizer.step = phase("optimizer step", step)
    s = RLState(model, ref_model=ref, tokenizer=build_char_tokenizer(), engine=ReplayEngine(), optimizer=optimizer,
                scheduler=scheduler, task=HalfRightTask(), dist=d, shards=distributed.local_shards(cfg.rollout, d),
                num_shards=distributed.num_shards(cfg.rollout, d), collection=Collection.of(cfg.algo, cfg.rollout, cfg.data),
                ranks=Ranks.of(d, cfg.dist))
    try:
        with tracker, Placeholders():
            for _ in range(steps):
                bicc.trainer.step.rl_step(s, StepConfig.of(cfg))
    finally:
        mod_tracker.register_multi_grad_hook = register_multi_grad_hook
        for name, fn in originals.items():
            setattr(bicc.trainer.step, name, fn)
        optimizer.step = step
    peaks["run"] = max(peaks.values())
    return peaks, breakdown


def predicted(cfg, arch: Arch, world: int, prompt_tokens: int) -> dict[str, float]:
    """``bicc.machine.memory``'s phases for the traced run, without what the trace cannot see (runtime, fragmentation,
    vLLM): the update is the largest of its sub-phases."""
    from bicc.config import StepConfig

    # the trace replays its rollout: no engine at all (as vLLM at a zero share: no HF sampler copy, no generate)
    groups = run_of(StepConfig.of(cfg), cfg.model, cfg.eval, cfg.dist, world, True, 80.0, prompt_tokens)
    run = dataclasses.replace(groups, runtime_gib=0.0, fragmentation=0.0, vllm=True, vllm_utilization=0.0, eval_vllm=True)
    table = {name: sum(parts.values()) for name, parts in phases(arch, run).items()}
    update = max(v for k, v in table.items() if k.startswith("update"))
    return {"rollout": table["rollout"], "no-grad log-probs": table["no-grad log-probs"], "update": update,
            "optimizer step": table["optimizer step"], "run": max(table["rollout"], table["no-grad log-probs"], update,
                                                                   table["optimizer step"])}


def unsupported(version: str) -> str | None:
    """Why this trace cannot be trusted under torch ``version`` (None where it can): it is held to the model on torch
    2.13 (requirements.txt); on 2.11 the tracker counted fused AdamW's step on fake tensors as about nine times the
    optimizer's state (13.3 GiB against 1.5 at 4 layers), which no GPU run on 2.11 showed."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 13):
        return (f"bench.memory_tracker needs torch 2.13 or newer (requirements.txt), found {version}: older "
                "releases are unchecked, and 2.11's FSDPMemTracker miscounted the optimizer step on fake tensors")
    return None


def main() -> int:
    if why := unsupported(torch.__version__):
        print(why, file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["qwen3_4b", "qwen3_0.6b"], default="qwen3_4b",
                        help="the model's width: the preset's, or make gpu-check's rehearsal's")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--world", type=int, default=4, help="ranks the model is sharded over")
    parser.add_argument("--json", default=None, help="also write the traced and predicted peaks (bytes) here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after the preset's")
    args = parser.parse_args()
    cfg = compose([*PRESET, *args.overrides])
    arch = SHAPES[args.shape]
    arch = dataclasses.replace(arch, layers=args.layers or arch.layers)
    start = time.perf_counter()
    traced, breakdown = trace(cfg, arch, arch.layers, args.world)
    from bicc.model.tokenizer import build_char_tokenizer
    from bicc.trainer.validation import context_template_tokens, longest_training_prompt

    tokenizer = build_char_tokenizer()
    prompt = (longest_training_prompt(HalfRightTask(), tokenizer, 1)[0]
              + context_template_tokens(cfg.bicc, cfg.rollout.group_size, tokenizer))
    model = predicted(cfg, arch, args.world, prompt)
    print(f"\n{arch.params() / 1e9:.2f}B parameters ({arch.layers} layers), {args.world} ranks, "
          f"{' '.join([*PRESET, *args.overrides])}; traced in {time.perf_counter() - start:.0f} s")
    print(f"  {'phase':<20} {'traced GiB':>10} {'bicc.machine.memory':>12} {'model / traced':>15}")
    for name in ("rollout", "no-grad log-probs", "update", "optimizer step", "run"):
        print(f"  {name:<20} {traced[name] / GIB:10.2f} {model[name] / GIB:12.2f} {model[name] / traced[name]:15.3f}")
    print("  at each phase's peak, by the tracker's categories (GiB):")
    for name, parts in breakdown.items():
        print(f"    {name:<18} " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v and k != "Total"))
    # on a GPU of the run's: the traced tensors, the allocator's slack and the CUDA runtime as the model counts them
    on_gpu = traced["run"] * (1 + Run.fragmentation) + Run.runtime_gib * GIB
    print(f"RESULT memory_tracker_run_gib={traced['run'] / GIB:.2f}")
    print(f"RESULT memory_tracker_on_gpu_gib={on_gpu / GIB:.2f} target<=72")
    print(f"RESULT memory_model_vs_tracker={model['run'] / traced['run']:.3f} target>=0.9")
    if args.json:
        Path(args.json).write_text(json.dumps({"traced": traced, "model": model, "on_gpu": on_gpu}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
