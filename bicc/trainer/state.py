"""The state one RL run mutates (what a checkpoint carries), and its builder: policy, frozen reference,
optimizer and schedule, rollout engine, the step's log-prob plan."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Optional

import torch

from bicc.config import StepConfig
from bicc.data import build_task
from bicc.kernels.compile import compile_layers, should_compile
from bicc.machine import distributed
from bicc.machine.distributed import DTYPES, Dist
from bicc.machine.ranks import Ranks
from bicc.machine.tracking import PhasePeaks
from bicc.model.load import compute_copy, end_token_ids, frozen_copy, load_policy
from bicc.model.lora import AdaptersOff, has_adapters
from bicc.rollout import ENGINES, EngineOptions, build_engine, engine_rows
from bicc.rollout.collect import Collection, DataCursor
from bicc.trainer.optim import build_optimizer, warmup_cosine
from bicc.trainer.plan import StepPlan, loads_reference


@dataclass
class RLState:
    """Everything the RL loop mutates; ``step`` and the data ``cursor`` go into checkpoints."""

    model: Any
    _: KW_ONLY  # everything else by name: a state for a part of the step needs only what that part reads
    ref_model: Optional[Any] = None
    tokenizer: Any = None
    engine: Any = None  # the rollout engine
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Any = None
    task: Any = None
    init_path: str = ""
    step: int = 0
    cursor: DataCursor = field(default_factory=DataCursor)  # where the next training problems are read
    nonfinite_skips: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm, in total
    nonfinite_streak: int = 0  # ... and in a row, up to now
    dist: Dist = field(default_factory=Dist)
    ranks: Ranks = field(default_factory=Ranks)  # what the step's ranks share (its collectives, FSDP2's hooks)
    end_ids: tuple = ()  # tokens that end an output (stripped from attempts shown in BiCC contexts)
    plan: Any = None  # the step's log-prob plan (bicc.trainer.plan.StepPlan), resolved once from the config
    collection: Optional[Collection] = None  # what a step samples and keeps (bicc.rollout.collect.Collection)
    peaks: PhasePeaks = field(default_factory=PhasePeaks)  # CUDA memory peaks per phase (none on CPU)
    workers: Any = None  # the rollout workers under rollout.async_steps (bicc.rollout.workers.RolloutWorkers)
    pending: Optional[dict] = None  # ... and the batches they had drawn, as a checkpoint holds them
    versions: Any = None  # ... and the weights of the versions they draw with (bicc.rollout.agreement.WeightVersions)
    samples: Optional[tuple] = None  # the last step's rollout, advantages and contexts, until the loop keeps rows of them
    # this process's prompt shards, of how many (``distributed.local_shards``, ``num_shards``): resolved once
    shards: range = range(1)
    num_shards: int = 1

    @property
    def sharded(self) -> bool:
        """Whether the policy is sharded over the ranks (FSDP2)."""
        return distributed.is_sharded(self.model)

    def trainer_state(self) -> dict:
        cursor = {"pos": self.cursor.pos, "shard_pos": list(self.cursor.shard_pos)}
        pending = self.workers.pending_state(self.step) if self.workers is not None else None
        if pending:  # the data position after the batches drawn but not trained, which the checkpoint holds
            cursor = pending["cursor"]
        state = {"step": self.step, "data_pos": cursor["pos"], "shard_pos": list(cursor["shard_pos"]),
                 "init_path": self.init_path,
                 "nonfinite_skips": self.nonfinite_skips, "nonfinite_streak": self.nonfinite_streak,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if pending:
            state["pending_batches"] = pending["batches"]
        return state

    def load_trainer_state(self, state: dict) -> None:
        self.step = state["step"]
        self.cursor = DataCursor(state["data_pos"], list(state.get("shard_pos", [])))
        if state.get("pending_batches"):
            self.pending = {"batches": state["pending_batches"],
                            "cursor": {"pos": self.cursor.pos, "shard_pos": list(self.cursor.shard_pos)}}
        self.nonfinite_skips = state.get("nonfinite_skips", 0)
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
        if "optimizer" in state:  # else saved sharded (FSDP2): bicc.machine.dcp.load_sharded_optimizer
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.apply_schedule()

    def apply_schedule(self) -> None:
        """Each group's lr from this run's schedule at the restored step: the optimizer's saved lr follows the
        schedule of the run that wrote it (a resume with more train.steps has a longer cosine)."""
        for group, base, multiplier in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                           self.scheduler.lr_lambdas):
            group["lr"] = base * multiplier(self.scheduler.last_epoch)


def peak_lr(optim, bicc) -> float:
    """optim.lr, times bicc.lr_scale while BiCC is on (the conditioned gradient is noisier for the
    policy on q; see docs/method.md, "BiCC: the default and the paper's equation")."""
    return optim.lr * (bicc.lr_scale if bicc.enabled else 1.0)


def build_rl_state(cfg, policy_path: str, init_path: str, device: torch.device,
                   d: distributed.Dist = distributed.Dist(), max_model_len: int | None = None) -> RLState:
    """Policy from ``policy_path`` (the initial policy, or a checkpoint when resuming) in fp32 master weights computing
    in ``model.dtype``; the frozen reference is always the initial policy at ``init_path`` (a full copy in the
    compute dtype on every process; under ``model.lora`` the policy with its adapters off). Under FSDP2 the HF
    rollout engine gets its own full copy of the policy in the compute dtype; otherwise it samples from the
    policy itself."""
    model, tokenizer = load_policy(policy_path, cfg.model, device, cfg.train.logprob_chunk_tokens)
    step_cfg = StepConfig.of(cfg)
    ref_model = None if not loads_reference(step_cfg) else \
        AdaptersOff(model) if has_adapters(model) else frozen_copy(init_path, cfg.model, device)  # no second base
    sharded_hf = d.enabled and d.strategy == "fsdp2" and ENGINES.get(cfg.rollout.engine).samples_from_module
    sampler = compute_copy(model, cfg.model) if sharded_hf else model
    if should_compile(cfg.model.compile, device):  # the trainer's forwards only (generation stays eager)
        layers = compile_layers(model, checkpoint_in_graph=cfg.model.checkpoint_in_graph)
        if d.is_main:
            print(f"[model] {layers} decoder layers compiled for the log-prob forwards (model.compile={cfg.model.compile})")
    end_ids = tuple(end_token_ids(tokenizer, model))
    model = distributed.wrap(model, cfg.dist, d, DTYPES[cfg.model.dtype])
    optimizer = build_optimizer(model, peak_lr(cfg.optim, cfg.bicc), cfg.optim.betas, cfg.optim.weight_decay)
    total = cfg.train.steps * cfg.train.epochs_per_rollout * cfg.train.minibatches_per_rollout
    scheduler = warmup_cosine(optimizer, cfg.optim.warmup_steps, total, cfg.optim.min_lr_ratio)
    rows = engine_rows(cfg.rollout, cfg.eval, distributed.num_shards(cfg.rollout, d))
    # a sampler that gets its weights pushed returns its log-probs, held to the trainer's (bicc.rollout.agreement)
    options = EngineOptions(end_ids=end_ids, dist=d, max_model_len=max_model_len, dtype=cfg.model.dtype, rows=rows,
                            logprobs=sharded_hf)
    # under rollout.async_steps the workers sample; the trainer's own engine (the same kind) evaluates
    engine = build_engine(cfg.rollout.engine, sampler, tokenizer, cfg.rollout, options)
    plan = StepPlan.from_config(step_cfg, sampler_logprobs(cfg.rollout, engine))
    return RLState(model, ref_model=ref_model, tokenizer=tokenizer, engine=engine, optimizer=optimizer, scheduler=scheduler,
                   task=build_task(cfg.data), init_path=init_path, dist=d, ranks=Ranks.of(d, cfg.dist),
                   end_ids=end_ids, plan=plan, collection=Collection.of(cfg.algo, cfg.rollout, cfg.data),
                   peaks=PhasePeaks(device), shards=distributed.local_shards(cfg.rollout, d),
                   num_shards=distributed.num_shards(cfg.rollout, d))


def sampler_logprobs(rollout, engine) -> bool:
    """Whether each rollout comes with the sampler's log-probs: from every rollout worker (the behaviour policy,
    ``rollout.async_steps``), else as the engine says."""
    return rollout.async_steps > 0 or engine.returns_logprobs
