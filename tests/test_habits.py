"""What a verl or TRL user looks for on day one: evaluation during training (``train.eval_every``)."""

import json
import shutil

import pytest

from tests.helpers import SMALL, run_train

pytestmark = pytest.mark.launch

EVAL_RUN = [*[a for a in SMALL if not a.startswith("train.steps")], "train.steps=4", "train.eval_every=2",
            "train.save_every=2", "train.keep_last=0", "bicc=on", "rcc=on"]


def eval_steps(run_dir) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "eval/pass@1" in r]


def test_evaluation_every_n_steps_is_logged_once_even_across_a_resume(tmp_path):
    """Evaluations at steps 2 and 4 (the last one is the final evaluation), each with its seconds. A run killed
    after step 4's evaluation but before its checkpoint resumes from step 2 and evaluates step 4 once more, its row
    from before the kill rewound: each evaluation appears once."""
    run_dir = tmp_path / "run"
    run_train([*EVAL_RUN, f"hydra.run.dir={run_dir}"], tmp_path)
    assert eval_steps(run_dir) == [2, 4]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["eval/seconds"] > 0 for r in rows if "eval/pass@1" in r)
    shutil.rmtree(run_dir / "checkpoints" / "step_4")  # killed before the step-4 checkpoint was written
    (run_dir / "results.json").unlink()
    run_train([*EVAL_RUN, "resume=auto", f"hydra.run.dir={run_dir}"], tmp_path)
    assert eval_steps(run_dir) == [2, 4]
