"""The Slurm job scripts of docs/distributed.md, which cannot run here: ``docs/slurm/train_2x4.sbatch`` (the headline
run on 2 nodes) and ``train_async_2x4.sbatch`` (4 GPUs training, 4 vLLM rollout workers on another node). Their shell
is valid, their resources agree with their torchrun lines, those lines' overrides compose into a valid config, and
the async one starts the workers its run waits for, pointed at the port it serves."""

import shlex
import shutil
import subprocess

import pytest

from bicc.trainer.validation import validate
from tests.conftest import compose_cfg
from tests.helpers import ROOT

SCRIPT = ROOT / "docs" / "slurm" / "train_2x4.sbatch"
ASYNC = ROOT / "docs" / "slurm" / "train_async_2x4.sbatch"
VALUES = {"$SLURM_NNODES": "2", "$SLURM_JOB_ID": "4242", "$head_node": "node0", "$port": "29500", "$worker_port": "29600"}


def sbatch_options(script=SCRIPT) -> dict[str, str]:
    lines = [line.removeprefix("#SBATCH").strip() for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    return dict(option.removeprefix("--").partition("=")[::2] for option in lines)


def words(script=SCRIPT, marker: str = "torchrun") -> list[str]:
    """The srun line holding ``marker``, continuations joined, as the shell splits it (the job's variables given
    values)."""
    text = script.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("srun ") and marker in line)
    for name, value in VALUES.items():
        line = line.replace(name, value)
    return [w for w in shlex.split(line) if w != "&"]


def torchrun_words() -> list[str]:
    return words(SCRIPT)


@pytest.mark.parametrize("script", [SCRIPT, ASYNC])
def test_the_script_is_valid_shell(script):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


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


def test_the_async_script_starts_the_workers_its_run_waits_for():
    """Node 0: torchrun with a rank per GPU and rollout.remote_workers = node 1's GPUs; node 1: one worker per GPU,
    each connecting to node 0 at the rollout.worker_port the run serves."""
    options, trainer = sbatch_options(ASYNC), words(ASYNC)
    assert options["nodes"] == "2" and f"--nproc_per_node={options['gpus-per-node']}" in trainer
    overrides = trainer[trainer.index("train.py") + 1:]
    cfg = compose_cfg([o for o in overrides if not o.startswith("hydra.")])
    validate(cfg)
    assert cfg.bicc.enabled and cfg.rcc.enabled and cfg.rollout.async_steps == 1 and cfg.rollout.engine == "vllm"
    text = ASYNC.read_text()
    sampler = text[text.index('srun --nodes=1 --ntasks=1 --nodelist="$sampler_node"'):text.index('wait" &')]
    for name, value in VALUES.items():
        sampler = sampler.replace(name, value)
    gpus = sampler.split("for gpu in ")[1].split(";")[0].split()
    assert len(gpus) == cfg.rollout.remote_workers == int(options["gpus-per-node"])
    assert f"--connect node0:{cfg.rollout.worker_port}" in sampler and r"CUDA_VISIBLE_DEVICES=\$gpu" in sampler
    assert cfg.rollout.prompts_per_step % (4 * cfg.rollout.remote_workers) == 0  # shards over ranks, then workers


@pytest.mark.parametrize("script", [SCRIPT, ASYNC])
def test_torchrun_waits_for_the_save_within_the_schedulers_lead(script):
    """``--signal=B:USR1@600`` gives the job 600 s; torchrun's --shutdown-timeout (its wait for the ranks after passing
    the signal on) sits inside it, and the run is told the lead. At the paper preset the launch check finds the
    predicted save inside both; with torchrun's default 30 s the one-node trainer's (52 s) is cut, and it warns,
    naming the setting."""
    from types import SimpleNamespace

    from bicc.machine.memory import QWEN3_4B
    from bicc.trainer.fit import preemption_check

    lead = int(sbatch_options(script)["signal"].split("@")[1])
    trainer = words(script)
    launcher = " ".join(trainer[trainer.index(".venv/bin/torchrun"):trainer.index("train.py")])
    grace = int(next(w for w in trainer if w.startswith("--shutdown-timeout=")).split("=")[1])
    assert lead == 600 and 0 < grace < lead and f"train.preemption_lead_s={lead}" in trainer
    cfg = compose_cfg([o for o in trainer[trainer.index("train.py") + 1:] if not o.startswith("hydra.")])
    ranks = SimpleNamespace(world=8 if script == SCRIPT else 4, enabled=True, strategy="fsdp2")
    env = {"TORCHELASTIC_RUN_ID": "4242", "LOCAL_WORLD_SIZE": "4"}
    lines = preemption_check(cfg.train, cfg.model, None, ranks, env, launcher, QWEN3_4B.params())
    assert len(lines) == 1 and f"torchrun kills the ranks {grace} s after" in lines[0], lines
    if script == ASYNC:  # one node of trainers writes every shard: 52 s, past torchrun's default 30 s
        default = preemption_check(cfg.train, cfg.model, None, ranks, env,
                                   launcher.replace(f"--shutdown-timeout={grace}", ""), QWEN3_4B.params())
        assert default[0].startswith("warning: the save (52 s) does not fit torchrun's --shutdown-timeout=30"), default


@pytest.mark.parametrize("sig, requeued", [("SIGUSR1", True), ("SIGTERM", False)], ids=["ahead-of-the-limit", "preempted"])
def test_a_signal_to_the_job_stops_the_run_after_its_save_and_requeues_ahead_of_the_limit(sig, requeued, tmp_path):
    """The script's preemption, with srun and scontrol faked: USR1 (``--signal=B:USR1@600``) or TERM reaches the batch
    shell while the run works; the shell sends the run SIGTERM, waits while it saves (half a second here), and on USR1
    only asks Slurm to requeue the job (a TERM may be a user's scancel; Slurm requeues a preempted job itself)."""
    import os
    import signal
    import time

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake, log = tmp_path / "bin", tmp_path / "log"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/bash\nif [ "$1" = show ]; then echo node0; else echo "scontrol $*" >> "$LOG"; fi\n')
    (fake / "srun").write_text('#!/bin/bash\ntrap \'echo term >> "$LOG"; sleep 0.5; echo saved >> "$LOG"; exit 75\' TERM\n'
                               'echo started >> "$LOG"\nwhile true; do sleep 0.1; done\n')
    for tool in ("scontrol", "srun"):
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "LOG": str(log), "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "2", "HOME": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (log.exists() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, getattr(signal, sig))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    expected = ["started", "term", "saved"] + (["scontrol requeue 4242"] if requeued else [])
    assert log.read_text().split("\n")[:-1] == expected
    assert f"[slurm] {sig.removeprefix('SIG')}: the run saves its last step and stops" in out
    assert "stop()" in ASYNC.read_text() and "trap 'stop USR1' USR1" in ASYNC.read_text()  # the async script's too
