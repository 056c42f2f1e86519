"""``bench.update_vs_bare`` end to end on CPU at a tiny shape: ours wrapped as ``train.py`` wraps it under torchrun
(FSDP2 over a one-rank process group), its RESULT lines, the profiled update's op table and an op's call sites."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.launch
def test_the_bench_runs_ours_under_fsdp2_and_prints_its_results_and_top_ops(tmp_path):
    tmp = tmp_path / "tmp"  # the process's temp dir: the one-rank process group's store leaves nothing in it
    tmp.mkdir()
    cmd = [sys.executable, "-m", "bench.update_vs_bare", "--fsdp", "--top", "3", "--layers", "1", "--prompts", "1",
           "--group", "2", "--prompt-tokens", "8", "--output-tokens", "16", "--iters", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp.iterdir()) == []
    out = proc.stdout
    assert "cpu, 1 layers x 256" in out and "ours: sharded by FSDP2 over a one-rank process group" in out
    ratio = float(re.search(r"^RESULT update_vs_bare=([0-9.]+)", out, re.M).group(1))
    per_1k = float(re.search(r"^RESULT update_ops_per_token=([0-9.]+)", out, re.M).group(1))
    total = int(re.search(r"ours launches (\d+) aten ops", out).group(1))
    header = re.search(r"(\d+) tokens \(ours computes (\d+)\); checkpointing True \(ours: full, layers all\)", out)
    tokens, computed = map(int, header.groups())
    assert computed == tokens - 8  # its one prompt of 8 tokens once for its 2 outputs (train.share_prompts)
    assert ratio > 0 and per_1k == round(1000 * total / tokens, 1)
    flops, per_token = map(float, re.search(r"one update of ours runs (\S+) FLOPs \(torch.utils.flop_counter\), (\S+) a "
                                            r"token it computes", out).groups())
    assert flops > 0 and abs(per_token - flops / computed) <= 1e-3 * per_token
    # each timing round as it ends (a run cut short says how far it got); the result is each loop's best round
    rounds = re.findall(r"^\[update_vs_bare\] round (\d), (ours|bare): ([0-9.]+) s per update, its warm-up call", out, re.M)
    assert [r[:2] for r in rounds] == [("1", "ours"), ("1", "bare"), ("2", "ours"), ("2", "bare")]
    best = re.search(r"\] ours ([0-9.]+) s \(\d+ tokens/s\), bare ([0-9.]+) s", out)
    fastest = [min(float(r[2]) for r in rounds if r[1] == name) for name in ("ours", "bare")]
    assert [float(best.group(1)), float(best.group(2))] == fastest
    # what the rounds give comes before the profiles, which a time limit may cut short
    assert out.index("RESULT update_vs_bare=") < out.index("profiling one update") < out.index("RESULT update_ops_per_token=")
    # the three most frequent ops, most frequent first, each counted within the update's total
    table = out.split("most frequent of", 1)[1].splitlines()[1:4]
    counts = [int(line.split()[0]) for line in table]
    assert all(line.split()[1].startswith("aten::") for line in table)
    assert counts == sorted(counts, reverse=True) and sum(counts) <= total
    assert counts[0] >= 100  # the most frequent (views, copies) run per layer, per micro-batch, per recompute
    assert "update_gpu_busy_share" not in out and "update_mfu" not in out and "update_hfu" not in out  # CUDA only


def test_mfu_counts_the_tokens_ours_computes_each_shared_prompt_once():
    """The PaLM count, worked: 1 layer of hidden 2, 1 head of dim 2 (1 KV head), MLP 3, vocab 5: N = 2*2 + 2*2*2 +
    2*2 + 3*2*3 + 2*5 = 44, so 6 N = 264; rows of 2 + 3 and 2 + 1 tokens, T = 4: 12 * 1 * 2 * 4 = 96; 360 FLOPs a
    token. Shared, the prompt counts once: 4 + 2 = 6 tokens, else 8; in 2 s at a peak of 1,000 FLOP/s."""
    from bench.update_vs_bare import computed_tokens, update_mfu

    arch = dict(hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                intermediate_size=3, vocab_size=5)
    rows = ([[1, 2], [1, 2]], [[3, 4, 5], [6]])
    assert computed_tokens(*rows, share=True) == 6 and computed_tokens(*rows, share=False) == 8
    assert abs(update_mfu(arch, rows, True, 2.0, 1e-9) - 6 / 2 * 360 / 1000) < 1e-12
    assert abs(update_mfu(arch, rows, False, 2.0, 1e-9) - 8 / 2 * 360 / 1000) < 1e-12
    # two prompts of equal length but different tokens are two prompts
    assert computed_tokens([[1, 2], [2, 1]], [[3], [4]], share=True) == 6


def test_the_gpu_busy_time_counts_overlapping_kernels_once():
    """Kernels (start, end): (0, 2) and (1, 3) overlap on [1, 2], (5, 6) stands alone, (5.5, 5.75) lies inside it:
    busy = 3 + 1 = 4, where their durations sum to 2 + 2 + 1 + 0.25 = 5.25."""
    from bench.update_vs_bare import busy_seconds

    assert busy_seconds([(5.5, 5.75), (1, 3), (5, 6), (0, 2)]) == 4
    assert busy_seconds([(0, 1), (1, 2)]) == 2 and busy_seconds([]) == 0


def test_the_idle_stretches_lie_between_kernels_longest_first_with_the_kernels_around_them():
    """Kernels a [0, 10), b [5, 25) (overlapping a), c [30, 31), d [31.5, 40), e [32, 33) (inside d), f [47, 50): the
    GPU idles 5 after b (at +25), 0.5 after c (at +31) and 7 after d (at +40); nothing before a or after f counts."""
    from bench.update_vs_bare import idle_gaps

    spans = [(47, 50, "f"), (0, 10, "a"), (32, 33, "e"), (5, 25, "b"), (31.5, 40, "d"), (30, 31, "c")]
    assert idle_gaps(spans, 5) == [(7, 40, "d", "f"), (5, 25, "b", "c"), (0.5, 31, "c", "d")]
    assert idle_gaps(spans, 1) == [(7, 40, "d", "f")]
    assert idle_gaps([(0, 1, "a"), (1, 2, "b")], 3) == [] and idle_gaps([], 3) == []


def test_the_idle_report_gives_the_kernels_span_and_its_longest_gaps(capsys):
    """Kernels over [1.000, 1.010) and [1.015, 1.040) s of a 50 ms call: they span 40 ms, 35 ms busy, one 5 ms gap
    10 ms after the first kernel began."""
    from bench.update_vs_bare import print_gaps

    print_gaps([(1.015, 1.040, "gemm"), (1.000, 1.010, "flash_fwd")], 0.050, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("its kernels span 40 ms of the 50; the 2 longest stretches in that span without a kernel "
                           "(35 ms busy):")
    assert out[1:] == ["        5.0 ms at +10 ms, after flash_fwd, before gemm"]
    print_gaps([], 0.050, 2)
    assert capsys.readouterr().out == ""


def test_the_profiled_wall_leaves_out_the_profiler_s_own_start_and_stop(monkeypatch):
    """A profiler that takes 0.3 s to start and to stop, around a call of about 0.05 s whose GPU ran kernels over
    [0, 10) and [5, 25) ms: the wall is the call's, the busy time 25 ms, the kernels' sum 30 ms; ``ops=False``
    records the GPU's activity only."""
    import time
    from types import SimpleNamespace

    import torch.profiler

    from bench import update_vs_bare

    seen = []

    class SlowProfiler:
        def __init__(self, activities):
            seen.append(activities)

        def __enter__(self):
            time.sleep(0.3)
            return self

        def __exit__(self, *exc):
            time.sleep(0.3)

        def events(self):
            cuda = SimpleNamespace(name="CUDA")

            def kernel(start, end):  # ms, as the profiler's microseconds
                return SimpleNamespace(name="gemm", device_type=cuda, device_time=(end - start) * 1e3,
                                       time_range=SimpleNamespace(start=start * 1e3, end=end * 1e3))

            cpu = SimpleNamespace(name="CPU")
            return [SimpleNamespace(name="aten::mm", device_type=cpu), SimpleNamespace(name="Torch-Compiled Region: 0/0",
                    device_type=cpu), kernel(0, 10), kernel(5, 25)]

    monkeypatch.setattr(torch.profiler, "profile", SlowProfiler)
    monkeypatch.setattr(update_vs_bare, "synchronize", lambda device: None)
    ops, compiled, kernels, busy, wall, spans = update_vs_bare.profiled(lambda: time.sleep(0.05), torch.device("cuda"))
    assert ops == 1 and compiled == 1 and abs(kernels - 0.030) < 1e-9 and abs(busy - 0.025) < 1e-9
    assert 0.05 <= wall < 0.25 and [name for *_, name in spans] == ["gemm", "gemm"]
    update_vs_bare.profiled(lambda: None, torch.device("cuda"), ops=False)
    P = torch.profiler.ProfilerActivity
    assert seen == [[P.CPU, P.CUDA], [P.CUDA]]


def test_host_syncs_counts_each_wait_by_its_line_and_restores_the_debug_mode(monkeypatch, capsys):
    """A call that warns as CUDA's sync debug mode does, twice from one line and once from another, with an
    unrelated warning between: 3 waits, the line of two first; the mode is on during the call only, and off again
    after a call that raises. (No GPU here: the mode and the synchronisation are recorded, not run.)"""
    import warnings

    import torch

    from bench.update_vs_bare import host_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def update():
        assert modes == ["warn"]
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # line A
        warnings.warn("an unrelated warning")
        warnings.warn("called a synchronizing CUDA operation")  # line B

    assert host_syncs(update, top=5) == 3
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("where one update waits for the GPU (3 times):")
    assert [line.split()[0] for line in out[1:]] == ["2", "1"]
    assert out[1].split()[1].endswith(f"test_update_vs_bare.py:{update.__code__.co_firstlineno + 3}")
    assert modes == ["warn", "default"]

    def failing():
        raise RuntimeError("out of memory")

    try:
        host_syncs(failing)
    except RuntimeError:
        pass
    assert modes[-1] == "default"


def bench_run(shape: str, prompts: int, group: int, prompt_tokens: int, output_tokens: int, sharded: bool, device: str,
              overrides=(), compiled: bool = False):
    """The shape and ``bicc.machine.memory`` run that ``bench.update_vs_bare`` sizes ours with, for these arguments."""
    import torch

    from bench.update_vs_bare import SHAPES, make_rows, memory_run, update_cfg

    arch = dict(SHAPES[shape])
    rows = make_rows(prompts, group, prompt_tokens, output_tokens, arch["vocab_size"])
    cfg = update_cfg(prompt_tokens, output_tokens, 8, True, list(overrides))
    return arch, memory_run(cfg, rows, prompt_tokens, sharded, compiled, torch.device(device))


def test_ours_memory_here_is_weights_moments_and_gradients_with_no_sampler_or_reference():
    """Qwen3-4B's width at 2 layers: a layer 2560 x 4096 (q) + 2 x 2560 x 1024 (k, v) + 4096 x 2560 (o) + 3 x 2560 x
    9728 (MLP) + 2 x 2560 + 2 x 128 (norms) = 100,930,816 parameters, the tied root 151,936 x 2560 + 2560 =
    388,958,720: N = 590,820,352. The optimizer step holds fp32 master weights, AdamW's two moments and fp32
    gradients, 16 N bytes; between updates (no rollout, no evaluation here) 12 N; FSDP2 gathers the root in bf16 on
    CUDA (2 bytes a parameter), in fp32 on CPU."""
    from bench.update_vs_bare import memory_arch
    from bicc.machine.memory import allocated, phases

    arch, run = bench_run("qwen3_4b_width", 2, 2, 8, 32, True, "cuda")
    shape = memory_arch(arch, 2)
    assert shape.params() == 590_820_352 and memory_arch(arch).layers == 36
    table = allocated(shape, run)
    assert table["optimizer step"] == 16 * 590_820_352
    assert table["rollout"] == table["evaluation"] == 12 * 590_820_352  # no sampler copy, no reference, no vLLM
    root = "FSDP2 gathered root (embeddings, head)"
    assert phases(shape, run)["update: layers backward"][root] == 2 * 388_958_720
    _, cpu = bench_run("qwen3_4b_width", 2, 2, 8, 32, True, "cpu")
    assert phases(shape, cpu)["update: layers backward"][root] == 4 * 388_958_720
    assert run.rows == 4 and run.micro_batch == 8 and run.output_tokens == 32 and run.checkpoint_layers is None


def test_fit_takes_the_most_layers_whose_predicted_peak_fits_and_says_when_none_does():
    """With ``AUTO_SHARE`` (0.9) of the budget just above the predicted peak at 5 layers: 5; just below it: 4;
    a budget for any depth: the shape's 36; one below a single layer's peak: an error naming the flag."""
    from bench.update_vs_bare import fit_layers, memory_arch
    from bicc.machine.memory import GIB, peak
    from bicc.trainer.fit import AUTO_SHARE

    arch, run = bench_run("qwen3_4b_width", 8, 8, 64, 2048, True, "cuda")
    at5 = peak(memory_arch(arch, 5), run)[1] / AUTO_SHARE / GIB
    assert fit_layers(arch, run, at5 * 1.000001) == 5 and fit_layers(arch, run, at5 * 0.999999) == 4
    assert fit_layers(arch, run, 10_000.0) == 36
    at1 = peak(memory_arch(arch, 1), run)[1] / AUTO_SHARE / GIB
    with pytest.raises(ValueError, match="--layers fit: one layer's predicted peak"):
        fit_layers(arch, run, at1 * 0.99)


@pytest.mark.slow
def test_layers_fit_runs_ours_alone_at_the_depth_and_checkpointing_the_memory_model_chose(tmp_path):
    """End to end on CPU in the depth row's form (ours under FSDP2 and compiled, log-prob chunks below a
    micro-batch's outputs): a budget between the predicted peaks at 2 and 3 layers of the small shape gives 2
    layers, ``model.checkpoint_layers=auto`` the count ``train.py`` would choose there; no bare loop, one round of
    ours, then its counted FLOPs; the update profiled after the count still runs compiled. Slow (minutes of
    compilation on a slow CPU): its parts run in ``make test`` (``fit_layers`` above, the FLOP count inside compiled
    layers below, the bench under FSDP2 eagerly)."""
    import dataclasses

    from bench.update_vs_bare import memory_arch
    from bicc.machine.memory import GIB, peak
    from bicc.trainer.fit import AUTO_SHARE, resolve_checkpoint_layers

    overrides = ["model.checkpoint_layers=auto", "train.logprob_chunk_tokens=8"]
    arch, run = bench_run("cpu_small", 1, 2, 8, 16, True, "cpu", overrides, compiled=True)
    two, three = (peak(memory_arch(arch, n), run)[1] for n in (2, 3))
    budget = (two + three) / 2 / AUTO_SHARE / GIB
    chosen = resolve_checkpoint_layers(memory_arch(arch, 2), run, budget)
    cmd = [sys.executable, "-m", "bench.update_vs_bare", "--fsdp", "--compile", "--layers", "fit", "--prompts", "1",
           "--group", "2", "--prompt-tokens", "8", "--output-tokens", "16", "--iters", "1",
           f"train.memory_gib={budget!r}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "--layers fit: 2 layers fit ours" in out and "cpu, 2 layers x 256" in out
    assert f"model.checkpoint_layers=auto: {chosen} of 2 layers checkpointed" in out
    assert f"checkpointing True (ours: full, layers {chosen})" in out
    at_chosen = peak(memory_arch(arch, 2), dataclasses.replace(run, checkpoint_layers=chosen))[1] / GIB
    assert f"bicc.machine.memory: ours' peak {at_chosen:.2f} GiB" in out and at_chosen <= AUTO_SHARE * budget
    assert re.findall(r"round (\d), (ours|bare):", out) == [("1", "ours")]
    assert "RESULT update_vs_bare" not in out and "no bare loop" in out and "decoder layers compiled" in out
    assert re.search(r"one update of ours runs \S+ FLOPs", out)
    assert re.search(r"^RESULT update_ops_per_token=[0-9.]+", out, re.M)
    assert int(re.search(r"aten ops in one update, (\d+) calls into compiled graphs", out).group(1)) > 0
    assert "FLOPs not counted" not in out and "did not compile" not in proc.stderr
    assert "update_allocated_vs_model" not in out  # CUDA only


def test_layers_takes_a_positive_count_or_fit():
    import argparse

    from bench.update_vs_bare import layer_count

    assert layer_count("12") == 12 and layer_count("fit") == "fit"
    for bad in ("0", "-3", "all", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="neither a positive number of layers nor fit"):
            layer_count(bad)


def test_timed_resets_the_cuda_peak_after_the_warm_up_call_only(monkeypatch):
    """On CUDA the allocator's peak is reset once, between the warm-up call and the first timed one, so that
    ``max_memory_allocated`` afterwards reads the timed calls' (compilation and lazily made state left out); on CPU
    never. (No GPU here: the reset is recorded, not run.)"""
    import torch

    from bench import update_vs_bare

    events = []
    monkeypatch.setattr(update_vs_bare, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: events.append("reset"))
    update_vs_bare.timed(lambda: events.append("call"), torch.device("cuda"), 3)
    assert events == ["call", "reset", "call", "call", "call"]
    events.clear()
    update_vs_bare.timed(lambda: events.append("call"), torch.device("cpu"), 2)
    assert events == ["call"] * 3


TINY = dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
            intermediate_size=8, vocab_size=16, tie_word_embeddings=True, max_position_embeddings=64)
ONE_PROMPT_TWO_OUTPUTS = ([[5, 6, 7]] * 2, [[8, 9, 10, 11], [12, 13, 14, 15]])


def tiny_update(checkpointing: bool, overrides=(), compiled: bool = False):
    import torch

    from bench.update_vs_bare import build, our_update, update_cfg
    from bicc.model.logprobs import install_logprob_head

    cfg = update_cfg(3, 4, 2, checkpointing, list(overrides))
    model = build(TINY, torch.device("cpu"), checkpointing)
    if compiled:
        from bicc.kernels.compile import compile_layers

        compile_layers(model, checkpoint_in_graph=cfg.model.checkpoint_in_graph)
    install_logprob_head(model, cfg.train.logprob_chunk_tokens)
    return our_update(model, ONE_PROMPT_TWO_OUTPUTS, cfg, torch.device("cpu"))


def test_the_counted_flops_are_a_whole_update_with_its_recompute():
    """The HFU's numerator, worked: 1 layer of hidden 4, 1 head of 4 (1 KV head), MLP 8, vocab 16, so a layer's
    matmul weights are 4*4 + 2*4*4 + 4*4 + 3*4*8 = 160 and the head's 4*16 = 64. One prompt of 3 tokens, 2 outputs of
    4, under KV reuse: the prompt once (3 tokens) and each output's first 3 (its last is a target only) make 9
    tokens through the layer; the head reads the prompt's last position and those 6: 7. Each matmul weight costs 6
    FLOPs a token (forward, input and weight gradients): 6*160*9 + 6*64*7 = 8,640 + 2,688 = 11,328. Attention's
    forward is two products of 2 FLOPs a multiply-add: the prompt's 3 queries over its 3 keys, 2*(2*3*4*3) = 144;
    each output's 3 queries over the prompt's 3 keys and its own 3, 2*(2*3*4*6) = 288, twice; 720 in all, and its
    backward 5 such products, 2.5 x 720 = 1,800. Checkpointed, the backward runs the layer's forward again up to its
    last saved input, all but the MLP's down projection (4*8): + 2*128*9 = 2,304, and attention's forward, + 720.
    With log-prob chunks of 2, the micro-batch's 6 head positions recompute their logits: + 2*64*6 = 768."""
    from bench.update_vs_bare import counted_flops

    plain = 11_328 + 720 + 1_800
    assert counted_flops(tiny_update(False)) == plain
    assert counted_flops(tiny_update(True)) == plain + 2_304 + 720
    assert counted_flops(tiny_update(True, ["train.logprob_chunk_tokens=2"])) == plain + 2_304 + 720 + 768


def test_attention_counts_grouped_key_value_heads_as_the_query_heads():
    """2 query heads over 1 K/V head, 3 queries over 5 keys of dimension 4, batch 1: each product is 2 * (2 heads *
    3 * 4 * 5) = 240 FLOPs, 2 in the forward (480), 5 in the backward (1,200): what the same attention with its K/V
    head repeated counts. (torch before 2.12 rejects the grouped shapes.)"""
    import torch

    from bench.update_vs_bare import attention_formulas, query_heads

    formulas = attention_formulas()
    aten = torch.ops.aten
    q, kv, repeated = (1, 2, 3, 4), (1, 1, 5, 4), (1, 2, 5, 4)
    assert query_heads(q, kv, kv) == (q, repeated, repeated)  # what torch's formulas are handed
    for name in ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu"):
        forward = formulas[getattr(aten, f"_scaled_dot_product_{name}")]
        backward = formulas[getattr(aten, f"_scaled_dot_product_{name}_backward")]
        assert forward(q, kv, kv) == forward(q, repeated, repeated) == 480
        assert backward(q, q, kv, kv) == backward(q, q, repeated, repeated) == 1_200


@pytest.mark.launch
def test_the_flops_are_counted_inside_compiled_layers_without_a_recompile():
    """The HFU at depth runs compiled: the counted update runs its compiled graphs (as many calls into them as an
    update outside the counter), the counter sees their matmuls, its mode costs no graph of its own, and the updates
    after it still run compiled (under torch's own ``FlopCounterMode`` Dynamo runs them eagerly, then and from then
    on). The count is the eager one above but for the prompt's pass: its recording cache keeps it out of the
    recompute in the graph, and the eager checkpoint around its compiled forward reruns all of that forward, the MLP's
    down projection (4 x 8) included: + 2*4*8*3 = 192."""
    import torch

    from bench.update_vs_bare import counted_flops, profiled
    from bicc.trainer.step import compiled_graphs

    update = tiny_update(True, compiled=True)
    update()  # compiles
    graphs, calls = compiled_graphs(), profiled(update, torch.device("cpu")).compiled
    assert graphs > 0 and calls > 0
    flops = []
    assert profiled(lambda: flops.append(counted_flops(update)), torch.device("cpu")).compiled == calls
    assert flops == [11_328 + 720 + 1_800 + 2_304 + 720 + 192]
    assert compiled_graphs() == graphs
    assert profiled(update, torch.device("cpu")).compiled == calls


def test_the_flops_of_an_op_in_each_rng_wrapper_are_counted():
    """A compiled checkpoint's recompute wraps attention (an op that may draw random numbers) in an RNG higher-order
    op: on CPU ``run_with_rng_state``, on CUDA ``graphsafe_run_with_rng_state``, which an H200's count at Qwen3-4B's
    depth named uncounted. A [3, 4] x [4, 5] matmul wrapped in either counts 2*3*4*5 = 120 FLOPs, as it does bare.
    Run on fake tensors: the graph-safe wrapper runs on no CPU."""
    import torch
    from torch._prims.rng_prims import graphsafe_run_with_rng_state, run_with_rng_state
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.update_vs_bare import FlopCount

    mm = torch.ops.aten.mm.default
    with FakeTensorMode():
        a, b = torch.empty(3, 4), torch.empty(4, 5)
        state = torch.empty(16, dtype=torch.uint8)
        calls = {"bare": lambda: mm(a, b), "run_with_rng_state": lambda: run_with_rng_state(state, mm, a, b),
                 "graphsafe_run_with_rng_state": lambda: graphsafe_run_with_rng_state(mm, a, b, rng_state=None)}
        for name, call in calls.items():
            with FlopCount({}) as counter:
                assert call().shape == (3, 5)
            assert (name, counter.total, counter.uncounted) == (name, 120, set())
