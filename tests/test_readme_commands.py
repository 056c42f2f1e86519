"""Every command of the README's "Everyday commands" runs, each started as a user types it, with the smallest
settings: one short run dir serves those that read one. A command another test already launches names that test
instead (each behaviour launched once). A command added to that block without a row here fails."""

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, SMALL, run_train

pytestmark = pytest.mark.launch

RUN = [*[a for a in SMALL if a != "train.steps=2"], "train.steps=1", "train.save_every=1", "train.keep_last=0",
       "logger.samples_every=1", "bicc=on"]
TINY_EVAL = ["eval.num_problems=4", "eval.samples_per_problem=1", "eval.max_new_tokens=8", "logger.progress=false"]
# a test named for a command must exist
NAMED = re.compile(r"tests/(test_\w+)\.py(?:::(\w+))?")
# each README command (its words up to the first placeholder or option) and how this test starts it
SMOKE = {
    "train.py rollout.group_size=4 optim.lr=1e-5": "covered by the run dir this test trains",
    "train.py -m rollout.group_size=4,8": "tests/test_train_smoke.py::test_multirun_makes_one_dir_per_job",
    "train.py algo=dapo bicc=on rcc=on": ["train.py", "algo=dapo", "rcc=on", *RUN],
    "train.py hydra.run.dir=outputs/x resume=auto": "tests/test_resume.py",
    "train.py rollout.async_steps=1": "tests/test_resume.py::test_async_sigkill_then_resume_is_bit_identical",
    "train.py train.eval_every=50": "tests/test_habits.py::test_evaluation_every_n_steps_is_logged_once_even_across_a_resume",
    "-m bicc.trainer.samples": ["-m", "bicc.trainer.samples", "{run}"],
    "eval.py ckpt=outputs/train/": ["eval.py", "ckpt={run}", *TINY_EVAL],
    "eval.py ckpt=": "eval=paper needs its benchmarks' models' lengths: covered by tests/test_benchmarks.py",
    "eval.py compare": "tests/test_eval_compare.py",
    "-m bicc.evaluation.plots": ["-m", "bicc.evaluation.plots", "{run}"],
    "-m bicc.trainer.probe": ["-m", "bicc.trainer.probe", "--batches", "1", "bicc=on", "sft.steps=5",
                              "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16"],
    "make setup-smollm2": "tests/test_smollm2.py (a wheel install)",
}


def readme_commands() -> list[str]:
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("## Everyday commands", 1)[1].split("```")[1]
    return [line.split("#")[0].replace(".venv/bin/python", "").strip() for line in block.splitlines()[1:] if line.strip()]


def test_every_everyday_command_has_a_smoke_run():
    commands = readme_commands()
    assert len(commands) >= 10
    for command in commands:
        assert any(command.startswith(key) for key in SMOKE), f"README command without a smoke run: {command}"
    for where in (v for v in SMOKE.values() if isinstance(v, str) and NAMED.match(v)):
        module, test = NAMED.match(where).groups()
        text = (ROOT / "tests" / f"{module}.py").read_text(encoding="utf-8")
        assert test is None or f"def {test}(" in text, f"{where}: no such test"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    run_train([*RUN, f"hydra.run.dir={tmp / 'run'}"], tmp)
    return tmp / "run"


@pytest.mark.parametrize("key", [k for k, v in SMOKE.items() if isinstance(v, list)])
def test_each_everyday_command_runs(key, run_dir, tmp_path):
    args = [a.replace("{run}", str(run_dir)) for a in SMOKE[key]]
    if args[0] == "train.py":
        run_train([*args[1:], f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
        return
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_MODE": "disabled", "BICC_CACHE": str(tmp_path / "c")}
    if args[0].endswith(".py"):
        args[0] = str(ROOT / args[0])
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"\S", proc.stdout), "printed nothing"
