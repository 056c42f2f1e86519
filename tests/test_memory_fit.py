"""The memory check at launch (``bicc.machine.memory``): the run's predicted peak per GPU against the memory it may use,
before any weights load."""

import dataclasses
import re

import pytest
import torch

from bicc.machine.memory import QWEN3_4B, Run, peak, phases
from bicc.trainer.fit import check_fit, knob
from tests.conftest import compose_cfg, run_of
from tests.helpers import SMALL, run_train

GIB = 1024**3


def test_the_launchers_numbers_for_the_paper_preset_are_the_memory_tables():
    """run_of reads the preset as docs/performance.md's table counts it: 4 GPUs, micro-batch 8 x 2,048 output
    tokens, 16 contexts and 64 rows a GPU (32 prompts x 2 sides or x G 8, over 4), bf16 compute under FSDP2,
    vLLM at 0.4, the reference loaded for RCC's delta, evaluation through vLLM at 4,096 new tokens."""
    from bicc.model.load import resolve_attn_implementation

    cfg = compose_cfg(["experiment=paper_qwen3_4b", "algo=dapo", "bicc=on", "rcc=on"])
    flash = resolve_attn_implementation("flash_attention_2") == "flash_attention_2"  # SDPA without flash-attn or CUDA
    # an HF generate evaluation call holds eval.batch_size rows at most, fewer under eval.limit x samples per problem
    expected = dataclasses.replace(Run(), flash=flash, eval_rows=cfg.eval.batch_size)
    assert run_of(cfg, world=4, sharded=True, gpu_gib=80.0, prompt_tokens=300) == expected
    limited = compose_cfg(["experiment=paper_qwen3_4b", "eval.limit=2", "eval.samples_per_problem=4"])
    assert run_of(limited, 4, True, 80.0, 300).eval_rows == 8
    assert run_of(compose_cfg(["experiment=paper_qwen3_4b", "model.attn_implementation=sdpa"]), 4, True, 80.0, 300).flash is False
    # two GPUs: each holds twice the rows and contexts; one process without FSDP2 computes in model.dtype
    two = run_of(cfg, world=2, sharded=True, gpu_gib=80.0, prompt_tokens=300)
    assert (two.rows, two.contexts, two.world) == (128, 32, 2)
    assert run_of(compose_cfg(["experiment=paper_qwen3_4b", "rcc=off", "bicc=off"]), 4, True, 80.0, 300).reference is False


def test_the_no_grad_passes_by_hand_and_what_max_memory_allocated_counts():
    """A no-grad pass's head chunk is its fp32 logits beside the bf16 ones they came from (6 bytes per logit); the
    contexts' K/V only where a no-grad pass runs on x^c; ``allocated`` drops the runtime and the allocator's slack."""
    from bicc.machine.memory import allocated, phases

    run = Run()  # chunk 1,024 tokens, bf16
    on_q = phases(QWEN3_4B, run)["no-grad log-probs"]
    assert on_q["log-prob head chunk"] == 1024 * 151_936 * 6 and on_q["BiCC contexts' K/V (no grad)"] == 0
    on_xc = phases(QWEN3_4B, dataclasses.replace(run, no_grad_on_context=True))["no-grad log-probs"]
    # 16 contexts x (300 prompt + 0.4 x 2,048) tokens x 36 layers x K and V x 8 heads x 128 x 2 bytes
    assert on_xc["BiCC contexts' K/V (no grad)"] == 16 * (300 + 819) * 36 * 2 * 8 * 128 * 2
    rollout = phases(QWEN3_4B, run)["rollout"]
    assert allocated(QWEN3_4B, run)["rollout"] == sum(rollout.values()) - rollout["runtime"] - rollout["allocator fragmentation"]
    # the presets (pi_old and pi_ref on q) run no no-grad pass on x^c; RCC's delta on x^c (Algorithm 1's form) does
    assert run_of(compose_cfg(["experiment=paper_qwen3_4b"]), 4, True, 80.0, 300).no_grad_on_context is False
    xc = compose_cfg(["experiment=paper_qwen3_4b", "rcc.delta_context=xc"])
    assert run_of(xc, 4, True, 80.0, 300).no_grad_on_context is True


def test_the_update_peak_by_hand():
    """The update's worst point is the top layer's backward in a minibatch's second micro-batch or later: every
    layer's checkpointed input is kept, and the earlier micro-batches' gradients are all held (sharded over the 4
    GPUs). Each completion's rows of its context's keys/values are picked inside its layer's call, so nothing of
    them outlives the layer. The head's chunk holds three fp32 [1,024, V] buffers: logits, exponentials, and the
    entropy's product of the two."""
    from bicc.machine.memory import phases

    preset = phases(QWEN3_4B, Run())
    update, head = preset["update: layers backward"], preset["update: head backward"]
    assert update["gradients (fp32, sharded)"] == head["gradients (fp32, sharded)"] == 4 * 4_022_468_096 / 4
    assert update["checkpointed layer inputs"] == head["checkpointed layer inputs"] == 36 * 8 * 2048 * 2560 * 2
    assert head["log-prob head chunk"] == 1024 * 151_936 * 12
    assert not [k for p in preset.values() for k in p if "prefix keys" in k or "gathered K/V" in k]
    # without BiCC every row carries its prompt: 8 x (300 + 2,048) tokens a micro-batch
    plain = phases(QWEN3_4B, dataclasses.replace(Run(), bicc=False))["update: layers backward"]
    assert plain["checkpointed layer inputs"] == 36 * 8 * (300 + 2048) * 2560 * 2


def test_the_compiled_layers_fused_weights_by_hand():
    """``model.compile`` concatenates a layer's q/k/v (2,560 x (32 + 2 x 8) heads x 128) and gate/up (2 x 2,560 x
    9,728) weights: 65,536,000 bf16 values under FSDP2, held with their gradient in a layer's backward (the layers'
    and the contexts'), alone in a no-grad forward; fp32 in one process (its master weights); nothing when off."""
    from bicc.machine.memory import phases

    key, pair = "fused projection weights (model.compile)", "fused projection weights + their gradient (model.compile)"
    on = phases(QWEN3_4B, dataclasses.replace(Run(), compiled=True))
    off = phases(QWEN3_4B, Run())
    assert on["update: layers backward"][pair] == on["update: contexts backward"][pair] == 2 * 65_536_000 * 2
    assert on["no-grad log-probs"][key] == 65_536_000 * 2
    one = phases(QWEN3_4B, dataclasses.replace(Run(), compiled=True, sharded=False, world=1))
    assert one["update: layers backward"][pair] == 2 * 65_536_000 * 4
    assert not {key, pair} & set(on["rollout"])
    for phase in ("update: layers backward", "update: contexts backward", "no-grad log-probs", "rollout"):
        assert not {key, pair} & set(off[phase])
    assert sum(on["update: layers backward"].values()) - sum(off["update: layers backward"].values()) == pytest.approx(
        1.1 * 4 * 65_536_000)  # with the allocator's 10% on it
    for setting, compiled in (("on", True), ("auto", True), ("off", False)):
        cfg = compose_cfg(["experiment=paper_qwen3_4b", f"model.compile={setting}"])
        assert run_of(cfg, 4, True, 80.0, 300).compiled is compiled


def test_the_compiled_head_by_hand():
    """Compiled (``bicc.kernels.compile.compile_head``), the head's [n, V] work after its matmul is one fused pass: the
    update's chunk holds the matmul's output in the compute dtype and the exponentials kept for the backward in fp32,
    2 + 4 bytes a logit in bf16, where eager holds 12 (fp32 logits, exponentials, the entropy's product of the two);
    a no-grad chunk holds the matmul's output alone, 2 bytes, where eager holds 6. In fp32: 8 and 4, eager 12 and 4.
    (Resident peaks of one chunk on CPU, ``tests/test_head_memory.py``, are these counts.)"""
    from bicc.machine.memory import phases

    logits = 1024 * 151_936
    for compute, compiled, update, no_grad in ((2, True, 6, 2), (2, False, 12, 6), (4, True, 8, 4), (4, False, 12, 4)):
        run = dataclasses.replace(Run(), compiled=compiled, compute_bytes=compute)
        table = phases(QWEN3_4B, run)
        assert table["update: head backward"]["log-prob head chunk"] == logits * update, (compute, compiled)
        assert table["no-grad log-probs"]["log-prob head chunk"] == logits * no_grad, (compute, compiled)


def test_fsdp2_options_that_hold_more_by_hand():
    """FSDP2 over 4 GPUs, bf16 gathered layers of 100,930,816 parameters (2 x 2,560 x 4,096 + 2 x 2,560 x 1,024 + 3 x
    2,560 x 9,728 + 2 x 2,560 + 2 x 128). By default two are gathered at a time. ``dist.reshard_after_forward=false``
    keeps all 36 from the no-grad passes, and in the update from the forward until each layer's backward (the
    head's backward and the top layer's see all 36); ``dist.reshard_after_backward=false`` keeps them through a
    minibatch's backwards but its last (the layers' and the root's backward see all 36); ``dist.reduce_grads=step``
    holds every gradient unreduced in fp32, unsharded (4 bytes x 4,022,468,096 parameters) in place of the sharded
    ones."""
    from bicc.machine.memory import phases

    layer, kept = 100_930_816 * 2, "FSDP2 gathered layers (kept: dist.reshard_after_*=false)"
    assert QWEN3_4B.layer_params() == 100_930_816 and QWEN3_4B.params() == 4_022_468_096
    base = phases(QWEN3_4B, Run())
    assert all(p["FSDP2 gathered layers (current + prefetch)"] == 2 * layer for k, p in base.items() if "update" in k)
    fwd = phases(QWEN3_4B, dataclasses.replace(Run(), reshard_after_forward=False))
    bwd = phases(QWEN3_4B, dataclasses.replace(Run(), reshard_after_backward=False))
    assert fwd["no-grad log-probs"][kept] == fwd["update: head backward"][kept] == 36 * layer
    for phase in ("update: head backward", "update: layers backward", "update: contexts backward", "update: root reduce-scatter"):
        assert bwd[phase][kept] == 36 * layer, phase
    assert kept not in bwd["no-grad log-probs"] and kept not in fwd["update: contexts backward"]
    for phases_ in (fwd, bwd):  # resharded by the last backward: nothing more between steps
        assert phases_["optimizer step"] == base["optimizer step"] and phases_["rollout"] == base["rollout"]
    assert fwd["update: layers backward"][kept] == 36 * layer  # at the top layer's backward, the first
    unreduced = phases(QWEN3_4B, dataclasses.replace(Run(), reduce_per_step=True))
    name = "unreduced gradients (fp32, unsharded: dist.reduce_grads=step)"
    for phase in ("update: head backward", "update: layers backward", "update: contexts backward", "update: root reduce-scatter"):
        assert unreduced[phase][name] == 4 * 4_022_468_096 and "gradients (fp32, sharded)" not in unreduced[phase]
    one_process = dataclasses.replace(Run(), sharded=False, world=1, reshard_after_forward=False, reshard_after_backward=False)
    assert not any(kept in p for p in phases(QWEN3_4B, one_process).values())  # no FSDP2, nothing kept
    cfg = compose_cfg(["experiment=paper_qwen3_4b", "dist.reshard_after_forward=false", "dist.reduce_grads=step"])
    run = run_of(cfg, 4, True, 80.0, 300)
    assert (run.reshard_after_forward, run.reshard_after_backward, run.reduce_per_step) == (False, True, True)
    assert knob("update: layers backward", run).endswith("dist.reshard_after_forward=true, dist.reduce_grads=micro_batch")
    assert knob("no-grad log-probs", run) == "train.logprob_chunk_tokens, dist.reshard_after_forward=true"
    assert "dist." not in knob("update: layers backward", Run()) + knob("no-grad log-probs", Run())


def test_a_config_that_fits_gets_its_line_and_one_that_does_not_names_the_knob():
    run = Run()
    phase, value = peak(QWEN3_4B, run)
    line = check_fit(QWEN3_4B, run, 80.0)
    assert f"predicted peak {value / GIB:.1f} GiB per GPU ({phase}) of 80.0 GiB" in line
    with pytest.raises(ValueError, match="train.memory_gib") as err:
        check_fit(QWEN3_4B, run, value / GIB - 0.1)
    assert knob(phase, run) in str(err.value) and "train.memory_check=false" in str(err.value)


def test_each_phase_names_its_own_knob():
    hf = dataclasses.replace(Run(), vllm=False, eval_vllm=False)
    assert "gpu_memory_utilization" in knob("rollout", Run()) and "gpu_memory_utilization" in knob("evaluation", Run())
    assert "eval.batch_tokens" in knob("evaluation", hf)
    assert "micro_batch_size" in knob("update: layers backward", Run())
    assert "nproc_per_node" in knob("optimizer step", Run())
    # a micro-batch too large for 40 GiB: the update's phase is the peak and the message says what to lower
    big = dataclasses.replace(Run(), micro_batch=64, gpu_gib=40.0)
    assert peak(QWEN3_4B, big)[0].startswith("update")
    with pytest.raises(ValueError, match="train.micro_batch_size"):
        check_fit(QWEN3_4B, big, 40.0)


@pytest.mark.launch
def test_a_run_that_cannot_fit_is_refused_before_anything_loads(tmp_path):
    """train.py with a 1 MiB budget: refused with the knob, before the warm start, the weights or a step."""
    proc = run_train([*SMALL, "train.memory_gib=0.001", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, check=False)
    assert proc.returncode != 0
    assert "does not fit" in proc.stderr and "train.memory_gib" in proc.stderr and "Lower " in proc.stderr
    assert "[sft]" not in proc.stdout and "[rl]" not in proc.stdout and "[eval]" not in proc.stdout
    # the same run told to start anyway runs (no RL step needed to show it: train.steps=0)
    small = [a for a in SMALL if not a.startswith("train.steps")]
    proc = run_train([*small, "train.steps=0", "train.memory_gib=0.001", "train.memory_check=false",
                      f"hydra.run.dir={tmp_path / 'anyway'}"], tmp_path)
    assert "[memory]" not in proc.stdout and "[eval] final policy" in proc.stdout


class FakeCuda:
    """torch.cuda's peak counters over a pretend allocator: reserved grows with the peak and never shrinks."""

    def __init__(self):
        self.now = self.max_allocated = self.reserved = self.max_reserved = 0

    def allocate(self, n):
        self.now += n
        self.max_allocated = max(self.max_allocated, self.now)
        self.reserved = max(self.reserved, self.now)
        self.max_reserved = max(self.max_reserved, self.reserved)

    def max_memory_allocated(self, device):
        return self.max_allocated

    def max_memory_reserved(self, device):
        return self.max_reserved

    def reset_peak_memory_stats(self, device):
        self.max_allocated, self.max_reserved = self.now, self.reserved


def test_each_phase_keeps_its_own_peak_and_the_run_the_largest():
    from bicc.machine.tracking import PhasePeaks

    cuda = FakeCuda()
    peaks = PhasePeaks("cuda:0", stats=cuda)
    cuda.allocate(13 * GIB)  # loading: 13 GiB at once, then 3 GiB of weights kept; the run's peak, before any phase
    cuda.allocate(-10 * GIB)
    with peaks.phase("generate"):
        cuda.allocate(5 * GIB)
        cuda.allocate(-5 * GIB)
    with peaks.phase("update"):
        cuda.allocate(2 * GIB)
        cuda.allocate(-2 * GIB)
    with peaks.phase("generate"):  # a later, smaller generate does not lower the first one's
        cuda.allocate(1 * GIB)
        cuda.allocate(-1 * GIB)
    got = peaks.gib()
    assert got["generate"] == {"allocated": 8.0, "reserved": 13.0}  # reserved: what the allocator kept from loading
    assert got["update"] == {"allocated": 5.0, "reserved": 13.0}
    assert got["run"] == {"allocated": 13.0, "reserved": 13.0}
    assert PhasePeaks(None).gib() == {} and PhasePeaks(__import__("torch").device("cpu")).gib() == {}


def test_a_step_measures_its_generate_log_probs_and_update(monkeypatch):
    """rl_step opens one phase per part of the step, in order, each closed before the next opens."""
    import torch

    from bench.memory_tracker import HalfRightTask, ReplayEngine
    from bicc.config import StepConfig
    from bicc.model.load import build_tiny
    from bicc.model.logprobs import install_logprob_head
    from bicc.rollout.collect import Collection
    from bicc.trainer.optim import build_optimizer, warmup_cosine
    from bicc.trainer.state import RLState
    from bicc.trainer.step import rl_step

    cfg = compose_cfg(["bicc=on", "rcc=on", "rollout.max_new_tokens=8", "rollout.prompts_per_step=2",
                       "rollout.group_size=4", "diag.every=0"])
    model, tokenizer = build_tiny(cfg.model.tiny, 0)
    install_logprob_head(model)
    ref, _ = build_tiny(cfg.model.tiny, 0)
    install_logprob_head(ref)
    optimizer = build_optimizer(model, 1e-4, (0.9, 0.999), 0.0)
    events = []

    class Recording:
        def phase(self, name):
            import contextlib

            @contextlib.contextmanager
            def inside():
                events.append(("open", name))
                yield
                events.append(("close", name))

            return inside()

    s = RLState(model, ref_model=ref.requires_grad_(False), tokenizer=tokenizer, engine=ReplayEngine(), optimizer=optimizer,
                scheduler=warmup_cosine(optimizer, 1, 10, 0.0), task=HalfRightTask(), peaks=Recording(),
                collection=Collection.of(cfg.algo, cfg.rollout, cfg.data))
    rl_step(s, StepConfig.of(cfg))
    assert events == [(e, n) for n in ("generate", "log-probs", "update") for e in ("open", "close")]
    assert torch.isfinite(next(model.parameters())).all()


def test_a_model_it_cannot_count_gets_a_warning_naming_why_and_starts(monkeypatch):
    """A mixture of experts (Qwen3-MoE's config keys) or another model type: the check says what it cannot count
    and returns its warning instead of refusing; under checkpoint_layers=auto every layer is checkpointed."""
    from types import SimpleNamespace

    import transformers

    from bicc.trainer import fit
    from tests.conftest import compose_cfg

    dense = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 vocab_size=1000)
    assert fit.arch_of(SimpleNamespace(**dense)).layers == 2
    for config, says in ((dict(dense, model_type="qwen3_moe", num_experts=128, moe_intermediate_size=768),
                          "qwen3_moe is a mixture of experts (num_experts=128, moe_intermediate_size=768)"),
                         (dict(dense, model_type="mamba"), "model type 'mamba' is not one of the dense layouts")):
        with pytest.raises(fit.UncountedModel, match=re.escape(says)):
            fit.arch_of(SimpleNamespace(**config))
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path, c=config: SimpleNamespace(**c))
        cfg = compose_cfg(["sft.cache_dir=/tmp/x", "model=qwen3_4b_instruct", "train.memory_gib=0.001",
                           "model.gradient_checkpointing=true", "model.checkpoint_layers=auto"])
        monkeypatch.setattr(fit, "predicted_run", lambda *a: (fit.model_arch(cfg.model, 1000), None))
        line = fit.launch_check(cfg.train, cfg.model, lambda gib: fit.predicted_run(cfg, None, None, 1, False, gib),
                                torch.device("cpu"))
        assert line.startswith("warning: the memory check cannot count this model: " + says)
        assert cfg.model.checkpoint_layers == "all" and "the run starts" in line


def test_the_weight_push_by_hand():
    """Under rollout workers rank 0 gathers each tensor in fp32, casts it to bf16 and packs it into vLLM's two 32 MiB
    buffers: at Qwen3-4B the largest is the embedding, 151,936 x 2,560 = 388,956,160 parameters, so 6 bytes each =
    2.17 GiB beside the model between steps, under the update's peak. Without workers the trainer pushes nothing."""
    run = dataclasses.replace(Run(), push_bucket_bytes=32 << 20)
    push = phases(QWEN3_4B, run)["weight push"]
    assert push["largest tensor, gathered and cast"] == 6 * 151_936 * 2_560 == 2_333_736_960
    assert push["transfer buffers"] == 64 << 20
    assert peak(QWEN3_4B, run) == peak(QWEN3_4B, Run())  # counted, and not the largest phase
    assert "weight push" not in phases(QWEN3_4B, Run())
    cfg = compose_cfg(["experiment=paper_qwen3_4b", "rollout.async_steps=1"])
    assert run_of(cfg, 2, True, 80.0, 300).push_bucket_bytes == 32 << 20
