"""Exact resume after SIGKILL, and after a scheduler's SIGTERM or SIGUSR1 (the step finished and saved); what resume
does with incomplete or corrupt checkpoints."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from bicc.trainer.checkpoint import CorruptCheckpoint, save_checkpoint, verify_checkpoint
from tests.helpers import ROOT, SMALL, conditioned_steps, logged_steps, run_script, start_script

pytestmark = pytest.mark.launch

# GRPO + BiCC + RCC (the defaults) with every diagnostic on, a checkpoint every 2 steps. Attention dropout draws
# from the global RNG in every training forward (the rollouts' sampling does not): a resume that skipped restoring
# that RNG's state would train on other dropout masks and end elsewhere.
RUN = [*[a for a in SMALL if not a.startswith("train.steps")], "train.steps=8", "train.save_every=2",
       "train.keep_last=0", "diag.every=1", "diag.splits=2", "eval.num_problems=2", "eval.greedy=false",
       "model.tiny.attention_dropout=0.3"]


def env(tmp_path):
    return {**os.environ, "BICC_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def train(args, tmp_path):
    proc = run_script("train.py", args, ROOT, env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def kill_mid_way(args, run_dir, environment, after: int) -> None:
    """``train.py <args>`` into ``run_dir``, SIGKILLed once it has logged step ``after``, before its last (8)."""
    proc = start_script("train.py", [*args, f"hydra.run.dir={run_dir}"], ROOT, environment)
    deadline = time.time() + 300
    while logged_steps(run_dir) < after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < logged_steps(run_dir) < 8, "the run must die mid-way for this test to mean anything"


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    """The uninterrupted run. It builds the warm start in its process and the others reuse it: RL draws the same
    numbers either way (the SFT's draws used to shift them)."""
    root = tmp_path_factory.mktemp("sync")
    train([*RUN, f"hydra.run.dir={root / 'reference'}"], root)
    return root


def same_as_uninterrupted(reference, other):
    """Bit-identical weights, optimizer, schedule and data position at step 8, and logs that read as one run: every
    step once, with the uninterrupted run's values."""
    weights = "adapter_model.safetensors" if (reference / "checkpoints" / "step_8" / "adapter_config.json").exists() \
        else "model.safetensors"  # a LoRA run's checkpoint holds its adapters
    a = load_file(reference / "checkpoints" / "step_8" / weights)
    b = load_file(other / "checkpoints" / "step_8" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(reference / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    sb = torch.load(other / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    for key, value in sa["optimizer"]["state"].items():
        assert all(torch.equal(value[k], sb["optimizer"]["state"][key][k]) for k in value)
    assert sa["scheduler"] == sb["scheduler"] and sa["data_pos"] == sb["data_pos"]
    ra = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [r.get("reward/mean") for r in ra] == [r.get("reward/mean") for r in rb]
    assert conditioned_steps(reference) == conditioned_steps(other) and all(s > 0 for s in conditioned_steps(other))
    assert (reference / "diagnostics.jsonl").read_text() == (other / "diagnostics.jsonl").read_text()


def test_sigkill_then_resume_is_bit_identical(sync_reference, tmp_path):
    killed = tmp_path / "killed"
    kill_mid_way(RUN, killed, env(sync_reference), after=5)  # past the step-4 checkpoint, before the end
    out = train([*RUN, "resume=auto", f"hydra.run.dir={killed}"], sync_reference)
    assert "resumed from" in out.stdout
    same_as_uninterrupted(sync_reference / "reference", killed)


def test_sigkill_then_resume_is_bit_identical_with_lora_adapters(tmp_path):
    """model.lora: the checkpoint holds the adapters (and the base's path) with the trainer state, the resume loads
    base and adapters and ends where the uninterrupted run does, pi_ref (the adapters off) read at every step."""
    lora = [*RUN, "model.lora.r=4", "model.lora.alpha=8"]
    train([*lora, f"hydra.run.dir={tmp_path / 'reference'}"], tmp_path)
    assert not list((tmp_path / "reference" / "checkpoints").rglob("model.safetensors"))  # adapters only
    killed = tmp_path / "killed"
    kill_mid_way(lora, killed, env(tmp_path), after=5)
    out = train([*lora, "resume=auto", f"hydra.run.dir={killed}"], tmp_path)
    assert "resumed from" in out.stdout and "in LoRA adapters, which alone train" in out.stdout
    same_as_uninterrupted(tmp_path / "reference", killed)


# ---- Preemption: SIGTERM / SIGUSR1 finish the step, save it and exit REQUEUE_EXIT (bicc.machine.preemption) --------

def signalled(args, run_dir, environment, sig: str, where: list[str], steps_done: int, launcher=None):
    """``train.py <args>`` into ``run_dir`` that sends itself ``sig`` at ``where`` (``tests/signal_at.py``): it must
    exit REQUEUE_EXIT having trained and saved exactly ``steps_done`` steps, saying so with the signal's delay."""
    from bicc.machine.preemption import REQUEUE_EXIT

    script = ["tests/signal_at.py", sig, *where, "--", *args, f"hydra.run.dir={run_dir}"]
    if launcher:
        proc = subprocess.run([*launcher, str(ROOT / script[0]), *script[1:]], cwd=ROOT, env=environment,
                              capture_output=True, text=True, timeout=600, start_new_session=True)
    else:  # a process group of its own (BICC_SIGNAL_GROUP), as the launcher's
        proc = run_script(script[0], script[1:], ROOT, environment, timeout=600)
        launcher = [sys.executable]
    assert f"[test] {sig} sent in" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    if launcher[0] == sys.executable and len(launcher) == 1:
        assert proc.returncode == REQUEUE_EXIT, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(rf"\[rl\] preempted \((?:{sig} \d+\.\d s ago|another rank's signal)\): step {steps_done} finished",
                     proc.stdout), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert logged_steps(run_dir) == steps_done
    verify_checkpoint(run_dir / "checkpoints" / f"step_{steps_done}")
    assert not (run_dir / "checkpoints" / f"step_{steps_done + 1}").exists()
    assert not (run_dir / "results.json").exists()  # no final evaluation: the run is to be continued
    return proc


@pytest.mark.parametrize("sig, where, steps_done", [
    ("SIGTERM", ["generate:3"], 3),  # in step 3's rollout: step 3 is finished, then saved
    ("SIGUSR1", ["update:5"], 5),  # Slurm's --signal=USR1@N, in step 5's update
    ("SIGTERM", ["save:1", "save:2"], 3)],  # in step 2's periodic save, and again in the save it asks for (step 3)
    ids=["rollout", "update", "during-saves"])
def test_a_signal_saves_the_step_and_resume_is_bit_identical(sig, where, steps_done, sync_reference, tmp_path):
    stopped = tmp_path / "stopped"
    signalled(RUN, stopped, env(sync_reference), sig, where, steps_done)
    out = train([*RUN, "resume=auto", f"hydra.run.dir={stopped}"], sync_reference)
    assert f"at step {steps_done}" in out.stdout
    same_as_uninterrupted(sync_reference / "reference", stopped)


# ---- Rollout workers (rollout.async_steps): the batches drawn ahead are in the checkpoint -------------------

ASYNC_RUN = [*RUN, "rollout.async_steps=2"]


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory):
    """The uninterrupted async run (it builds the warm start the others reuse): its dir and its environment."""
    root = tmp_path_factory.mktemp("async")
    train([*ASYNC_RUN, f"hydra.run.dir={root / 'reference'}"], root)
    return root


def same_run(reference, other):
    """The two run dirs end with the same weights, optimizer and data position, and log the same steps."""
    weights = "adapter_model.safetensors" if (reference / "checkpoints" / "step_8" / "adapter_config.json").exists() \
        else "model.safetensors"  # a LoRA run's checkpoint holds its adapters
    a = load_file(reference / "checkpoints" / "step_8" / weights)
    b = load_file(other / "checkpoints" / "step_8" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(reference / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    sb = torch.load(other / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    for key, value in sa["optimizer"]["state"].items():
        assert all(torch.equal(value[k], sb["optimizer"]["state"][key][k]) for k in value)
    assert sa["data_pos"] == sb["data_pos"] and len(sa["pending_batches"]) == 2
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    keys = ("step", "reward/mean", "rollout/staleness_max", "rollout/prompts_drawn", "train/loss")
    assert [[r.get(k) for k in keys] for r in rows(reference)] == [[r.get(k) for k in keys] for r in rows(other)]


@pytest.mark.parametrize("kill_after", [3, 6])
def test_async_sigkill_then_resume_is_bit_identical(kill_after, async_reference, tmp_path):
    """Killed after step 3 (the step-2 checkpoint holds batches 2 and 3, drawn ahead) or 6: the resumed run trains
    each prompt once, on the batches the uninterrupted run trained."""
    killed = tmp_path / "killed"
    kill_mid_way(ASYNC_RUN, killed, env(async_reference), after=kill_after)
    out = train([*ASYNC_RUN, "resume=auto", f"hydra.run.dir={killed}"], async_reference)
    assert "2 drawn batch(es) read back from the checkpoint" in out.stdout
    same_run(async_reference / "reference", killed)


def test_a_run_whose_checkpoint_cannot_be_written_stops_naming_it_and_resumes(sync_reference, tmp_path):
    """Step 4's checkpoint meets a full disk: the run stops with an error naming the checkpoint and the cause, step
    2's stays the sound resume point, nothing of step 4's is left, and resume=auto ends where the uninterrupted run
    does."""
    failed = tmp_path / "failed"
    proc = run_script("tests/signal_at.py", ["ENOSPC", "save:2", "--", *RUN, f"hydra.run.dir={failed}"], ROOT,
                      env(sync_reference), timeout=600)
    ckpts = failed / "checkpoints"
    assert proc.returncode != 0 and "[test] ENOSPC in write 2" in proc.stdout
    assert f"checkpoint {ckpts / 'step_4'} could not be written (OSError: [Errno 28] No space left on device" in proc.stderr
    assert f"the previous checkpoint {ckpts / 'step_2'} is intact" in proc.stderr
    verify_checkpoint(ckpts / "step_2")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]
    train([*RUN, "resume=auto", f"hydra.run.dir={failed}"], sync_reference)
    same_as_uninterrupted(sync_reference / "reference", failed)


def test_a_signal_under_rollout_workers_keeps_the_drawn_batches(async_reference, tmp_path):
    """SIGTERM in step 3's update, to every process of the run (the worker and its math-verify processes too, as a
    scheduler may signal them all: they ignore it), two batches drawn ahead: step 3's checkpoint holds them, and the
    resumed run trains on them as the uninterrupted run did."""
    stopped = tmp_path / "stopped"
    signalled(ASYNC_RUN, stopped, {**env(async_reference), "BICC_SIGNAL_GROUP": "1"}, "SIGTERM", ["update:3"], 3)
    out = train([*ASYNC_RUN, "resume=auto", f"hydra.run.dir={stopped}"], async_reference)
    assert "2 drawn batch(es) read back from the checkpoint" in out.stdout
    same_run(async_reference / "reference", stopped)


def test_a_dead_worker_stops_the_run_and_its_checkpoint_resumes(async_reference, tmp_path):
    """The worker exits while drawing batch 7: the run stops with an error naming it, the step-4 checkpoint stays
    sound, and resuming from it ends where the uninterrupted run does. make test-heavy: in make test a failing worker
    stops the run (tests/test_async.py) and drawn batches resume after a signal (above)."""
    failed = tmp_path / "failed"
    proc = run_script("train.py", [*ASYNC_RUN, f"hydra.run.dir={failed}"], ROOT,
                      {**env(async_reference), "BICC_WORKER_FAULT": "sample:7:exit"}, timeout=600)
    assert proc.returncode != 0
    assert "rollout worker 0 (CPU cores" in proc.stderr and "exited with code 3 while sampling step 7" in proc.stderr
    verify_checkpoint(failed / "checkpoints" / "step_4")
    assert not (failed / "checkpoints" / "step_6").exists() or logged_steps(failed) >= 6
    train([*ASYNC_RUN, "resume=auto", f"hydra.run.dir={failed}"], async_reference)
    same_run(async_reference / "reference", failed)


# ---- Epoch boundaries: a resume at the data's wrap, or a step before it, reads the rows the uninterrupted run read --

def epoch_args(root):
    """8 math rows, 4 prompts a step: the data wraps after step 2, and epoch 1 reads the rows in an order of its own
    (data.math.shuffle). A saved tiny policy (no warm start), a checkpoint every step."""
    return ["model.tiny=null", f"model.path={root / 'policy'}", "data=jsonl", f"data.math.train_source={root / 'rows.jsonl'}",
            f"data.math.test_source={root / 'rows.jsonl'}", "data.math.shuffle=true", "bicc=on", "rcc=on",
            *[a for a in SMALL if not a.startswith(("sft.", "bicc=", "rcc=", "eval.num_problems"))], "eval.num_problems=2",
            "train.steps=4", "train.save_every=1", "train.keep_last=0", "diag.every=0"]


@pytest.fixture(scope="module")
def epoch_root(tmp_path_factory):
    from bicc.model.load import build_tiny
    from tests.helpers import ARCH

    root = tmp_path_factory.mktemp("epochs")
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    (root / "rows.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "problem": f"What is {i} + {i}?",
                                                         "answer": str(2 * i)}) + "\n" for i in range(8)))
    return root


MODE_ARGS = {"sync": [], "async": ["rollout.async_steps=1"]}  # the epoch-wrap runs: synchronous, or workers ahead


def uninterrupted(root, mode: str):
    """The uninterrupted run of ``mode`` over ``root``'s rows, trained by the first test that reads it (make test runs
    the sync cases alone)."""
    if not (root / mode / "results.json").exists():
        train([*epoch_args(root), *MODE_ARGS[mode], f"hydra.run.dir={root / mode}"], root)
    return root / mode


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("at", [2, 1], ids=["at-the-wrap", "a-step-before"])
def test_a_resume_about_the_epochs_wrap_reads_the_rows_of_the_uninterrupted_run(mode, at, epoch_root, tmp_path):
    """Resumed from step 2's checkpoint (data position 8: exactly the wrap) or step 1's, synchronously or with rollout
    workers one step ahead: steps 3 and 4 read epoch 1's rows in its own order, as the uninterrupted run read them, and
    end with its weights. The async cases are make test-heavy's: in make test, the batches drawn ahead are resumed
    after a SIGKILL and after a signal (the tests above)."""
    reference, resumed = uninterrupted(epoch_root, mode), tmp_path / "resumed"
    state = torch.load(reference / "checkpoints" / f"step_{at}" / "trainer_state.pt", weights_only=True)
    assert state["data_pos"] == 4 * at if mode == "sync" else state["pending_batches"]  # async: drawn ahead, kept
    train([*epoch_args(epoch_root), *MODE_ARGS[mode], f"resume={reference / 'checkpoints' / f'step_{at}'}",
           f"hydra.run.dir={resumed}"], epoch_root)
    a, b = (load_file(d / "checkpoints" / "step_4" / "model.safetensors") for d in (reference, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    keys = ("step", "reward/mean", "rollout/response_len", "train/loss")
    assert [[r.get(k) for k in keys] for r in rows(reference) if r["step"] > at] == \
        [[r.get(k) for k in keys] for r in rows(resumed) if r["step"] > at]


def _model():
    from bicc.config import TinyArchConfig
    from bicc.model.load import build_tiny

    return build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16), seed=0)


def _checkpoint(tmp_path, step):
    state = {"step": step, "data_pos": 0, "init_path": "x", "optimizer": {}, "scheduler": {}}
    return save_checkpoint(tmp_path / "checkpoints" / f"step_{step}", *_model(), state, keep_last=0)


@pytest.mark.parametrize("failure", ["disk-full", "permission", "midway"])
def test_a_failed_write_leaves_the_previous_checkpoint_and_names_the_cause(failure, tmp_path, monkeypatch):
    """A full disk while the weights are written (a part of them on disk), a permission refused, a write that raises
    after the weights (the trainer state): ``CheckpointWriteError`` names the path, the cause and the checkpoint that
    stays; nothing is renamed into place, no ``.tmp`` is left, and the older checkpoint is the one resume picks."""
    import errno

    import bicc.trainer.checkpoint as ck

    first = _checkpoint(tmp_path, 2)
    target = tmp_path / "checkpoints" / "step_4"
    write = ck.save_hf

    def full(model, tokenizer, path, state_dict=None):
        (path / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    def refused(model, tokenizer, path, state_dict=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def quota(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file data/0")

    cause = {"disk-full": ("save_hf", full, "No space left on device"),
             "permission": ("save_hf", refused, "Permission denied"),
             "midway": ("save_torch", quota, "PytorchStreamWriter failed writing file")}[failure]
    if cause[0] == "save_hf":
        monkeypatch.setattr(ck, "save_hf", cause[1])
    else:
        monkeypatch.setattr(ck, "save_hf", write)
        monkeypatch.setattr(ck.torch, "save", cause[1])
    state = {"step": 4, "data_pos": 0, "init_path": "x", "optimizer": {}, "scheduler": {}}
    with pytest.raises(ck.CheckpointWriteError) as raised:
        save_checkpoint(target, *_model(), state, keep_last=1)
    message = str(raised.value)
    assert f"checkpoint {target} could not be written" in message and cause[2] in message
    assert f"the previous checkpoint {first} is intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]  # kept: keep_last prunes after
    monkeypatch.undo()
    verify_checkpoint(first)
    assert ck.resume_dir("auto", tmp_path) == first


def test_corrupt_or_partial_checkpoints_are_named_and_skipped(tmp_path):
    from bicc.trainer.checkpoint import resume_dir

    good = _checkpoint(tmp_path, 2)
    corrupt = _checkpoint(tmp_path, 4)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated mid-write by a crash
    partial = tmp_path / "checkpoints" / "step_6.tmp"  # a write interrupted before the rename
    partial.mkdir()
    with pytest.raises(CorruptCheckpoint, match="step_4"):
        verify_checkpoint(corrupt)
    verify_checkpoint(good)
    assert resume_dir("auto", tmp_path) == good
    with pytest.raises(CorruptCheckpoint, match="step_4"):
        resume_dir(str(corrupt), tmp_path)
    (good / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(CorruptCheckpoint, match="trainer_state.pt"):
        verify_checkpoint(good)
    assert resume_dir("auto", tmp_path) is None  # nothing sound left: start over


def test_the_newest_of_twelve_checkpoints_is_resumed_and_kept(tmp_path):
    """Checkpoints are ordered by step number, not as text (where step_10 sorts before step_9): resume=auto and
    train.keep_last pick the newest."""
    from bicc.trainer.checkpoint import list_checkpoints, resume_dir

    for step in range(1, 13):
        _checkpoint(tmp_path, step)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == [f"step_{n}" for n in range(1, 13)]
    assert resume_dir("auto", tmp_path) == root / "step_12"
    _checkpoint(tmp_path, 13)
    save_checkpoint(root / "step_14", *_model(), {"step": 14, "data_pos": 0, "init_path": "x", "optimizer": {},
                                                  "scheduler": {}}, keep_last=3)
    assert sorted(p.name for p in root.iterdir()) == ["step_12", "step_13", "step_14"]


def test_no_pickle_outside_weights_only_loads():
    """Every torch.load in the code passes weights_only=True; nothing imports pickle."""
    for path in [*ROOT.glob("bicc/**/*.py"), ROOT / "train.py", ROOT / "eval.py"]:
        text = path.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line.strip()}"
