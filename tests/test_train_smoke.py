"""train.py end to end in a subprocess, on a shrunken embedded default."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT, SMALL, conditioned_steps, run_train

pytestmark = pytest.mark.launch


def test_two_step_run_writes_metrics_checkpoint_and_results(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train([*SMALL, "train.memory_gib=4", f"hydra.run.dir={run_dir}"], tmp_path)
    assert f"outputs in {run_dir}" in proc.stdout.strip().splitlines()[-1]
    assert "[memory] predicted peak " in proc.stdout and " GiB per GPU (" in proc.stdout and "of 4.0 GiB" in proc.stdout
    # what it trains, printed first: the groups (non-paper forms named) and the run's own settings
    run_line = next(line for line in proc.stdout.splitlines() if line.startswith("[run]"))
    assert "algo=grpo bicc=stable (stabilised BiCC, not the paper's) rcc=mean" in run_line
    assert "2 steps of 4 prompts x G=4, max 16 tokens" in run_line and "context budget 6 tokens" in run_line
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 <= r["reward/mean"] <= 1 and r["train/lr"] > 0 for r in steps)
    assert all(r["perf/compiled_graphs"] == 0 for r in steps)  # model.compile=off on CPU (the default)
    assert len(conditioned_steps(run_dir)) == 2 and all(share > 0 for share in conditioned_steps(run_dir))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["steps"] == 2 and 0 <= results["final"]["eval/pass@1"] <= 1
    assert (run_dir / "checkpoints" / "step_2" / "model.safetensors").exists()
    cached = list((tmp_path / "cache").glob("sft-*/eval-*.json"))  # the warm start's score, reused by later runs
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == results["initial"]

    # resume: continue the same run to step 3 from its latest checkpoint
    proc = run_train([*[a for a in SMALL if not a.startswith("train.steps")], "train.steps=3", "resume=auto",
                      f"hydra.run.dir={run_dir}"], tmp_path)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    # eval.py scores the run dir's latest checkpoint
    eval_dir = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "eval.py", f"ckpt={run_dir}", "eval.num_problems=4", "eval.max_new_tokens=8",
                           f"hydra.run.dir={eval_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "BICC_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads((eval_dir / "summary.json").read_text())
    assert not (eval_dir / "eval.json").exists()  # one summary, not two
    assert scored["ckpt"].endswith("step_3") and scored["eval/num_problems"] == 4
    before = load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
    assert any(not (before[k] == after[k]).all() for k in before)


def test_sft_stage_alone_is_cached(tmp_path):
    first = run_train([*SMALL, "stage=sft", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert "[sft] 5 steps" in first.stdout
    second = run_train([*SMALL, "stage=sft", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert "reusing cached warm start" in second.stdout


def test_unknown_algo_fails_with_choices(tmp_path):
    proc = run_train([*SMALL, "algo=dapoo"], tmp_path, check=False)
    assert proc.returncode != 0
    assert "grpo" in proc.stderr and "algo" in proc.stderr


@pytest.mark.parametrize("bad", ["rollout.group_size=1", "algo.loss=nope"])
def test_invalid_value_fails_before_loading(tmp_path, monkeypatch, bad):
    """A value out of range or a name no registry holds fails validation before transformers or vLLM is imported
    (importing them is seconds of a run's start, before anything of the run is done)."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # each import a line on stderr
    proc = run_train([*SMALL, bad], tmp_path, check=False)
    assert proc.returncode != 0 and f"config field '{bad.split('=')[0]}'" in proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    heavy = {"transformers", "vllm", "bicc.model.load"}
    assert "torch" in imported and not imported & heavy, sorted(imported & heavy)


def test_multirun_makes_one_dir_per_job(tmp_path):
    """A job dir is named by its overrides; past 255 characters (here about 400) the name was an OSError before
    any job ran. A long name is cut and ends in a hash of the whole, so jobs stay apart and findable."""
    sweep = tmp_path / "sweep"
    run_train(["-m", *SMALL, "train.steps=1", "rollout.group_size=2,4", f"hydra.sweep.dir={sweep}"], tmp_path)
    dirs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and (p / "results.json").exists())
    assert [d[:2] for d in dirs] == ["0-", "1-"] and all(len(d) <= 255 for d in dirs)
    assert dirs[0].startswith("0-bicc.min_attempt_tokens=4,bicc=stable") and dirs[0][-8:] != dirs[1][-8:]


def test_job_dirname_keeps_short_names_and_cuts_long_ones_apart():
    from bicc.config import job_dirname

    assert job_dirname("algo=dapo,bicc=on") == "algo=dapo,bicc=on"
    assert job_dirname("x" * 200) == "x" * 200
    long_a, long_b = "a=1," + "x" * 300 + ",seed=0", "a=1," + "x" * 300 + ",seed=1"
    name_a, name_b = job_dirname(long_a), job_dirname(long_b)
    assert len(name_a) == 200 and name_a.startswith("a=1,xxx") and name_a[:191] == name_b[:191] and name_a != name_b
    assert name_a[-9:] == "-" + hashlib.sha1(long_a.encode()).hexdigest()[:8]


def test_nonfinite_steps_stop_the_run_with_a_checkpoint(tmp_path):
    # adv_eps = 0 makes a group with equal rewards divide 0 by 0: NaN advantages, a NaN loss
    run_dir = tmp_path / "nan"
    proc = run_train([*[a for a in SMALL if not a.startswith("train.steps")], "train.steps=10", "bicc=off", "rcc=off",
                      "algo.adv_eps=0", "train.max_nonfinite_steps=2", f"hydra.run.dir={run_dir}"], tmp_path,
                     check=False)
    assert proc.returncode != 0
    assert "2 optimizer steps in a row had a non-finite loss" in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/nonfinite_skip"] for r in rows if "train/nonfinite_skip" in r] == [1.0, 1.0]
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
