"""Preemption around the run (bicc/machine/preemption.py): what the processes a run starts for itself do with the
scheduler's signals. The run's own handling of a signal (finish the step, save it, exit 75): tests/test_resume.py."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

# A process that lets the signals pass, as a rollout or math-verify worker does: it survives SIGTERM and SIGUSR1
# sent to itself, and what it starts by exec (a subprocess, a spawned multiprocessing worker) or by fork has the
# default dispositions: a SIGTERM ends each, so a reward's ``with Pool(...)`` or ``p.terminate(); p.wait()`` returns.
LETS_PASS = textwrap.dedent("""
    import multiprocessing as mp, os, signal, subprocess, sys, time
    from bicc.machine.preemption import ignore_preemption

    def square(x):
        return x * x

    if __name__ == "__main__":
        ignore_preemption()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(0.5)
        child.terminate()
        print("exec child", child.wait(timeout=20))
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(ready_w, b"1")  # past the fork's hooks
            time.sleep(60)
            os._exit(0)
        os.read(ready_r, 1)
        os.kill(pid, signal.SIGTERM)
        print("fork child", os.waitpid(pid, 0)[1])
        for method in ("spawn", "fork"):
            with mp.get_context(method).Pool(1) as pool:
                result = pool.map_async(time.sleep, [60])  # a worker busy when the pool's exit terminates it
                time.sleep(1.0 if method == "fork" else 5.0)
            print(method, "pool ended")
        print("alive")
""")


@pytest.mark.launch
def test_a_process_that_lets_the_signals_pass_starts_children_that_take_them(tmp_path):
    script = tmp_path / "lets_pass.py"
    script.write_text(LETS_PASS)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "exec child -15" and lines[1] == "fork child 15", lines  # ended by SIGTERM, each
    assert lines[2:] == ["spawn pool ended", "fork pool ended", "alive"]


def test_the_launchers_grace_is_read_from_its_command_line_or_environment():
    from bicc.machine.preemption import launcher_grace

    elastic = {"TORCHELASTIC_RUN_ID": "x"}
    assert launcher_grace({}, "python -m torch.distributed.run --shutdown-timeout=540 train.py") is None  # no torchrun
    assert launcher_grace(elastic, "python -m torch.distributed.run --shutdown-timeout=540 train.py") == 540
    assert launcher_grace(elastic, "torchrun --nproc_per_node=4 --shutdown_timeout 120 train.py") == 120
    assert launcher_grace({**elastic, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, "torchrun train.py") == 90
    assert launcher_grace({**elastic, "PET_SHUTDOWN_TIMEOUT": "75"}, "torchrun train.py") == 75
    assert launcher_grace(elastic, "torchrun train.py") == 30  # torch's default


def test_the_save_of_a_preempted_step_against_the_launcher_and_the_scheduler():
    """Qwen3-4B (P = 4,022,468,096), bf16 over fp32 master weights, FSDP2. One node of 4: rank 0's node writes the
    bf16 weights (2P) and every shard of the master weights and AdamW's two moments (4P + 8P): 14P = 56.3 GB, 52 s at
    1 GiB/s, past torchrun's 30 s. Two nodes of 4: 2P + 12P / 2 = 8P = 32.2 GB, 30 s. DDP on one node: 14P, rank 0."""
    from bicc.machine.preemption import checkpoint_bytes, preemption_contract

    p = 4_022_468_096
    one_node = checkpoint_bytes(p, 2, 4, world=4, local_world=4, sharded=True)
    assert one_node == 14 * p and checkpoint_bytes(p, 2, 4, 8, 4, True) == 8 * p
    assert checkpoint_bytes(p, 2, 4, 4, 4, False) == 14 * p and checkpoint_bytes(p, 4, 4, 1, 1, False) == 12 * p
    line, warnings = preemption_contract(one_node, 1.0, 30, None, 100)
    assert line.startswith("a preempted run finishes its step and saves it: 52.4 GiB on this node, about 52 s")
    (cut,) = warnings
    assert "does not fit torchrun's --shutdown-timeout=30" in cut and "train.save_every=100 steps back" in cut
    assert preemption_contract(one_node, 1.0, 540, 600, 100)[1] == []  # the scripts' settings
    (lead,) = preemption_contract(one_node, 1.0, None, 20, 100)[1]
    assert "does not fit train.preemption_lead_s=20" in lead and "--signal=B:USR1@" in lead
    assert preemption_contract(one_node, 4.0, 30, None, 100)[1] == []  # 13 s at 4 GiB/s fits
    (order,) = preemption_contract(one_node, 1.0, 900, 600, 100)[1]
    assert "the scheduler's kill comes first" in order


def test_the_contract_again_with_a_measured_step_and_save():
    """90 s a step and 35 s a save need 125 s: inside 540, past torchrun's default 30 and a 100 s lead."""
    from bicc.machine.preemption import measured_contract

    assert measured_contract(90, 35, 540, 600, 100) is None
    late = measured_contract(90, 35, 30, None, 100)
    assert late == ("a step took 90 s and its checkpoint 35 s: a preempted step needs up to 125 s, past torchrun's "
                    "--shutdown-timeout=30: the save is cut and the run resumes from its last periodic checkpoint, up "
                    "to train.save_every=100 steps back")
    assert "past train.preemption_lead_s=100" in measured_contract(90, 35, None, 100, 100)
    assert measured_contract(90, 35, None, None, 100) is None


# ---- The rehearsal: the scripts' torchrun line, 2 FSDP2 ranks and 2 rollout workers on CPU ------------------------
REHEARSAL = ["algo=grpo", "bicc=on", "rcc=on", "data.reward=tests.rewards:first_of_group", "data.reward_batched=true",
             "sft.steps=5", "sft.batch_size=8", "train.steps=40", "train.save_every=0", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "rollout.max_new_tokens=16", "eval.num_problems=2", "eval.samples_per_problem=1",
             "eval.max_new_tokens=16", "logger.progress=false", "dist.strategy=fsdp2", "rollout.async_steps=1",
             "rollout.cpu_workers=2", "dist.timeout_minutes=3", "threads=1"]


def scripts_launcher_options() -> list[str]:
    """torchrun's options in docs/slurm/train_2x4.sbatch that are no rendezvous or layout (here: its shutdown timeout)."""
    from tests.test_slurm import torchrun_words

    words = torchrun_words()
    options = words[words.index(".venv/bin/torchrun") + 1:words.index("train.py")]
    return [o for o in options if not o.startswith(("--nnodes", "--nproc_per_node", "--rdzv"))]


def rehearse(tmp_path, env: dict, extra=()):
    """``torchrun --standalone --nproc_per_node=2 <the scripts' options> train.py`` with ``REHEARSAL``, every process
    of it marked in its environment; (the launcher, its output file, the run dir, the mark)."""
    import os
    import uuid

    mark, run_dir, out = uuid.uuid4().hex, tmp_path / "run", tmp_path / "torchrun.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *scripts_launcher_options(), str(ROOT / "tests" / "signal_at.py"), "NONE", "--", *REHEARSAL, *extra,
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "BICC_RUN_MARK": mark, **env}
    with open(out, "w") as f:  # a file: the workers inherit it
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, process_group=0)
    return proc, out, run_dir, mark


def logged_steps(run_dir) -> list[int]:
    import json

    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip() and "train/loss" in line]


def wait_for(predicate, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def nothing_left(mark: str) -> list[int]:
    import os

    from bench.common import processes_marked

    wait_for(lambda: not processes_marked(mark), 15, "the run's processes to end")
    left = processes_marked(mark)
    for pid in left:
        os.kill(pid, 9)
    return left


@pytest.mark.launch
def test_a_preempted_rehearsal_saves_its_last_step_past_torchruns_default_30_s(tmp_path):
    """SIGTERM to every process of the run (torchrun, both ranks, both workers: as a scheduler signals a job step)
    in a step, with the checkpoint write slowed to 35 s: torchrun waits the scripts' --shutdown-timeout for the ranks
    (its default 30 s would cut the save), each rank finishes the step and saves it, exit 75, and torchrun exits 1 (it
    reports the signal, not its ranks' codes: docs/reliability.md). The checkpoint is of the last step logged, and no
    process of the run is left."""
    import os
    import signal
    import time

    from bench.common import processes_marked
    from bicc.machine.preemption import REQUEUE_EXIT

    proc, out, run_dir, mark = rehearse(tmp_path, {"BICC_SLOW_SAVE_S": "35"})
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 2 or proc.poll() is not None, 400, "two steps")
        assert proc.poll() is None, out.read_text()[-3000:]
        signalled = time.monotonic()
        for pid in processes_marked(mark):
            os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    took, text = time.monotonic() - signalled, out.read_text()
    assert code == 1 and "SignalException" in text, text[-3000:]
    assert text.count(f"exit {REQUEUE_EXIT}, resume=auto continues from it") == 1, text[-3000:]  # rank 0 says it
    assert took > 35  # the save outlasted torchrun's default 30 s
    last = logged_steps(run_dir)[-1]
    assert (run_dir / "checkpoints" / f"step_{last}" / "COMPLETE").exists(), text[-3000:]
    assert not nothing_left(mark)


@pytest.mark.launch
def test_a_worker_killed_in_a_push_ends_the_rehearsal_naming_it(tmp_path):
    """A rollout worker SIGKILLed in the middle of receiving weight version 3 (after its first tensor; buckets of
    50 KiB, so the push goes on): the run ends within 60 s of its death, naming it, and leaves no process."""
    import time

    from bench.common import processes_marked

    proc, out, run_dir, mark = rehearse(tmp_path, {"BICC_WORKER_FAULT": "push:3:kill"}, ["rollout.push_bucket_mib=0.05"])
    workers = []
    try:
        def two_workers():
            workers[:] = [p for p in processes_marked(mark) if b"bicc.rollout.worker" in open(f"/proc/{p}/cmdline", "rb").read()]
            return len(workers) == 2 or proc.poll() is not None
        wait_for(two_workers, 400, "two workers")
        wait_for(lambda: not all(os_alive(p) for p in workers) or proc.poll() is not None, 400, "a worker's death")
        died = time.monotonic()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, 9)
    took, text = time.monotonic() - died, out.read_text()
    assert code != 0 and took < 60, (took, text[-3000:])
    assert "exited with code -9 while sending weight version 3: the transfer was aborted" in text, text[-3000:]
    assert not nothing_left(mark)


def os_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
