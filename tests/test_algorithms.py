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


# ---- verl's entries through train.py with the paper's BiCC, rollout workers and each form of the correction -------
# A loss with BiCC and RCC on; an advantage with BiCC on and RCC off (RCC replaces a variant's advantage, so only
# there does the estimator run); each with a form of rollout.correction (the worker's log-probs at the batch's
# version against pi_old on q). make test runs the first; make test-heavy the rest (tests/conftest.py HEAVY).
CORRECTION_FORMS = {
    "icepop+rejection": ["rollout.correction.rollout_is_threshold=0.5_2.0",
                         'rollout.correction.rollout_rs="token_k1,seq_mean_k3"',
                         'rollout.correction.rollout_rs_threshold="0.2_5.0,1.0"'],
    "sequence+normalised": ["rollout.correction.rollout_is=sequence", "rollout.correction.rollout_is_threshold=3.0",
                            "rollout.correction.rollout_is_batch_normalize=true"],
    "token-tis": [],
}
VERL_ENTRIES = [("dppo_tv", "on", "icepop+rejection"), ("dppo_kl", "on", "sequence+normalised"),
                ("gpg", "on", "token-tis"), ("dro", "on", "icepop+rejection"), ("rloo", "off", "sequence+normalised"),
                ("opo", "off", "icepop+rejection"), ("grpo_passk", "off", "token-tis"),
                ("reinforce_plus_plus_baseline", "off", "icepop+rejection")]


@pytest.mark.launch
@pytest.mark.parametrize(("algo", "rcc", "form"), VERL_ENTRIES, ids=[f"{a}-{f}" for a, _, f in VERL_ENTRIES])
def test_each_verl_entry_trains_under_bicc_and_rollout_workers(algo, rcc, form, tmp_path):
    import json

    from tests.helpers import run_train

    run_dir = tmp_path / "run"
    run_train([f"algo={algo}", "bicc=on", f"rcc={rcc}", *CORRECTION_FORMS[form], "rollout.async_steps=1",
               "train.steps=2", "sft.steps=5", "sft.batch_size=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
               "rollout.max_new_tokens=32", "bicc.min_attempt_tokens=4", "eval.num_problems=2",
               "eval.samples_per_problem=1", "eval.max_new_tokens=16", "logger.progress=false",
               "data.reward=tests.rewards:first_of_group", "data.reward_batched=true", f"hydra.run.dir={run_dir}"],
              tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in steps)
    assert all(r["bicc/samples_conditioned_share"] > 0 for r in steps)  # BiCC built and read contexts
    assert all("rollout_corr/rollout_is_mean" in r for r in steps)  # the workers' log-probs were corrected against
    if "rejection" in form:
        assert all("rollout_corr/rollout_rs_masked_fraction" in r for r in steps)
