"""A variant of one's own is one module and one YAML (docs/extending.md): a throwaway loss with a hyperparameter of
its own, written into a temporary package and config directory, outside the library, runs a ``train.py`` step under
the paper's BiCC and RCC, logs its metric and checkpoints, and a bad value of its parameter is refused naming it."""

import json
import textwrap

import pytest

from tests.helpers import SMALL, run_train

MODULE = '''
"""A throwaway policy loss: the unclipped surrogate, scaled by a hyperparameter of its own."""
from dataclasses import dataclass

import torch

from bicc.config.fields import need
from bicc.method.losses.agg import aggregate
from bicc.method.losses.common import importance_weighted, log_ratio, variant_params


@dataclass(frozen=True)
class Params:
    scale: float = 1.0

    def check(self):
        need(self.scale > 0, "algo.params.scale", f"must be > 0, got {self.scale}")


def scaled_pg(logp, old_logp, ref_logp, adv, mask, cfg, totals, is_weight=None):
    p = variant_params(cfg, Params)
    pg = -p.scale * adv.unsqueeze(-1) * torch.exp(log_ratio(logp, old_logp, ref_logp, cfg))
    return aggregate(importance_weighted(pg, is_weight), mask, cfg.loss_agg, totals), {
        "train/scaled_pg_scale": logp.new_tensor(p.scale)}


scaled_pg.params = Params
'''

OTHERS = '''
"""An advantage, a reward and an engine of one's own."""
import torch

from bicc.rollout.engines.hf import HFEngine


def centred(rewards, group_ids, delta, cfg):
    """Centred rewards, less a tenth of RCC's delta: an estimator that reads delta without RCC."""
    groups = int(group_ids.max()) + 1
    mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, group_ids, rewards.double()) / torch.bincount(group_ids)
    return (rewards.double() - mean[group_ids] - 0.1 * delta.double()).float(), {
        "adv/centred_calls": 1.0, "adv/delta_abs_mean": float(delta.abs().mean())}


centred.reads = ("delta",)


def three_eighths(completion, problem):
    return 0.375


class LoudEngine(HFEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print("[my engine] sampling", flush=True)
'''

YAML = '''
# A throwaway variant: the unclipped surrogate, scaled.
defaults:
  - grpo
  - _self_

name: scaled_pg
loss: my_variants.scaled:scaled_pg
params:
  scale: 0.5
'''


@pytest.mark.launch
def test_a_variant_of_ones_own_is_a_module_and_a_yaml(tmp_path):
    package, conf = tmp_path / "src" / "my_variants", tmp_path / "my_conf" / "algo"
    package.mkdir(parents=True)
    conf.mkdir(parents=True)
    written = [package / "scaled.py", conf / "scaled_pg.yaml"]  # the two files, and nothing else
    written[0].write_text(textwrap.dedent(MODULE), encoding="utf-8")
    written[1].write_text(textwrap.dedent(YAML), encoding="utf-8")
    args = [*SMALL, "algo=scaled_pg", "bicc=on", "rcc=on", "train.steps=1", "train.save_every=1", "train.keep_last=0",
            f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", f"hydra.run.dir={tmp_path / 'run'}"]
    run_train(args, tmp_path, env={"PYTHONPATH": str(tmp_path / "src")})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = next(r for r in rows if r.get("step") == 1 and "train/loss" in r)
    assert step["train/scaled_pg_scale"] == 0.5 and step["bicc/samples_conditioned_share"] > 0
    assert list((tmp_path / "run").rglob("trainer_state.pt")), "no checkpoint written"
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml")
                  and "run" not in p.relative_to(tmp_path).parts[:1]) == sorted(written)

    bad = run_train([*args, "algo.params.scale=-1"], tmp_path, check=False, env={"PYTHONPATH": str(tmp_path / "src")})
    assert bad.returncode != 0 and "config field 'algo.params.scale': must be > 0, got -1" in bad.stdout + bad.stderr


@pytest.mark.launch
def test_an_advantage_reward_dataset_and_engine_of_ones_own_need_no_edit_of_the_library(tmp_path):
    """docs/extending.md's right column: an advantage, a reward and an engine in one module of the user's package,
    and the user's problems as JSONL files, run a ``train.py`` step by name, with no file of the library touched. The
    advantage reads RCC's delta without RCC (``reads = ("delta",)``): the step computes it for it."""
    package = tmp_path / "src" / "mine"
    package.mkdir(parents=True)
    (package / "parts.py").write_text(textwrap.dedent(OTHERS), encoding="utf-8")
    problems = [{"question": f"{a}+{b}", "solution": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems), encoding="utf-8")
    args = [*[a for a in SMALL if not a.startswith(("data.reward", "bicc=", "rcc="))], "bicc=on", "rcc=off",
            "bicc.reward_threshold=0.5",
            "sft.steps=0", "train.steps=1", "data=jsonl", f"data.math.train_source={tmp_path / 'train.jsonl'}",
            f"data.math.test_source={tmp_path / 'test.jsonl'}", "data.math.problem_field=question",
            "data.math.answer_field=solution", "data.reward=mine.parts:three_eighths",
            "algo.advantage=mine.parts:centred", "rollout.engine=mine.parts:LoudEngine", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(args, tmp_path, env={"PYTHONPATH": str(tmp_path / "src")})
    assert "[my engine] sampling" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = next(r for r in rows if r.get("step") == 1 and "train/loss" in r)
    assert step["adv/centred_calls"] == 1.0 and step["reward/mean"] == 0.375  # the user's advantage and reward
    assert step["adv/delta_abs_mean"] > 0 and step["perf/no_grad_passes"] == 2  # delta: pi_old and pi_ref on q
    assert step["rollout/prompts_drawn"] >= 1


TASK = '''
"""A throwaway task: a + b up to a bound of its own (data.params.top), answered after "Answer:", scored by the
output's length parity so that a random model's groups are mixed."""
import random
from dataclasses import dataclass

from bicc.config.fields import need
from bicc.data import Problem
from bicc.data.answers import answer_anchors


@dataclass(frozen=True)
class SumsParams:
    top: int = 9

    def check(self):
        need(self.top >= 1, "data.params.top", f"must be >= 1, got {self.top}")


class Sums:
    params = SumsParams
    answer_anchors = answer_anchors(["answer_line"])

    def __init__(self, data_cfg):
        self.top, self.seed = SumsParams(**data_cfg.params).top, data_cfg.seed
        print(f"[sums] up to {self.top}", flush=True)

    def _problem(self, split, index):
        rng = random.Random(f"{split}/{self.seed}/{index}")
        a, b = rng.randint(1, self.top), rng.randint(1, self.top)
        return Problem(f"{split}-{index}", f"What is {a} + {b}? End with Answer: <n>.", str(a + b))

    def train_problem(self, index):
        return self._problem("train", index)

    def test_problems(self, n):
        return [self._problem("test", i) for i in range(n)]

    def reward(self, completion, problem):
        return float(len(completion) % 2 == 0)
'''

ENGINE = '''
"""An engine of one\'s own: HF generate, saying so."""
from bicc.rollout.engines.hf import HFEngine


class LoudEngine(HFEngine):
    def generate(self, prompts, sampling):
        print(f"[my engine] {len(prompts)} prompts", flush=True)
        return super().generate(prompts, sampling)
'''

TASK_YAML = '''
# The throwaway task, up to 5.
defaults:
  - arith
  - _self_

# The task's class, from the user's package.
task: mine.sums:Sums
# Its own settings (SumsParams).
params:
  top: 5
'''


@pytest.mark.launch
def test_a_task_and_an_engine_of_ones_own_run_the_papers_method_with_no_edit_of_the_library(tmp_path):
    """A task is a module and a YAML of the user's (its own settings under data.params, checked against the dataclass
    it declares), an engine one module: a ``train.py`` step under ``bicc=on rcc=on`` samples the task's problems with
    the engine, BiCC builds its contexts and RCC corrects, and nothing of the library is touched."""
    package, conf = tmp_path / "src" / "mine", tmp_path / "my_conf" / "data"
    package.mkdir(parents=True)
    conf.mkdir(parents=True)
    written = {package / "sums.py": TASK, conf / "sums.yaml": TASK_YAML, package / "loud.py": ENGINE}
    for path, text in written.items():
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    args = [*[a for a in SMALL if not a.startswith(("data.reward", "bicc=", "rcc="))], "bicc=on", "rcc=on", "sft.steps=0",
            "train.steps=1", "data=sums", "rollout.engine=mine.loud:LoudEngine", "bicc.min_attempt_tokens=1",
            f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_train(args, tmp_path, env={"PYTHONPATH": str(tmp_path / "src")})
    assert "[sums] up to 5" in proc.stdout and "[my engine] 4 prompts" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step = next(r for r in rows if r.get("step") == 1 and "train/loss" in r)
    assert 0 < step["reward/mean"] < 1 and step["bicc/samples_conditioned_share"] > 0 and "rcc/cov" in step
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml")
                  and "run" not in p.relative_to(tmp_path).parts[:1]) == sorted(written)


def test_a_tasks_own_settings_are_checked_against_what_it_declares(tmp_path, monkeypatch):
    """``data.params`` against the task's ``params`` dataclass before any model loads: its own check names the key, an
    unknown key is named with the task's parameters, and a task that declares none takes none."""
    from bicc.trainer.validation import validate
    from tests.conftest import compose_cfg

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "sums.py").write_text(textwrap.dedent(TASK), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["data.task=mine.sums:Sums", "sft.cache_dir=/tmp/x"]
    validate(compose_cfg([*base, "+data.params.top=3"]))
    with pytest.raises(ValueError, match="config field 'data.params.top': must be >= 1, got 0"):
        validate(compose_cfg([*base, "+data.params.top=0"]))
    with pytest.raises(ValueError, match="'data.params.bound': is not a parameter of the task 'mine.sums:Sums' \\(its "
                                         "parameters: top\\)"):
        validate(compose_cfg([*base, "+data.params.bound=3"]))
    with pytest.raises(ValueError, match="'data.params.top': is not a parameter of the task 'arith' \\(it takes none\\)"):
        validate(compose_cfg(["sft.cache_dir=/tmp/x", "+data.params.top=3"]))


def test_the_docs_name_the_files_each_new_loss_is():
    """docs/extending.md's loss row names the files a variant in the library is: each variant whose loss has a module
    of its own name has exactly those (module, YAML, test), and its module registers that name."""
    import re

    from bicc.method.losses import LOSSES
    from tests.conftest import CONF, ROOT

    row = next(line for line in (ROOT / "docs" / "extending.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| policy loss |"))
    pattern = re.findall(r"`([^`]+<name>[^`]*)`", row.split("|")[2])
    assert pattern == ["bicc/method/losses/<name>.py", "conf/algo/<name>.yaml", "tests/losses/test_<name>.py"]
    own = [p.stem for p in (CONF / "algo").glob("*.yaml")
           if (ROOT / "bicc" / "method" / "losses" / f"{p.stem}.py").exists()
           and (ROOT / "tests" / "losses" / f"test_{p.stem}.py").exists()]
    assert {"cispo", "sapo", "clip_cov", "kl_cov"} <= set(own)
    for name in own:
        assert LOSSES.get(name).__module__ == f"bicc.method.losses.{name}"


@pytest.mark.parametrize("kind, folder, group, key", [("advantage", "bicc/method/advantages", "algo", "advantage"),
                                                      ("task", "bicc/data/tasks", "data", "task"),
                                                      ("rollout engine", "bicc/rollout/engines", "rollout", "engine")])
def test_the_docs_count_the_files_of_every_other_kind(kind, folder, group, key):
    """docs/extending.md's row of each kind holds for every entry of the library that is a module of its own name: the
    module registers that name, a conf option selects it (``<key>: <name>``) and its test names it; the row lists
    those three and nothing else, so the files it counts are the files an entry is."""
    import re

    from bicc.registry import ADVANTAGES, ENGINES, TASKS
    from tests.conftest import CONF, ROOT

    registry = {"advantage": ADVANTAGES, "task": TASKS, "rollout engine": ENGINES}[kind]
    row = next(line for line in (ROOT / "docs" / "extending.md").read_text(encoding="utf-8").splitlines()
               if line.startswith(f"| {kind} |")).split("|")[2]
    assert row.count(",") == 2 and f"`{folder}/<name>.py`" in row and f"conf/{group}/" in row, row
    tests = re.findall(r"`(tests/[^`]+)`", row)  # one named test file, or "its test"
    modules = [p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"]
    assert modules
    for name in modules:
        entry = registry.get(name)  # the module registers its own name
        assert entry.__module__ == f"{folder.replace('/', '.')}.{name}"
        options = [p for p in (CONF / group).glob("*.yaml") if re.search(rf"^{key}: {name}$", p.read_text(), re.M)]
        assert options, f"no conf/{group} option sets {key}: {name}"
        files = [ROOT / t.replace("<name>", name) for t in tests] or list((ROOT / "tests").glob("test_*.py"))
        assert any(re.search(rf"\b{name}\b", f.read_text(encoding="utf-8")) for f in files if f.exists()), name
