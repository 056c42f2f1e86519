"""A smoke run per algorithm: two RL steps of every conf/algo preset under the paper's BiCC and RCC, built and
stepped as train.py's loop does (``build_rl_state``, ``rl_step``). The tiny random model cannot solve a sum, so
a coin decides each output's reward (a hash of its text): groups are mixed, advantages are non-zero and the
update must move the weights."""

import math

import pytest
import torch

from bicc.config import StepConfig
from bicc.model.load import build_tiny
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step
from tests.conftest import CONF, compose_cfg
from tests.helpers import ARCH, CoinTask

ALGOS = sorted(p.stem for p in (CONF / "algo").glob("*.yaml"))  # every preset on disk: a new one joins
# what only some presets do, seen in their metrics: ASPO's dual clip, Dr.GRPO's KL term, GMPO's geometric
# sequence ratio, DAPO's overlong shaping (outputs hit the 16-token limit) and dynamic sampling (mixed groups only)
OWN = {"aspo": lambda m: "train/dual_clip_frac" in m, "dr_grpo": lambda m: "train/kl_ref" in m,
       "gmpo": lambda m: "train/seq_ratio_mean" in m,
       "dapo": lambda m: m["reward/mean"] < m["reward/accuracy"] and m["train/adv_zero_group_share"] == 0}


@pytest.mark.parametrize("algo", ALGOS)
def test_two_steps_of_each_algorithm_with_bicc_and_rcc(algo, tmp_path):
    model, tok = build_tiny(ARCH, seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    cfg = compose_cfg([f"algo={algo}", "bicc=on", "rcc=on", "sft.cache_dir=/tmp/x", "rollout.prompts_per_step=4",
                       "rollout.group_size=4", "rollout.max_new_tokens=16", "bicc.min_attempt_tokens=2", "train.steps=2",
                       "diag.every=2", "diag.splits=2", "optim.warmup_steps=0", "optim.lr=1e-3"])
    s = build_rl_state(cfg, str(tmp_path / "init"), str(tmp_path / "init"), torch.device("cpu"))
    s.task = CoinTask(s.task)
    before = [p.detach().clone() for p in s.model.parameters()]
    records = [rl_step(s, StepConfig.of(cfg)) for _ in range(2)]
    metrics = records[-1][0]
    assert s.step == 2 and s.nonfinite_streak == 0
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    assert 0 < metrics["reward/accuracy"] < 1 and metrics["train/grad_norm"] > 0
    assert metrics["bicc/samples_conditioned_share"] > 0  # mixed groups: contexts were built
    assert OWN.get(algo, lambda m: "train/dual_clip_frac" not in m and "train/kl_ref" not in m)(metrics)
    assert sum("rcc/grad_var" in m and bool(d["delta"]) for m, d in records if d) == 1  # diagnostics, once in 2
    moved = sum(float((p.detach() - b).abs().max()) for p, b in zip(s.model.parameters(), before))
    assert moved > 0
