import functools
import multiprocessing.process
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bicc.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_DATA = Path(os.environ.get("BICC_DATA_DIR", ROOT.parent / "shared" / "data"))

register_configs()


def compose_cfg(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


@functools.cache
def algo_preset(name: str) -> dict:
    """conf/algo/<name>.yaml as a run composes it (resolved; a fresh copy to each caller's use)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_cfg([f"algo={name}", "sft.cache_dir=/tmp/x"]).algo, resolve=True)


def run_of(cfg, *args, **kwargs):
    """``bicc.trainer.fit.run_of`` of a composed run config: its step groups, model, evaluation and distribution."""
    from bicc.config import StepConfig
    from bicc.trainer.fit import run_of as of_groups

    return of_groups(StepConfig.of(cfg), cfg.model, cfg.eval, cfg.dist, *args, **kwargs)


@pytest.fixture
def cfg():
    return compose_cfg(["sft.cache_dir=/tmp/unused"])


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data dir {SHARED_DATA} is absent (set BICC_DATA_DIR)")
    return SHARED_DATA


# What a test run may leave in the checkout: interpreter and pytest caches. Anything else a test writes belongs
# under its tmp_path.
CACHES = {".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}


def repo_files() -> dict[str, int]:
    """Every file and dir of the checkout (caches aside), with its modification time."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in CACHES]
        for name in filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, ROOT)] = os.stat(path).st_mtime_ns
        found.update((os.path.relpath(os.path.join(dirpath, name), ROOT), 0) for name in dirnames)
    return found


@pytest.fixture(scope="session", autouse=True)
def tests_write_only_under_tmp():
    before = repo_files()
    yield
    after = repo_files()
    written = sorted(path for path, mtime in after.items() if before.get(path) != mtime)
    assert not written, f"tests wrote into the checkout (use tmp_path): {written[:10]}"


# What libraries set of themselves, for the whole process, and may change with their versions: pytest (the test
# running), Inductor (its first C++ module, the cache dir it settles on), Triton, and vLLM at import and at each
# engine's start (bicc's engine sets its in-process switch too). A file run alone meets them inside a test, where
# `make test` imports vLLM at collection. A VLLM_ variable bicc itself sets for another engine is still checked.
LIBRARY_PREFIXES = ("VLLM_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "TILELANG_", "AITER_")
LIBRARY_NAMES = {"PYTEST_CURRENT_TEST", "LD_LIBRARY_PATH", "LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS",
                 "PYTORCH_NVML_BASED_CUDA_CHECK"}
BICC_SETS = {"VLLM_CPU_KVCACHE_SPACE"}  # bench.peer_trl, for TRL's engine


def set_by_a_library(name: str) -> bool:
    return name not in BICC_SETS and (name in LIBRARY_NAMES or name.startswith(LIBRARY_PREFIXES))


@pytest.fixture(autouse=True)
def tests_leave_the_environment_as_they_found_it():
    """A variable a test sets stays set for every later test of its worker, which then depend on the order the
    files ran in (``monkeypatch.setenv`` restores what it set)."""
    before = dict(os.environ)
    yield
    changed = sorted(k for k in before.keys() | os.environ.keys()
                     if before.get(k) != os.environ.get(k) and not set_by_a_library(k))
    assert not changed, f"the test left these environment variables changed: {changed}"


def pytest_configure(config):
    """Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``) each worker runs on its own share of the cores,
    and so does every process its tests start: two workers' threads spinning on the same cores ran the suite slower
    than one worker did.

    The tests' own process runs torch on one thread, whatever the cores: with two intra-op threads, an fp64 update
    under KV reuse came out different in about one process in eight (the loss of a one-pass update -5.4e-7 instead of
    0, 4e-6 of the update's size; one of two fixed values, decided per model instance, never by a rerun in the same
    process; 0 in 30 processes on one thread), and the tests that hold two such models to 1e-12 failed. Which kernel's
    threaded path does it is not found; ``make test`` on two cores ran one thread per worker anyway."""
    import torch

    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers and hasattr(os, "sched_setaffinity"):
        from tests.helpers import worker_cores  # helpers imports this module

        os.sched_setaffinity(0, worker_cores(sorted(os.sched_getaffinity(0)), worker, int(workers)))
    torch.set_num_threads(1)


# The longest test files, longest first: a file runs whole on one worker, so one of these left to the end kept a
# worker busy for minutes after the other had finished. Their seconds on a 2-core AMD EPYC, make test's then make
# test-heavy's: test_paper_rehearsal.py 0 and 190, then 96/82, 83/34, 30/87, 7/83, 64/55, 60/0, 50/33, 9/41, 17/37,
# 8/32, then 32 to 10 in make test. `make test` passes `--no-loadscope-reorder`, without which pytest-xdist queues the
# files with the most tests first instead.
LONGEST_FIRST = ("test_paper_rehearsal.py", "test_distributed.py", "test_async.py", "test_compile.py",
                 "test_preemption.py", "test_rollout_vllm.py", "test_reference.py", "test_resume.py",
                 "test_memory_tracker.py", "test_recompute_in_graph.py", "test_compile_graphs.py", "test_experiments.py",
                 "test_doc_commands.py", "test_split_invariance.py", "test_config.py", "test_host.py",
                 "test_checking.py", "test_update.py", "test_gpu_check.py", "test_train_smoke.py",
                 "test_readme_commands.py", "test_checkpoint_layers.py", "test_update_vs_bare.py", "test_sampler_gate.py")


# ---- make test-heavy: the long variants of paths make test already runs ---------------------------------------
# Each of these is a second form of something a shorter test in `make test` runs end to end (another kill point,
# fault, staleness or epoch boundary, the paper presets' rehearsals with a vLLM engine per process, the compiled form
# of an eager check, a bench's measurement, the paper width of a traced run, another FSDP2 split), at 2-130 s apiece
# (docs/results.md has the suites' last timings).
# `make test` leaves them out; `make test-heavy` runs them and CI runs it after `make test` (.ci/run). A test
# file's name, '::', the test's name and, for one case of a parametrised test, its id in brackets.
HEAVY = (
    "test_paper_rehearsal.py::test_headline_command_phi4_mini_shape_with_a_bpe_tokenizer",
    "test_paper_rehearsal.py::test_two_training_ranks_and_two_vllm_workers",
    "test_bench_entry.py::test_the_push_bench_measures_both_hand_offs",
    "test_async.py::test_no_process_of_the_run_outlives_its_killed_trainer[kill-start-sample:0:hang]",
    "test_async.py::test_no_process_of_the_run_outlives_its_killed_trainer[kill-push-]",
    "test_async.py::test_a_failing_worker_stops_the_run_with_its_name[load:1:hang-(loaded weight version 0 of 1)]",
    "test_async.py::test_async_run_is_the_reference_stale_loop[2]",
    "test_checkpoint_layers.py::test_compiled_only_the_checkpointed_layers_take_the_recompute_form",
    "test_gpu_check.py::test_the_rehearsal_runs_on_cpu_at_a_small_shape",
    "test_recompute_in_graph.py::test_the_recompute_in_the_graph_gives_the_eager_update_with_fewer_matmuls",
    "test_update_vs_bare.py::test_the_flops_are_counted_inside_compiled_layers_without_a_recompile",
    "test_compile.py::test_the_headline_form_trains_compiled_under_torchrun_and_fsdp2",
    "test_compile.py::test_every_layer_runs_the_same_graphs_under_kv_reuse",
    "test_compile.py::test_the_prefix_pass_runs_compiled_and_the_floats_are_constants",
    "test_compile.py::test_adapted_layers_compile_to_the_eager_update_and_pi_ref_runs_them_off",
    "test_compile_graphs.py::test_an_update_under_fsdp2_compiles_a_graph_per_kind_of_pass",
    "test_checkpoint_policy.py::test_keeping_attention_works_through_compiled_layers",
    "test_head_memory.py::test_one_head_chunk_holds_what_the_memory_model_counts[compiled]",
    "test_memory_tracker.py::test_four_layers_of_the_paper_width_trace_every_phase_and_their_weights_are_the_models",
    "test_resume.py::test_async_sigkill_then_resume_is_bit_identical[6]",
    "test_resume.py::test_a_dead_worker_stops_the_run_and_its_checkpoint_resumes",
    "test_resume.py::test_sigkill_then_resume_is_bit_identical_with_lora_adapters",
    "test_resume.py::test_a_resume_about_the_epochs_wrap_reads_the_rows_of_the_uninterrupted_run[a-step-before-sync]",
    "test_resume.py::test_a_resume_about_the_epochs_wrap_reads_the_rows_of_the_uninterrupted_run[a-step-before-async]",
    "test_resume.py::test_a_resume_about_the_epochs_wrap_reads_the_rows_of_the_uninterrupted_run[at-the-wrap-async]",
    "test_rollout_vllm.py::test_a_run_with_vllm_rollouts_resumes_from_its_checkpoint_to_the_uninterrupted_weights",
    "test_rollout_vllm.py::test_an_engine_sized_for_one_row_serves_one_row_of_its_whole_length",
    "test_rollout_vllm.py::test_a_training_run_samples_through_the_adapters_vllm_serves",
    "test_host.py::test_numerics_hold_without_vector_instructions",
    "test_sampler_gate.py::test_a_planted_fault_stops_the_run_naming_the_setting_and_its_causes[WrongDtypePush]",
    "test_sampler_gate.py::test_a_prefix_cache_not_reset_after_a_push_stops_the_run",
    "test_distributed.py::test_fsdp2_at_another_split_matches_one_process",
    "test_distributed.py::test_fsdp2_with_dynamic_sampling_and_uneven_ranks_matches_one_process[once-a-step]",
    "test_distributed.py::test_ddp_checkpoint_resumes_in_two_processes",
    "test_distributed.py::test_lora_adapters_under_ddp_and_fsdp2_match_one_process_and_resume_in_one",
    "test_distributed.py::test_fsdp2_rank_with_one_token_outputs_stays_in_step[padding_free]",
    "test_distributed.py::test_rollout_workers_under_torchrun_match_one_process[reshard_after_forward=false]",
    "test_preemption.py::test_a_preempted_rehearsal_saves_its_last_step_past_torchruns_default_30_s",
    "test_preemption.py::test_a_worker_killed_in_a_push_ends_the_rehearsal_naming_it",
    *(f"test_algorithms.py::test_each_verl_entry_trains_under_bicc_and_rollout_workers[{case}]" for case in (
        "dppo_kl-sequence+normalised", "gpg-token-tis", "dro-icepop+rejection", "rloo-sequence+normalised",
        "opo-icepop+rejection", "grpo_passk-token-tis", "reinforce_plus_plus_baseline-icepop+rejection")),
)


def heavy_entry(item) -> str | None:
    """The HEAVY entry naming ``item`` (the whole test, or this case of it), if any."""
    whole = f"{item.path.name}::{item.originalname}"
    return next((e for e in (f"{item.path.name}::{item.name}", whole) if e in HEAVY), None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    named = set()
    for item in items:
        entry = heavy_entry(item)
        if entry is not None:
            item.add_marker(pytest.mark.heavy)
            named.add(entry)
    # a renamed test or case would otherwise leave the tier without a word: every entry of a collected file names one
    # of its tests, and a case's id one of its cases wherever more than one was collected (not a single node id)
    modules = {item.path.name: item.module for item in items if getattr(item, "module", None) is not None}
    cases = Counter(f"{item.path.name}::{item.originalname}" for item in items)
    stale = []
    for entry in HEAVY:
        test = entry.split("[")[0]
        file, name = test.split("::")
        if file in modules and entry not in named and (not hasattr(modules[file], name) or cases[test] > 1):
            stale.append(entry)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py HEAVY names no collected test: {stale}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# ---- make test-fast: no test there starts a process ------------------------------------------------------------
# A test that starts another Python process (train.py, torchrun, a bench, a checker's pool) is marked `launch`, and
# `make test-fast` leaves it out with the `compile` ones; an unmarked test that starts one fails at that line, so the
# fast loop stays free of launches. (Compilers that Inductor runs are not Python processes and are not counted.)
RUNNING = {"item": None}
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def starts_python(args) -> bool:
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    return bool(argv) and "python" in os.path.basename(argv[0]) and not any("torch._inductor" in a for a in argv)


def refuse_unmarked_launch(what: str) -> None:
    item = RUNNING["item"]
    if item is not None and item.get_closest_marker("launch") is None and item.get_closest_marker("compile") is None:
        raise RuntimeError(f"{item.nodeid} starts {what}: mark it @pytest.mark.launch (make test-fast leaves those out)")


def popen_init(self, args, *rest, **kwargs):
    if starts_python(args):
        refuse_unmarked_launch(f"a process ({' '.join(map(str, args))[:120] if isinstance(args, (list, tuple)) else args})")
    return _popen_init(self, args, *rest, **kwargs)


def process_start(self):
    refuse_unmarked_launch(f"a multiprocessing process ({self.name})")
    return _process_start(self)


subprocess.Popen.__init__ = popen_init
multiprocessing.process.BaseProcess.start = process_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    RUNNING["item"] = item
    yield
    RUNNING["item"] = None
