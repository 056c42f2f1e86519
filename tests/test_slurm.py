"""The Slurm job script of docs/distributed.md (``docs/slurm/train_2x4.sbatch``), which cannot run here: its shell is
valid, its resources agree with its torchrun line, and that line's overrides compose into a valid config."""

import shlex
import shutil
import subprocess

import pytest

from bicc.trainer.validation import validate
from tests.conftest import compose_cfg
from tests.helpers import ROOT

SCRIPT = ROOT / "docs" / "slurm" / "train_2x4.sbatch"


def sbatch_options() -> dict[str, str]:
    lines = [line.removeprefix("#SBATCH").strip() for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    return dict(option.removeprefix("--").partition("=")[::2] for option in lines)


def torchrun_words() -> list[str]:
    """The srun line, continuations joined, as the shell splits it (the job's variables given values)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("srun "))
    values = {"$SLURM_NNODES": "2", "$SLURM_JOB_ID": "4242", "$head_node": "node0", "$port": "29500"}
    for name, value in values.items():
        line = line.replace(name, value)
    return shlex.split(line)


def test_the_script_is_valid_shell():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_its_resources_match_its_torchrun_line():
    options, words = sbatch_options(), torchrun_words()
    assert options["nodes"] == "2" and options["ntasks-per-node"] == "1"  # one torchrun agent per node
    assert f"--nproc_per_node={options['gpus-per-node']}" in words  # a rank per GPU
    assert "--nnodes=2" in words and "--rdzv_backend=c10d" in words and "--rdzv_endpoint=node0:29500" in words
    text = SCRIPT.read_text()
    for variable in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"):
        assert f"export {variable}=" in text


def test_its_command_line_composes_into_a_valid_config():
    words = torchrun_words()
    overrides = words[words.index("train.py") + 1:]
    assert overrides[:4] == ["experiment=paper_qwen3_4b", "algo=dapo", "bicc=on", "rcc=on"]
    cfg = compose_cfg([o for o in overrides if not o.startswith("hydra.")])
    validate(cfg)  # as train.py does before anything loads
    assert cfg.bicc.enabled and cfg.rcc.enabled and cfg.algo.name == "dapo" and cfg.resume == "auto"
    assert "hydra.run.dir=outputs/slurm/4242" in overrides
    assert cfg.rollout.prompts_per_step % (2 * 4) == 0  # the queries split over the 8 ranks
