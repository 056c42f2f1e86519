"""What a verl or TRL user looks for on day one: evaluation during training (``train.eval_every``), the samples a
run keeps, rewards in TRL's form."""

import json
import shutil

import pytest

from tests.helpers import SMALL, run_train

EVAL_RUN = [*[a for a in SMALL if not a.startswith("train.steps")], "train.steps=4", "train.eval_every=2",
            "train.save_every=2", "train.keep_last=0", "bicc=on", "rcc=on"]


def eval_steps(run_dir) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "eval/pass@1" in r]


@pytest.mark.launch
def test_evaluation_every_n_steps_is_logged_once_even_across_a_resume(tmp_path):
    """Evaluations at steps 2 and 4 (the last one is the final evaluation), each with its seconds. A run killed
    after step 4's evaluation but before its checkpoint resumes from step 2 and evaluates step 4 once more, its row
    from before the kill rewound: each evaluation, and each step's samples, appear once."""
    run_dir = tmp_path / "run"
    run_train([*EVAL_RUN, "logger.samples_every=2", "logger.samples_rows=3", f"hydra.run.dir={run_dir}"], tmp_path)
    assert eval_steps(run_dir) == [2, 4]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["eval/seconds"] > 0 for r in rows if "eval/pass@1" in r)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")  # killed before the step-4 checkpoint was written
    (run_dir / "results.json").unlink()
    run_train([*EVAL_RUN, "logger.samples_every=2", "logger.samples_rows=3", "resume=auto", f"hydra.run.dir={run_dir}"],
              tmp_path)
    assert eval_steps(run_dir) == [2, 4]
    kept = [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert kept == [2, 2, 2, 4, 4, 4]  # the samples too: step 4's once


@pytest.mark.launch
def test_samples_every_n_steps_hold_the_contexts_the_update_read(tmp_path):
    """A 4-step BiCC run evaluating and keeping samples every 2 steps: samples.jsonl rows at steps 2 and 4, and each
    conditioned row's context is x^c as the update's rows hold it (the training process's ContextRows, recorded by
    tests/record_contexts.py), with the attempts it shows; the viewer prints a step's rows with escapes."""
    import io

    from bicc.trainer.samples import show

    run_dir = tmp_path / "run"
    run_train([*EVAL_RUN, "logger.samples_every=2", "logger.samples_rows=8", f"hydra.run.dir={run_dir}"], tmp_path,
              script="tests/record_contexts.py")
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [2, 4] and len(rows) == 16
    read = json.loads((run_dir / "contexts_read.json").read_text())  # step -> the contexts the update read, decoded
    conditioned = [r for r in rows if r["conditioned"]]
    assert conditioned, "the constructed reward mixes every group: some rows must be conditioned"
    for r in rows:
        assert r["context"] == (read[str(r["step"])][r["row"]] if r["conditioned"] else None)
        assert (len(r["attempts"]) > 0) == r["conditioned"] and set(r["attempts_cut"]) <= set(r["attempts"])
    assert eval_steps(run_dir) == [2, 4]
    out = io.StringIO()
    assert show(run_dir, out=out) == 4
    assert "=== step 4, row 0" in out.getvalue() and "--- context x^c" in out.getvalue()


@pytest.mark.launch
def test_a_run_with_trl_style_rewards_logs_each_by_name(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in SMALL if not a.startswith(("data.reward", "bicc=", "rcc="))]
    run_train([*args, "data.rewards=[tests.rewards:boxed_is_ground_truth,tests.rewards:brevity]",
               "data.reward_weights=[1.0,0.5]", f"hydra.run.dir={run_dir}"], tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["reward/brevity"] < 0 and 0 <= r["reward/boxed_is_ground_truth"] <= 1
        assert r["reward/mean"] == pytest.approx(r["reward/boxed_is_ground_truth"] + 0.5 * r["reward/brevity"], abs=1e-5)


def test_the_viewer_escapes_what_a_terminal_would_act_on_and_texts_are_capped(tmp_path):
    """Model outputs are untrusted: an escape sequence prints as text, and a long output is cut where it is kept."""
    import io

    from bicc.trainer.samples import cap, show, write_samples

    hostile = "\x1b[2J\x1b]0;owned\x07 answer \u202e42"
    row = {"step": 3, "row": 0, "group": 0, "prompt": "q", "completion": hostile, "reward": 1.0, "correct": 1.0,
           "advantage": 0.5, "finished": True, "weight_version": 3}
    write_samples(tmp_path, [row])
    out = io.StringIO()
    show(tmp_path, 3, out=out)
    printed = out.getvalue()
    assert "\x1b" not in printed and "\x07" not in printed and "\u202e" not in printed
    assert "\\x1b[2J" in printed and "answer" in printed
    assert cap("x" * 50, 20) == "x" * 20 + " [... 30 characters cut]" and cap("short", 20) == "short"
    with pytest.raises(SystemExit, match="no samples at step 4; steps with samples: \\[3\\]"):
        show(tmp_path, 4, out=out)
