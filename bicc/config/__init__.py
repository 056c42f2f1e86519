"""Typed config schemas (Hydra ConfigStore).

Every YAML file under ``conf/`` is checked against these dataclasses when Hydra composes it, so a misspelt key fails
at start-up. Fields without a sensible default are ``MISSING``: a config group must set them. Each default is
written here once, with a comment saying what the field means; a YAML option sets only what differs from it
(tests/test_config.py holds that). Closed choices are ``Literal`` types on their fields
(``bicc.config.fields.choice``) and each schema's ``check`` holds the ranges of its own fields;
``bicc.trainer.validation.validate`` runs them all, with the registries and the checks across groups, before any
model is loaded, naming the field and the fix.

| module | groups |
| --- | --- |
| ``method.py`` | ``algo``, ``bicc``, ``rcc`` |
| ``run.py`` | ``model``, ``optim``, ``train``, ``dist``, ``sft``, ``diag`` |
| ``rollout.py`` | ``rollout`` (its engines' ``rollout.vllm``, ``rollout.hf``) |
| ``correction.py`` | ``rollout.correction`` |
| ``data.py`` | ``data`` |
| ``evaluation.py`` | ``eval``, ``logger`` |
| ``fields.py`` | (the helpers: closed choices, the check that names the field) |
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from bicc.config.correction import CorrectionConfig, corrects, is_level
from bicc.config.data import ArithConfig, DataConfig, MathDataConfig
from bicc.config.evaluation import BenchmarkConfig, EvalConfig, LoggerConfig
from bicc.config.fields import choice, need
from bicc.config.method import AlgoConfig, BiccConfig, RccConfig, advantage_name
from bicc.config.rollout import HfConfig, RolloutConfig, VllmConfig
from bicc.config.run import (
    DiagConfig,
    DistConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    SFTConfig,
    TinyArchConfig,
    TrainConfig,
    diag_every,
)
from bicc.registry import ADVANTAGES


@dataclass
class RunConfig:
    """Top-level config composed by train.py and eval.py."""

    algo: AlgoConfig = MISSING
    bicc: BiccConfig = MISSING
    rcc: RccConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    rollout: RolloutConfig = MISSING
    eval: EvalConfig = MISSING
    logger: LoggerConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    # Global seed: model init, SFT data, rollout sampling (each step's seed derives from it).
    seed: int = 0
    # What to run: all (SFT warm start if the model is tiny, then RL, then eval) | sft (warm start only).
    stage: str = choice(Literal["all", "sft"], "all")
    # auto = cuda when available, else cpu.
    device: str = "auto"
    # CPU threads for torch; 0 = all cores.
    threads: int = 0
    run_name: str = MISSING
    # Checkpoint dir to resume from, or "auto" for the latest complete checkpoint of this run dir.
    resume: Optional[str] = None
    # Checkpoint (HF dir or run dir) to evaluate; used by eval.py.
    ckpt: Optional[str] = None

    @staticmethod
    def check(c) -> None:
        need(c.seed >= 0, "seed", f"must be >= 0, got {c.seed}")
        need(0 <= c.threads <= 4096, "threads", f"must be in [0, 4096] (0 = the usable cores), got {c.threads}")


class GroupsView:
    """A typed view of some of a run config's groups: the dataclass's fields name them."""

    @classmethod
    def of(cls, run: RunConfig):
        """The view's groups of a composed run config, and what it derives from them (``derived``)."""
        view = cls(**{f.name: getattr(run, f.name) for f in dataclasses.fields(cls) if f.name not in cls.DERIVED})
        return dataclasses.replace(view, **view.derived()) if cls.DERIVED else view

    DERIVED: tuple = ()  # fields looked up from the view's groups, not read from the run config


@dataclass(frozen=True)
class StepConfig(GroupsView):
    """What one RL step reads (``bicc.trainer.step.rl_step``, its plan and update, ``bicc.method.reference``): the
    method's groups and the trainer's, typed, and the run's seed. The run loop builds it once (``StepConfig.of``);
    nothing past the loop sees the model, data, evaluation or launch groups. ``reads``: what the run's advantage
    estimator declares it reads (``fn.reads``; ``("delta",)`` for RCC's), looked up once here, so that the plan
    computes RCC's delta for whichever estimator reads it."""

    algo: AlgoConfig
    bicc: BiccConfig
    rcc: RccConfig
    rollout: RolloutConfig
    train: TrainConfig
    optim: OptimConfig
    diag: DiagConfig
    logger: LoggerConfig
    seed: int = 0
    reads: tuple = ()

    DERIVED = ("reads",)

    def derived(self) -> dict:
        return {"reads": tuple(getattr(ADVANTAGES.get(advantage_name(self.algo, self.rcc)), "reads", ()))}


@dataclass(frozen=True)
class WarmStartConfig(GroupsView):
    """What the tiny models' supervised warm start reads (``bicc.trainer.sft``): its own group, the model it builds,
    the task, BiCC's context template (shown in some prompts), the optimizer's betas and clipping, the run's seed."""

    sft: SFTConfig
    model: ModelConfig
    data: DataConfig
    bicc: BiccConfig
    optim: OptimConfig
    seed: int = 0


REPO = Path(__file__).resolve().parents[2]


def job_dirname(overrides: str, limit: int = 200) -> str:
    """A multirun job's dir name from its overrides (Hydra's ``override_dirname``): unchanged up to ``limit``
    characters, else cut there and ended with 8 hex digits of the whole string's SHA-1, so a long command line
    stays under the file system's 255 and jobs that differ past the cut stay apart."""
    if len(overrides) <= limit:
        return overrides
    return f"{overrides[:limit - 9]}-{hashlib.sha1(overrides.encode()).hexdigest()[:8]}"


def register_configs() -> None:
    """Register the schemas with Hydra (YAML files pick them up through their defaults list) and the resolvers
    the YAML uses: ``${launch_time:PATTERN}``, the run's start time as rank 0 read it (one run dir for every
    rank under torchrun, where Hydra's ``${now:}`` is read by each process); ``${repo:}``, this repository's
    root (the data files' home, whatever the working directory); ``${job_dirname:OVERRIDES}``, a sweep job's dir
    name (``job_dirname``)."""
    from bicc.machine.host import launch_time

    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("repo", lambda: str(REPO), replace=True)
    OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="algo", name="algo_schema", node=AlgoConfig)
    cs.store(group="bicc", name="bicc_schema", node=BiccConfig)
    cs.store(group="rcc", name="rcc_schema", node=RccConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="rollout", name="rollout_schema", node=RolloutConfig)
    cs.store(group="eval", name="eval_schema", node=EvalConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


__all__ = [
    "AlgoConfig", "ArithConfig", "BenchmarkConfig", "BiccConfig", "DataConfig", "DiagConfig",
    "DistConfig", "EvalConfig", "LoggerConfig", "MathDataConfig", "ModelConfig", "OptimConfig", "RccConfig",
    "RolloutConfig", "RunConfig", "SFTConfig", "StepConfig", "WarmStartConfig", "TinyArchConfig", "TrainConfig", "diag_every",
    "register_configs", "CorrectionConfig", "corrects", "is_level", "VllmConfig", "HfConfig", "LoraConfig",
]
