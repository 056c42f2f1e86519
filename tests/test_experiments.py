"""Every experiment and sweep preset composes, validates and carries the paper's values (Table 3)."""

import pytest
from hydra import compose, initialize_config_dir

from bicc.trainer.validation import validate
from tests.conftest import CONF, compose_cfg

PAPER_MODELS = {"paper_qwen3_4b": "Qwen/Qwen3-4B-Instruct-2507", "paper_phi4_mini": "microsoft/Phi-4-mini-instruct"}
VARIANTS = ["grpo", "dr_grpo", "dapo", "gspo", "gmpo", "aspo"]  # the paper's table
ALGOS = sorted(p.stem for p in (CONF / "algo").glob("*.yaml"))  # every variant on disk, the paper's and others


def compose_with_hydra(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("experiment", sorted(PAPER_MODELS))
def test_paper_experiment_has_table_3_values(experiment, monkeypatch):
    monkeypatch.delenv("BICC_DAPO_MATH", raising=False)  # the training data's default, not a local file's
    cfg = compose_cfg([f"experiment={experiment}"])
    validate(cfg)
    assert cfg.model.path == PAPER_MODELS[experiment] and cfg.model.tiny is None
    assert cfg.model.dtype == "bfloat16" and cfg.model.attn_implementation == "flash_attention_2"
    assert cfg.optim.lr == 1e-6 and list(cfg.optim.betas) == [0.9, 0.999] and cfg.optim.weight_decay == 0.01
    assert cfg.optim.clip_grad == 1.0 and cfg.optim.warmup_steps == 100 and cfg.train.steps == 3000
    assert cfg.optim.min_lr_ratio == 0.0  # cosine to zero
    assert cfg.rollout.prompts_per_step == 32 and cfg.rollout.group_size == 8  # 8 per GPU x 4 GPUs
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0 and cfg.rollout.max_new_tokens == 2048
    assert cfg.algo.clip_eps_low == 0.2 and cfg.algo.clip_eps_high == 0.2  # GRPO's epsilon
    assert cfg.bicc.enabled and cfg.bicc.context_ratio == 0.4 and cfg.bicc.max_tokens == 2048
    assert not cfg.bicc.old_on_context and cfg.bicc.lr_scale == 1.0  # the paper's equation, no stabiliser
    assert cfg.rcc.enabled and cfg.rcc.delta == "sum" and cfg.diag.stage_steps == 500
    assert cfg.data.math.train_source == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert [b.name for b in cfg.eval.benchmarks] == ["math500", "amc23", "aime24", "aime25"]
    assert cfg.eval.samples_per_problem == 32 and cfg.eval.temperature == 0.6 and cfg.eval.top_p == 0.95
    # Phi-4-mini's LongRoPE under vLLM: prompt + output within its 4,096-position short-factor range
    assert cfg.eval.max_new_tokens == (3328 if experiment == "paper_phi4_mini" else 4096)
    assert cfg.rollout.engine == "vllm" and cfg.eval.batch_tokens == 131_072  # HF evaluation sized by tokens
    assert cfg.dist.strategy == "fsdp2" and cfg.dist.param_dtype == "bfloat16" and cfg.dist.reduce_dtype == "float32"
    assert cfg.model.tiny is None  # a pretrained model: no warm start


@pytest.mark.parametrize("algo", ALGOS)
def test_command_line_picks_variant_and_switches_over_the_experiment(algo):
    cfg = compose_cfg(["experiment=paper_qwen3_4b", f"algo={algo}", "bicc=off", "rcc=off"])
    validate(cfg)
    assert cfg.algo.name == algo and not cfg.bicc.enabled and not cfg.rcc.enabled
    assert cfg.optim.lr == 1e-6  # the experiment's values stay
    default = compose_cfg([f"algo={algo}"])
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (default.algo.clip_eps_low, default.algo.clip_eps_high)


def test_variant_clip_ranges():
    """Each variant keeps the clip range of its own paper (conf/algo)."""
    clips = {a: (c.algo.clip_eps_low, c.algo.clip_eps_high) for a in VARIANTS for c in [compose_cfg([f"algo={a}"])]}
    assert clips["grpo"] == (0.2, 0.2) and clips["dr_grpo"] == (0.2, 0.2)
    assert clips["dapo"] == (0.2, 0.28) and clips["aspo"] == (0.2, 0.28)
    assert clips["gspo"] == (3e-4, 4e-4) and clips["gmpo"] == (0.4, 0.4)


@pytest.mark.parametrize("sweep, params, jobs", [
    ("sweep_paper_main", {"algo": "grpo,dr_grpo,dapo,gspo,gmpo,aspo", "bicc": "off,on", "rcc": "off,on"}, 24),
    ("sweep_paper_group_size", {"rollout.group_size": "2,8", "bicc": "off,on", "rcc": "off,on"}, 8),
    ("sweep_context_ratio", {"bicc.context_ratio": "0.2,0.4,0.6,0.8"}, 4),
])
def test_sweeps_compose(sweep, params, jobs):
    cfg = compose_with_hydra([f"experiment={sweep}"])
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    got = {k: str(v) for k, v in cfg.hydra.sweeper.params.items()}
    assert got == params
    n = 1
    for v in got.values():
        n *= len(v.split(","))
    assert n == jobs
    assert cfg.model.path == "Qwen/Qwen3-4B-Instruct-2507" and cfg.optim.lr == 1e-6
    if sweep != "sweep_paper_main":
        assert cfg.algo.name == "grpo"
    # every job of the grid composes and validates
    for job in _grid(got):
        validate(compose_cfg([f"experiment={sweep}", *job]))


def test_every_variant_joins_the_main_sweep_on_the_command_line():
    """The paper's grid holds its six variants; any other conf/algo option joins it by one argument (Hydra's basic
    sweeper lets an argument replace the config's values of a key), each of its jobs composing and validating."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    others = [a for a in ALGOS if a not in VARIANTS]
    cfg = compose_with_hydra(["experiment=sweep_paper_main"])
    arguments = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + [f"algo={','.join([*VARIANTS, *others])}"]
    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)
    assert len(jobs) == len(ALGOS) * 2 * 2 and {j[0] for j in jobs} == {f"algo={a}" for a in ALGOS}
    for job in jobs:
        if job[0].split("=")[1] in others:
            validate(compose_cfg(["experiment=sweep_paper_main", *job]))


def _grid(params):
    jobs = [[]]
    for key, values in params.items():
        jobs = [j + [f"{key}={v}"] for j in jobs for v in values.split(",")]
    return jobs


def test_model_presets():
    for name, path in (("qwen3_4b_instruct", "Qwen/Qwen3-4B-Instruct-2507"), ("phi4_mini", "microsoft/Phi-4-mini-instruct")):
        cfg = compose_cfg([f"model={name}"])
        validate(cfg)
        assert cfg.model.path == path and cfg.model.tiny is None and cfg.model.dtype == "bfloat16"


def test_data_presets_point_at_their_sources():
    cfg = compose_cfg(["data=math_train"])
    validate(cfg)
    assert cfg.data.task == "math"
    dapo = compose_cfg(["data=dapo_math17k"])
    assert dapo.data.math.problem_field == "prompt.0.content" and dapo.data.math.answer_field == "reward_model.ground_truth"
    assert dapo.data.math.extractors[0] == "answer_line" and dapo.data.math.test_problem_field == "problem"


@pytest.mark.parametrize("experiment", [None, "paper_qwen3_4b"])
def test_on_means_the_paper_everywhere(experiment):
    """`bicc=on rcc=on` is the published method whatever else is selected: pi_old on q, no stabiliser, the base
    learning rate, delta summed over tokens. The stabilised forms carry their own names."""
    pre = [f"experiment={experiment}"] if experiment else ["sft.cache_dir=/tmp/x"]
    cfg = compose_cfg([*pre, "algo=dapo", "bicc=on", "rcc=on"])
    assert cfg.bicc.enabled and not cfg.bicc.old_on_context and cfg.bicc.lr_scale == 1.0
    assert cfg.rcc.enabled and cfg.rcc.delta == "sum"
    stable = compose_cfg([*pre, "bicc=stable", "rcc=mean"])
    assert stable.bicc.old_on_context and stable.bicc.lr_scale < 1 and stable.rcc.delta == "mean"
    if experiment:  # the preset alone is the paper's method
        alone = compose_cfg([f"experiment={experiment}"])
        assert alone.bicc.enabled and not alone.bicc.old_on_context and alone.rcc.delta == "sum"
    else:  # the embedded default trains plain GRPO (its own choice, printed by make train)
        default = compose_cfg(["sft.cache_dir=/tmp/x"])
        assert not default.bicc.enabled and not default.rcc.enabled and default.algo.name == "grpo"


def test_dapo_overlong_buffer_scales_with_the_response_limit():
    """DAPO's buffer is 20% of the maximum length (4,096 of 20,480): 410 of the paper's 2,048 tokens, where a
    fixed 16 tokens shaped almost nothing."""
    from bicc.method.dapo import overlong_buffer_tokens

    cfg = compose_cfg(["experiment=paper_qwen3_4b", "algo=dapo"])
    assert overlong_buffer_tokens(cfg.algo, cfg.rollout.max_new_tokens) == 410
    assert overlong_buffer_tokens(compose_cfg(["algo=grpo"]).algo, 2048) == 0


def test_smollm2_preset_is_the_measured_task_with_the_paper_switches():
    """experiment=smollm2_arith: the task bench/task_fit.py (at 33c7de3) picked, every held-out problem evaluated, and bicc=on /
    rcc=on the paper's forms over it; the preset itself switches neither on."""
    from bicc.data import build_task

    cfg = compose_cfg(["experiment=smollm2_arith"])
    validate(cfg)
    assert cfg.model.name == "smollm2_135m" and cfg.rollout.engine == "vllm"
    assert not cfg.bicc.enabled and not cfg.rcc.enabled and cfg.algo.name == "grpo"
    ar = cfg.data.arith
    assert (ar.min_operands, ar.max_operands, ar.max_operand, ar.ops) == (2, 2, 9, "+")
    assert list(ar.extractors) == ["boxed", "last_number"] and "\\boxed{}" in ar.instruction
    task = build_task(cfg.data)
    held_out = task.test_problems(cfg.eval.num_problems)
    assert len({p.prompt for p in held_out}) == cfg.eval.num_problems == ar.test_size
    every = {f"{a}+{b}" for a in range(1, 10) for b in range(1, 10)}
    assert sum(task._is_test(e) for e in every) == ar.test_size  # the whole test split
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0 and cfg.rollout.group_size == 8
    assert cfg.eval.temperature == 0.6 and cfg.eval.top_p == 0.95
    on = compose_cfg(["experiment=smollm2_arith", "bicc=on", "rcc=on"])
    assert on.bicc.enabled and not on.bicc.old_on_context and on.bicc.lr_scale == 1.0 and on.rcc.delta == "sum"
