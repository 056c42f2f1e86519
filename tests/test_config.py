import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bicc.trainer.validation import validate
from tests.conftest import CONF, compose_cfg

GROUPS = ["algo", "model", "data", "rollout", "eval", "logger"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_validates(group):
    for option in options(group):
        # data=jsonl leaves its files to the user (tests/test_benchmarks.py: empty is an error naming the field)
        jsonl = (group, option) == ("data", "jsonl")
        files = ["data.math.train_source=a.jsonl", "data.math.test_source=b.jsonl"] if jsonl else []
        cfg = compose_cfg([f"{group}={option}", "sft.cache_dir=/tmp/x", *files])
        validate(cfg)


def test_every_yaml_field_has_a_comment():
    for path in CONF.rglob("*.yaml"):
        lines = Path(path).read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("#") or stripped.startswith("- ") or stripped == "defaults:":
                continue
            if stripped.endswith(":") and not lines[i - 1].strip().startswith("#"):
                # a section header ("optim:") may go without one only when it is a known group block
                known = {"optim", "train", "sft", "hydra", "run", "sweep", "job", "tiny", "arith", "dist"}
                assert stripped[:-1] in known, f"{path}:{i + 1}"
                continue
            assert lines[i - 1].strip().startswith("#"), f"{path}:{i + 1} '{stripped}' has no comment above it"


def test_overrides_apply():
    cfg = compose_cfg(["rollout.group_size=4", "optim.lr=1e-5", "sft.cache_dir=/tmp/x"])
    assert cfg.rollout.group_size == 4 and cfg.optim.lr == 1e-5
    assert cfg.run_name == "grpo-tiny-arith-s0"


def test_unknown_algo_names_the_choices():
    with pytest.raises(Exception, match="grpo"):
        compose_cfg(["algo=dapoo"])


def test_unknown_key_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="clip_epsilon"):
        compose_cfg(["algo.clip_epsilon=0.3"])


@pytest.mark.parametrize(
    "override, field",
    [
        ("algo.clip_eps_low=0", "algo.clip_eps_low"),
        ("algo.clip_eps_high=-0.1", "algo.clip_eps_high"),
        ("algo.kl_coef=-1", "algo.kl_coef"),
        ("algo.loss=nope", "algo.loss"),
        ("algo.loss_agg=mean", "algo.loss_agg"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.engine=vllmm", "rollout.engine"),
        ("train.minibatches_per_rollout=3", "train.minibatches_per_rollout"),
        ("data.arith.ops=*", "data.arith.ops"),
        ("stage=finetune", "stage"),
        ("algo.dual_clip_c=0.5", "algo.dual_clip_c"),
        ("algo.ratio_denominator=new", "algo.ratio_denominator"),
        ("algo.overlong_buffer_share=1.5", "algo.overlong_buffer_share"),
        ("algo.max_sampling_rounds=0", "algo.max_sampling_rounds"),
        ("rollout.tis_cap=-1", "rollout.tis_cap"),
        ("bicc.mode=ring", "bicc.mode"),
        ("dist.param_dtype=fp8", "dist.param_dtype"),
        ("data.math.on_bad_row=ignore", "data.math.on_bad_row"),
        ("logger.wandb_mode=cloud", "logger.wandb_mode"),
        ("model.compile=yes", "model.compile"),
    ],
)
def test_validation_names_the_field(override, field):
    cfg = compose_cfg([override, "sft.cache_dir=/tmp/x"])
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        validate(cfg)


@pytest.mark.parametrize("old, new", [("gpu_memory_utilization=0.3", "rollout.vllm.gpu_memory_utilization=0.3"),
                                      ("sleep=true", "rollout.vllm.sleep=True"),
                                      ("enforce_eager=true", "rollout.vllm.enforce_eager=True"),
                                      ("max_model_len=4096", "rollout.vllm.max_model_len=4096"),
                                      ("kv_cache_bytes=1000", "rollout.vllm.kv_cache_bytes=1000"),
                                      ("worker_gpu_memory_utilization=0.8", "rollout.vllm.worker_gpu_memory_utilization=0.8"),
                                      ("static_cache=true", "rollout.hf.static_cache=True")])
def test_an_engine_key_of_the_flat_rollout_group_is_refused_naming_its_new_place(old, new):
    """Each engine's settings are a group of its own (rollout.vllm, rollout.hf): the old flat key stops the run before
    any model loads, with the command line that sets the new one; the new one validates."""
    with pytest.raises(ValueError, match=f"config field 'rollout.{old.split('=')[0]}': is now .*: {re.escape(new)}"):
        validate(compose_cfg([f"rollout.{old}", "sft.cache_dir=/tmp/x"]))
    validate(compose_cfg([new.replace("True", "true"), "sft.cache_dir=/tmp/x"]))


def test_algo_presets_match_their_papers():
    c = {name: compose_cfg([f"algo={name}", "sft.cache_dir=/tmp/x"]).algo for name in options("algo")}
    assert (c["grpo"].clip_eps_low, c["grpo"].clip_eps_high, c["grpo"].loss_agg) == (0.2, 0.2, "seq-mean-token-mean")
    dr, dapo = c["dr_grpo"], c["dapo"]
    assert (dr.advantage, dr.loss_agg, dr.kl_coef) == ("mean_centered", "seq-mean-token-sum-norm", 0.01)
    assert (dapo.clip_eps_high, dapo.loss_agg, dapo.dynamic_sampling, dapo.kl_coef) == (0.28, "token-mean", True, 0.0)
    assert c["dapo"].overlong_buffer_share == 0.2
    assert (c["gspo"].loss, c["gspo"].clip_eps_low, c["gspo"].clip_eps_high) == ("gspo", 3e-4, 4e-4)
    assert (c["gmpo"].loss, c["gmpo"].clip_eps_low, c["gmpo"].clip_eps_high) == ("gmpo", 0.4, 0.4)
    assert (c["aspo"].loss, c["aspo"].dual_clip_c, c["aspo"].clip_eps_high) == ("aspo", 3.0, 0.28)
    assert all(name == c[name].name for name in c)


def test_rcc_on_is_the_papers_correction_with_delta_on_q():
    """``rcc=on``: delta summed over tokens and read on q (Section 4.2, Appendices B/C, the Cov table), with or
    without BiCC and in the paper presets; Algorithm 1's x^c reading is one override away; ``rcc=mean`` differs from
    ``rcc=on`` in its reduction only."""
    for overrides in (["rcc=on"], ["bicc=on", "rcc=on"], ["experiment=paper_qwen3_4b", "algo=dapo", "bicc=on", "rcc=on"],
                      ["experiment=paper_phi4_mini", "rcc=on"], ["experiment=smollm2_arith", "bicc=on", "rcc=on"]):
        r = compose_cfg(["sft.cache_dir=/tmp/x", *overrides]).rcc
        assert (r.enabled, r.delta, r.delta_context) == (True, "sum", "q"), overrides
    assert compose_cfg(["rcc=on", "rcc.delta_context=xc"]).rcc.delta_context == "xc"
    mean = compose_cfg(["rcc=mean"]).rcc
    assert (mean.delta, mean.delta_context) == ("mean", "q")


def _lengths(overrides):
    from bicc.data import build_task
    from bicc.model.load import tokenizer_and_positions
    from bicc.trainer.validation import validate_lengths

    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "model.tiny.max_position_embeddings=512", "rollout.max_new_tokens=64",
                       "bicc=stable", *overrides])
    validate(cfg)
    validate_lengths(cfg.rollout, cfg.bicc, cfg.data, cfg.eval, build_task(cfg.data), *tokenizer_and_positions(cfg.model))


def test_lengths_that_fit_pass():
    _lengths([])


@pytest.mark.parametrize("overrides, field", [
    (["model.tiny.max_position_embeddings=64"], "rollout.max_new_tokens"),  # prompt + budgets > 64 positions
    (["rollout.max_new_tokens=500"], "rollout.max_new_tokens"),
    (["bicc.max_tokens=1200", "bicc.context_ratio=0.5"], "rollout.max_new_tokens"),  # the context budget counts
    (["eval.max_new_tokens=500"], "eval.max_new_tokens"),
])
def test_budgets_beyond_the_model_positions_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"config field '{field}'.*exceeds the model's \d+ positions"):
        _lengths(overrides)


def test_context_budget_only_counts_with_bicc_on():
    _lengths(["bicc=off", "bicc.max_tokens=1200", "bicc.context_ratio=0.5"])


def test_the_bicc_template_counts_toward_the_positions():
    """The budget bounds the attempts' tokens only; the preamble and one header per shown attempt come on
    top. 400 tokens of output + 40 of context fit 512 positions without them, not with them."""
    _lengths(["bicc=off", "rollout.max_new_tokens=400", "eval.max_new_tokens=64"])
    with pytest.raises(ValueError, match=r"BiCC template \(\d+ = preamble \+ 7 attempt headers\)"):
        _lengths(["rollout.max_new_tokens=400", "bicc.max_tokens=100", "eval.max_new_tokens=64"])


def _leaves(node, prefix=""):
    return {k: v for key, value in node.items()
            for k, v in (_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else
                         {f"{prefix}{key}": value}).items()}


def _own_keys(path):
    """The leaf keys a YAML file sets itself (its defaults list and Hydra's settings aside)."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    data.pop("defaults", None)
    data.pop("hydra", None)
    return _leaves(data)


def _parents(path):
    """The options of the same group this one builds on (its defaults list), nearest last."""
    import yaml

    names = [d for d in (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("defaults", [])
             if isinstance(d, str) and d not in ("_self_",) and not d.endswith("_schema")]
    return [p for name in names for p in (*_parents(path.parent / f"{name}.yaml"), path.parent / f"{name}.yaml")]


def test_each_default_is_written_once():
    """A default lives in the schema (bicc/config/), where its comment says what it means; a group's YAML option sets
    only what differs from it, or puts back what an option it builds on changed. (An experiment preset may pin a value
    it depends on: conf/experiment is not held to this.)"""
    from omegaconf import OmegaConf

    from bicc import config as C

    schemas = {"algo": C.AlgoConfig, "bicc": C.BiccConfig, "rcc": C.RccConfig, "model": C.ModelConfig,
               "data": C.DataConfig, "rollout": C.RolloutConfig, "eval": C.EvalConfig, "logger": C.LoggerConfig}
    restated = []
    for path in [CONF / "train.yaml", *sorted(p for g in schemas for p in (CONF / g).glob("*.yaml"))]:
        schema = schemas.get(path.parent.name, C.RunConfig)
        defaults = _leaves(OmegaConf.to_container(OmegaConf.structured(schema), resolve=False))
        inherited = {}
        for parent in _parents(path):
            inherited.update(_own_keys(parent))
        restated += [f"{path.relative_to(CONF)}: {key}" for key, value in _own_keys(path).items()
                     if key in defaults and defaults[key] == value and inherited.get(key, value) == value]
    assert not restated, restated


def test_closed_choices_come_from_literal_types_at_any_depth():
    """``choice(Literal[...])`` fields are checked wherever the schema sits (nested, optional); an Optional
    Literal also allows null; the error lists the Literal's values; unset optional sub-schemas are skipped."""
    from dataclasses import dataclass, field
    from typing import Literal, Optional

    from bicc.config.fields import check_schema, choice, need

    @dataclass
    class Inner:
        kind: str = choice(Literal["a", "b"], "a")
        dtype: Optional[str] = choice(Optional[Literal["x"]], None)

        @staticmethod
        def check(c):
            need(c.kind != "b" or c.dtype is not None, "outer.inner.kind", "'b' needs a dtype")

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        spare: Optional[Inner] = None

    check_schema(OmegaConf.structured(Outer), Outer)
    check_schema(OmegaConf.structured(Outer(inner=Inner("b", "x"))), Outer)
    with pytest.raises(ValueError, match=r"config field 'inner.kind': 'c' unknown; choose from: a, b$"):
        check_schema(OmegaConf.structured(Outer(inner=Inner("c"))), Outer)
    with pytest.raises(ValueError, match=r"'spare.dtype': 'y' unknown; choose from: x, null$"):
        check_schema(OmegaConf.structured(Outer(spare=Inner("a", "y"))), Outer)
    with pytest.raises(ValueError, match="'b' needs a dtype"):  # the schema's own check runs too
        check_schema(OmegaConf.structured(Outer(inner=Inner("b"))), Outer)


def longrope_dir(tmp_path):
    """A Phi-4-mini-shaped config (LongRoPE, original_max_position_embeddings 4096 of 131,072) with a local tokenizer."""
    from transformers import Phi3Config

    from bicc.model.tokenizer import build_char_tokenizer

    Phi3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
               vocab_size=128, max_position_embeddings=131_072, original_max_position_embeddings=4096,
               rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
               ).save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_longrope_model_under_vllm_stays_in_its_short_factor_range(tmp_path, engine):
    """vLLM 0.32 rotates every position with the long factors once max_model_len exceeds 4,096, transformers only
    positions past it: a Phi-4-mini engine sized for 4,096-token evaluations sampled every rollout from another
    policy. Under vLLM the lengths must fit 4,096 (the field is named); HF generate follows transformers."""
    from bicc.data import build_task
    from bicc.model.load import tokenizer_and_positions
    from bicc.trainer.validation import validate_lengths

    path = longrope_dir(tmp_path)
    assert tokenizer_and_positions(OmegaConf.create({"tiny": None, "path": str(path)}))[3] == 4096

    def lengths(*overrides):
        cfg = compose_cfg(["sft.cache_dir=/tmp/x", "model=phi4_mini", f"model.path={path}", f"rollout={engine}",
                           "data=arith", "eval=math500", "eval.limit=3", "rollout.max_new_tokens=64", *overrides])
        return validate_lengths(cfg.rollout, cfg.bicc, cfg.data, cfg.eval, build_task(cfg.data),
                                *tokenizer_and_positions(cfg.model))

    if engine == "hf":
        assert lengths() > 4096  # the paper's 4,096 new tokens after a prompt
        return
    with pytest.raises(ValueError, match=r"config field 'eval.max_new_tokens'.*LongRoPE.*4096"):
        lengths()
    with pytest.raises(ValueError, match=r"config field 'rollout.max_new_tokens'.*LongRoPE"):
        lengths("eval.max_new_tokens=64", "rollout.max_new_tokens=4090")
    assert lengths("eval.max_new_tokens=3000") <= 4096


def test_wandb_mode_in_the_environment_is_kept(monkeypatch):
    """WANDB_MODE=disabled in the environment was overridden by logger.wandb_mode's offline default."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert compose_cfg(["sft.cache_dir=/tmp/x"]).logger.wandb_mode == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert compose_cfg(["sft.cache_dir=/tmp/x"]).logger.wandb_mode == "offline"
    assert compose_cfg(["sft.cache_dir=/tmp/x", "logger.wandb_mode=online"]).logger.wandb_mode == "online"


def test_diag_splits_are_checked_only_when_the_diagnostics_run():
    small = ["rcc=on", "rollout.prompts_per_step=2", "diag.splits=4", "sft.cache_dir=/tmp/x"]
    with pytest.raises(ValueError, match="'diag.splits': must be <= rollout.prompts_per_step=2"):
        validate(compose_cfg([*small, "diag.every=10"]))
    validate(compose_cfg([*small, "diag.every=0"]))  # no diagnostics: their splits do not matter


def test_the_context_template_counts_the_preamble_and_one_header_per_shown_attempt():
    """A context shows at most G - 1 attempts: the preamble and the headers of attempts 1 .. G-1, by hand with the
    character tokenizer (one token per character)."""
    from bicc.model.tokenizer import build_char_tokenizer
    from bicc.trainer.validation import context_template_tokens

    tok = build_char_tokenizer()
    cfg = compose_cfg(["sft.cache_dir=/tmp/x", "bicc=on", "rollout.group_size=4", "bicc.preamble=ABC",
                       "bicc.attempt_header='#{i}:'"])
    assert context_template_tokens(cfg.bicc, cfg.rollout.group_size, tok) == 3 + 3 * len("#1:")  # "#1:", "#2:", "#3:"
    assert context_template_tokens(compose_cfg(["sft.cache_dir=/tmp/x", "bicc=off"]).bicc, 4, tok) == 0


def test_every_key_we_give_for_a_trl_or_verl_name_composes():
    """docs/config.md's table of TRL's and verl's names: each `key=value` (or group choice) in our column composes
    into a config that validates, and says what it sets."""
    import re as regex

    import yaml
    from omegaconf import OmegaConf

    from bicc.trainer.validation import validate
    from tests.helpers import ROOT

    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    table = page.split("## The names you know from TRL and verl", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `") or line.startswith("| —")]
    assert len(rows) >= 20
    for row in rows:
        ours = regex.findall(r"`([^`]+)`", row[2])
        assert ours, row
        for override in ours:
            key, _, value = override.partition("=")
            # a key that reads another of the row's (data.reward_weights: one weight per reward; the rejection's
            # criteria: their thresholds) composes with it
            reads = {"data.reward_weights": "data.rewards=",
                     "rollout.correction.rollout_rs": "rollout.correction.rollout_rs_threshold="}
            needs = [o for o in ours if o.startswith(reads[key])] if key in reads else []
            cfg = compose_cfg(["sft.cache_dir=/tmp/x", *needs, override])
            validate(cfg)
            if "." in key:  # a key: it holds the value given (a group choice: the group composed)
                actual, given = OmegaConf.select(cfg, key), OmegaConf.create({"v": yaml.safe_load(value)}).v
                # a float field holds the value as a float, a string one (a threshold like 0.5_2.0) as its text
                expected = float(given) if isinstance(actual, float) else str(given) if isinstance(actual, str) else given
                assert actual == expected, override
