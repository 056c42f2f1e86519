"""Exact resume after SIGKILL, and what resume does with incomplete or corrupt checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from bicc.trainer.checkpoint import CorruptCheckpoint, save_checkpoint, verify_checkpoint
from tests.helpers import ROOT, SMALL, conditioned_steps, logged_steps

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
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def kill_mid_way(args, run_dir, environment, after: int) -> None:
    """``train.py <args>`` into ``run_dir``, SIGKILLed once it has logged step ``after``, before its last (8)."""
    proc = subprocess.Popen([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=environment,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while logged_steps(run_dir) < after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < logged_steps(run_dir) < 8, "the run must die mid-way for this test to mean anything"


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    """The straight run builds the warm start in its process and the others reuse it: RL draws the same numbers
    either way (the SFT's draws used to shift them)."""
    reference = tmp_path / "reference"
    train([*RUN, f"hydra.run.dir={reference}"], tmp_path)  # builds the warm start the other runs reuse

    killed = tmp_path / "killed"
    kill_mid_way(RUN, killed, env(tmp_path), after=5)  # past the step-4 checkpoint, before the end

    out = train([*RUN, "resume=auto", f"hydra.run.dir={killed}"], tmp_path)
    assert "resumed from" in out.stdout
    a = load_file(reference / "checkpoints" / "step_8" / "model.safetensors")
    b = load_file(killed / "checkpoints" / "step_8" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(reference / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    sb = torch.load(killed / "checkpoints" / "step_8" / "trainer_state.pt", weights_only=True)
    for key, value in sa["optimizer"]["state"].items():
        assert all(torch.equal(value[k], sb["optimizer"]["state"][key][k]) for k in value)
    assert sa["scheduler"] == sb["scheduler"] and sa["data_pos"] == sb["data_pos"]
    # the logs read as one run: every step once, with the uninterrupted run's values
    ra = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [r.get("reward/mean") for r in ra] == [r.get("reward/mean") for r in rb]
    assert conditioned_steps(reference) == conditioned_steps(killed) and all(s > 0 for s in conditioned_steps(killed))
    da = (reference / "diagnostics.jsonl").read_text().splitlines()
    db = (killed / "diagnostics.jsonl").read_text().splitlines()
    assert da == db


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
    a = load_file(reference / "checkpoints" / "step_8" / "model.safetensors")
    b = load_file(other / "checkpoints" / "step_8" / "model.safetensors")
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


def test_a_dead_worker_stops_the_run_and_its_checkpoint_resumes(async_reference, tmp_path):
    """The worker exits while drawing batch 7: the run stops with an error naming it, the step-4 checkpoint stays
    sound, and resuming from it ends where the uninterrupted run does."""
    failed = tmp_path / "failed"
    proc = subprocess.run([sys.executable, "train.py", *ASYNC_RUN, f"hydra.run.dir={failed}"], cwd=ROOT,
                          env={**env(async_reference), "BICC_WORKER_FAULT": "sample:7:exit"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    assert "rollout worker 0 (CPU cores" in proc.stderr and "exited with code 3 while sampling step 7" in proc.stderr
    verify_checkpoint(failed / "checkpoints" / "step_4")
    assert not (failed / "checkpoints" / "step_6").exists() or logged_steps(failed) >= 6
    train([*ASYNC_RUN, "resume=auto", f"hydra.run.dir={failed}"], async_reference)
    same_run(async_reference / "reference", failed)


def _model():
    from bicc.config import TinyArchConfig
    from bicc.model.load import build_tiny

    return build_tiny(TinyArchConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16), seed=0)


def _checkpoint(tmp_path, step):
    state = {"step": step, "data_pos": 0, "init_path": "x", "optimizer": {}, "scheduler": {}}
    return save_checkpoint(tmp_path / "checkpoints" / f"step_{step}", *_model(), state, keep_last=0)


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
