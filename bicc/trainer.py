"""Pieces of the RL step that train.py calls in order: chunked no-grad log-probs, the policy update
over minibatches and micro-batches, and the state a checkpoint must carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from bicc.logprobs import TokenBatch, batch_logprobs
from bicc.losses import LOSSES, StepTotals, masked_mean


@dataclass
class RLState:
    """Everything the RL loop mutates; ``step`` and ``data_pos`` go into checkpoints."""

    model: Any
    ref_model: Optional[Any]
    tokenizer: Any
    engine: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    task: Any
    init_path: str
    step: int = 0
    data_pos: int = 0

    def trainer_state(self) -> dict:
        return {"step": self.step, "data_pos": self.data_pos, "init_path": self.init_path,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        self.step, self.data_pos = state["step"], state["data_pos"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def needs_reference(algo_cfg) -> bool:
    return algo_cfg.kl_coef > 0


@torch.no_grad()
def logprobs_no_grad(model, batch: TokenBatch, micro_batch_size: int, temperature: float) -> torch.Tensor:
    """Per-token log-probs [N, L] in micro-batches, no graph kept (old and reference policies)."""
    was_training = model.training
    model.eval()
    chunks = []
    for start in range(0, batch.input_ids.shape[0], micro_batch_size):
        logp, _ = batch_logprobs(model, batch.rows(slice(start, start + micro_batch_size)), temperature)
        chunks.append(logp)
    model.train(was_training)
    return torch.cat(chunks)


def update_policy(state: RLState, batch: TokenBatch, old_logp, ref_logp, adv, cfg, step_seed: int) -> dict:
    """Epochs x minibatches optimizer steps over one rollout batch; gradients accumulate over
    micro-batches, each normalised by its minibatch's global ``StepTotals``."""
    model, loss_fn = state.model, LOSSES.get(cfg.algo.loss)
    n = batch.input_ids.shape[0]
    minibatch = n // cfg.train.minibatches_per_rollout
    generator = torch.Generator().manual_seed(step_seed)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    model.train()
    for _ in range(cfg.train.epochs_per_rollout):
        order = torch.randperm(n, generator=generator) if cfg.train.minibatches_per_rollout > 1 else torch.arange(n)
        for mb_start in range(0, n, minibatch):
            mb_rows = order[mb_start : mb_start + minibatch]
            totals = StepTotals.of(batch.completion_mask[mb_rows], cfg.rollout.max_new_tokens)
            state.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for mc_start in range(0, len(mb_rows), cfg.train.micro_batch_size):
                rows = mb_rows[mc_start : mc_start + cfg.train.micro_batch_size]
                micro = batch.rows(rows)
                logp, entropy = batch_logprobs(model, micro, cfg.rollout.temperature, with_entropy=True)
                loss, metrics = loss_fn(logp, old_logp[rows], None if ref_logp is None else ref_logp[rows],
                                        adv[rows], micro.completion_mask, cfg.algo, totals)
                loss.backward()
                step_loss += loss.item()
                for name, value in metrics.items():
                    add(name, value)
                add("train/entropy", masked_mean(entropy, micro.completion_mask).item())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
            state.optimizer.step()
            state.scheduler.step()
            add("train/loss", step_loss)
            add("train/grad_norm", grad_norm.item())
    metrics = {name: sums[name] / counts[name] for name in sums}
    metrics["train/lr"] = state.scheduler.get_last_lr()[0]
    return metrics
