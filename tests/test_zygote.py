"""The tests' run server (tests/zygote.py, tests.helpers.run_script): a run forked from it is the run a process of
its own is, in what a test reads of it (exit code, output, argv, working dir, environment, import path, process
group), forked ranks are torchrun's, and one the server cannot stand for is started as a process."""

import os
import subprocess

import pytest

from tests.helpers import ROOT, Zygote, run_script, start_script

pytestmark = pytest.mark.launch

PROBE = ROOT / "tests" / "zygote_probe.py"


@pytest.fixture
def probe_env(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "probe_extra.py").write_text("WHERE = 'extra'\n")
    return {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path / "extra")}


def report(proc) -> dict:
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


@pytest.mark.parametrize("code", ["0", "3", "raise"])
def test_a_forked_run_reads_as_its_own_process(tmp_path, probe_env, monkeypatch, code):
    forked = run_script("tests/zygote_probe.py", [code, "two words"], tmp_path, probe_env, timeout=60)
    monkeypatch.setenv("BICC_TEST_FORK", "0")
    started = run_script("tests/zygote_probe.py", [code, "two words"], tmp_path, probe_env, timeout=60)
    assert forked.returncode == started.returncode == {"0": 0, "3": 3, "raise": 1}[code]
    a, b = report(forked), report(started)
    assert a.pop("parent") == str(Zygote.get().server.pid) and b.pop("parent") == str(os.getpid())
    assert a.pop("pid") == a.pop("group") and b.pop("pid") == b.pop("group")  # a process group of its own
    assert a == b and a["argv"] == repr([str(PROBE), code, "two words"]) and a["cwd"] == str(tmp_path)
    assert a["cache"] == str(tmp_path / "cache") and a["extra"] == "extra" and a["main"] == "True"
    assert forked.stderr.splitlines()[0] == started.stderr.splitlines()[0] == "to stderr"
    assert ("ValueError: planted" in forked.stderr) == ("ValueError: planted" in started.stderr) == (code == "raise")
    assert "exit handler ran" in forked.stdout and "exit handler ran" in started.stdout


def test_a_variable_the_server_did_not_start_under_gets_a_process(tmp_path, probe_env):
    proc = run_script("tests/zygote_probe.py", ["0"], tmp_path, {**probe_env, "PYTHONHASHSEED": "3"}, timeout=60)
    assert report(proc)["parent"] == str(os.getpid())


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_forked_run_has_the_torch_threads_its_omp_num_threads_gives_a_started_one(tmp_path, probe_env, monkeypatch,
                                                                                    threads):
    env = {**probe_env, "OMP_NUM_THREADS": threads}
    forked = report(run_script("tests/zygote_probe.py", ["0", "threads"], tmp_path, env, timeout=60))
    monkeypatch.setenv("BICC_TEST_FORK", "0")
    started = report(run_script("tests/zygote_probe.py", ["0", "threads"], tmp_path, env, timeout=60))
    assert forked["parent"] == str(Zygote.get().server.pid) and started["parent"] == str(os.getpid())
    assert forked["threads"] == started["threads"] == threads


def test_a_run_past_its_timeout_is_killed_and_a_started_one_can_be(tmp_path, probe_env):
    with pytest.raises(subprocess.TimeoutExpired):
        run_script("tests/zygote_probe.py", ["sleep"], tmp_path, probe_env, timeout=2)
    run = start_script("tests/zygote_probe.py", ["sleep"], tmp_path, probe_env)
    assert run.poll() is None
    os.kill(run.pid, 9)
    assert run.wait(30) == -9
    after = run_script("tests/zygote_probe.py", ["0"], tmp_path, probe_env, timeout=60)  # the server serves on
    assert after.returncode == 0 and report(after)["parent"] == str(Zygote.get().server.pid)


def rank_lines(proc) -> list[str]:
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))


def test_forked_ranks_see_what_torchruns_ranks_see(tmp_path, probe_env, monkeypatch):
    """The variables torchrun gives each rank, a gloo group over them, torch's threads: as under torchrun itself."""
    env = {k: v for k, v in probe_env.items() if k != "OMP_NUM_THREADS"}
    forked = run_script("tests/zygote_rank_probe.py", ["ok"], tmp_path, env, timeout=120, ranks=2)
    monkeypatch.setenv("BICC_TEST_FORK", "0")
    started = run_script("tests/zygote_rank_probe.py", ["ok"], tmp_path, env, timeout=120, ranks=2)
    assert forked.returncode == started.returncode == 0, forked.stderr[-2000:] + started.stderr[-2000:]
    assert rank_lines(forked) == rank_lines(started)
    assert [line.split()[0] for line in rank_lines(forked)] == ["rank0", "rank1"]
    assert all("sum=3.0" in line and "WORLD_SIZE=2" in line and "threads=1" in line for line in rank_lines(forked))


def test_a_failing_forked_rank_stops_the_others(tmp_path, probe_env):
    """Rank 1 exits 3; rank 0, asleep, gets SIGTERM: the run ends at once, with torchrun's code 1."""
    import time

    start = time.monotonic()
    proc = run_script("tests/zygote_rank_probe.py", ["fail"], tmp_path, probe_env, timeout=120, ranks=2)
    assert proc.returncode == 1 and time.monotonic() - start < 60
    assert "rank 1 exited with code 3" in proc.stderr and len(rank_lines(proc)) == 2


def test_the_librarys_process_a_forked_run_starts_is_forked_and_is_its_child(probe_env, monkeypatch):
    """``python -m tests.<module>`` (as the trainer starts ``bicc.rollout.worker``) from a forked run: forked from a
    clean copy of the run, yet the run's child, with the argv, environment, import path and exit code a started one
    has."""
    forked = report(run_script("tests/zygote_probe.py", ["0", "child"], ROOT, probe_env, timeout=60))
    monkeypatch.setenv("BICC_TEST_FORK", "0")
    started = report(run_script("tests/zygote_probe.py", ["0", "child"], ROOT, probe_env, timeout=60))
    for probe in (forked, started):
        assert probe["child_code"] == "5" and probe.pop("child_pid") == probe.pop("started_pid")
        assert probe.pop("child_parent") == probe["pid"]  # the run's child, which it waited for
    children = [{k: v for k, v in probe.items() if k.startswith("child_")} for probe in (forked, started)]
    assert children[0].pop("child_preloaded") == "True" and children[1].pop("child_preloaded") == "False"
    assert children[0] == children[1]
    assert children[0]["child_argv"] == repr(["two words"]) and children[0]["child_var"] == "set"
    assert children[0]["child_path0"] == str(ROOT) and children[0]["child_main"] == "True"
