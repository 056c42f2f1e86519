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
