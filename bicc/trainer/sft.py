"""Supervised warm start: fine-tune on task demonstrations, some with deliberate slips.

A random model never earns reward, so RL on the embedded task starts from an imperfect SFT model —
the "SFT baseline" row of the paper's tables. The result is cached as an HF-format checkpoint keyed by
everything that determines it (architecture, task, SFT settings, seed), and reused when present.
Run the stage alone with ``python train.py stage=sft``.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bicc.config import WarmStartConfig
from bicc.data import TASKS, encode_prompt
from bicc.machine.progress import progress as progress_bar
from bicc.method.conditioning import context_budget, render_context
from bicc.model.load import build_tiny
from bicc.model.logprobs import batch_logprobs, make_token_batch
from bicc.trainer.checkpoint import COMPLETE, save_hf
from bicc.trainer.optim import build_optimizer, warmup_cosine

SFT_INDEX_OFFSET = 10**9  # SFT draws its problems from a stream apart from RL's


def config_hash(*parts) -> str:
    """Short stable hash of config nodes and plain values."""
    plain = [OmegaConf.to_container(p, resolve=True) if OmegaConf.is_config(p) else p for p in parts]
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:12]


def sft_seed(cfg: WarmStartConfig) -> int:
    """Seed of the warm start: ``sft.seed`` when set (so RL seeds can share one checkpoint), else ``seed``."""
    return cfg.seed if cfg.sft.seed is None else cfg.sft.seed


# data.* keys that RL reads and the warm start does not (the rewards' extras, the prompt length limit).
NOT_IN_WARM_START = ("rewards", "reward_weights", "reward_errors", "max_prompt_length", "prompt_overflow")


def cache_key(cfg: WarmStartConfig) -> str:
    """Hash of the resolved settings that determine the SFT checkpoint."""
    sft = OmegaConf.to_container(cfg.sft, resolve=True)
    sft.pop("cache_dir")
    sft.pop("seed")  # folded into the effective seed below
    if sft["context_share"] == 0:  # no attempts are shown: which ones would be shapes nothing
        sft.pop("context_attempts")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key in NOT_IN_WARM_START:  # read by RL only: a run that sets them reuses the warm start of one that does not
        data.pop(key, None)
    for task in TASKS.names():  # only the active task's settings shape the warm start
        if data["task"] != task:
            data.pop(task, None)
    if not data["params"]:  # a task outside the library's own settings (none: the keys warm starts had before them)
        data.pop("params")
    keyed = {"model": OmegaConf.to_container(cfg.model.tiny, resolve=True), "data": data,
             "sft": sft, "seed": sft_seed(cfg), "format": 2}
    if cfg.sft.context_share > 0:  # the template shown in SFT prompts then shapes the checkpoint too
        keyed["template"] = [cfg.bicc.preamble, cfg.bicc.attempt_header, cfg.bicc.elision, cfg.bicc.context_ratio,
                             cfg.bicc.max_tokens, cfg.bicc.min_attempt_tokens, cfg.bicc.truncate]
        if cfg.bicc.layout != "paper":  # the released layout (a key of its own, so earlier warm starts keep theirs)
            keyed["template"] += [cfg.bicc.layout, cfg.bicc.separator_id]
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]


def cache_path(cfg: WarmStartConfig) -> Path:
    return Path(cfg.sft.cache_dir) / f"sft-{cache_key(cfg)}"


CONTEXT_ATTEMPTS = ("independent", "informative")


def demonstrations(task, tokenizer, indices: list[int], seed: int, context_share: float = 0.0, bicc_cfg=None,
                   context_attempts: str = "independent") -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """Prompts and demonstrations for ``indices``. With ``context_share`` > 0 that share of prompts also
    shows 1-4 other attempts at the same problem under the BiCC template, so the warm start has read such
    prompts before RL conditions on them. ``context_attempts``:

    - ``independent``: the attempts are further demonstrations (slips at the task's rate) and the target is
      drawn as for a plain prompt, so the attempts carry no information about it;
    - ``informative``: each attempt is slipped or correct with probability 1/2 (all-correct, all-wrong and
      mixed sets, like BiCC's x- and x+ contexts) and the target is correct, so reusing a correct attempt
      and not repeating a wrong one pays.

    Returns prompt ids, completion ids and, per row, whether its prompt shows attempts."""
    if context_attempts not in CONTEXT_ATTEMPTS:
        raise ValueError(f"config field 'sft.context_attempts': expected one of {CONTEXT_ATTEMPTS}, got {context_attempts!r}")
    prompts, completions, shown = [], [], []
    for index in indices:
        problem = task.train_problem(index)
        rng = random.Random(f"{seed}:demo:{index}")
        demo = task.demonstration(problem, rng)
        prompt_ids, context = encode_prompt(tokenizer, problem.prompt), None
        if context_share > 0 and rng.random() < context_share:
            informative = context_attempts == "informative"
            attempts = [tokenizer(task.demonstration(problem, rng, slip=rng.random() < 0.5 if informative else None),
                                  add_special_tokens=False)["input_ids"] for _ in range(rng.randint(1, 4))]
            if informative:
                demo = task.demonstration(problem, rng, slip=False)
            context = render_context(tokenizer, problem.prompt, attempts, bicc_cfg, context_budget(bicc_cfg))
            prompt_ids = context or prompt_ids
        prompts.append(prompt_ids)
        completions.append(tokenizer(demo, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        shown.append(context is not None)
    return prompts, completions, shown


def sft_loss(model, prompts, completions, shown, pad_id: int, device: torch.device) -> torch.Tensor:
    """Mean negative log-likelihood over every completion token, backpropagated (and returned detached).
    Rows with and without attempts in their prompt are padded and run apart, so the short plain prompts do
    not pay for the long ones' padding; the sum over both is the one-batch loss."""
    groups = [[i for i, s in enumerate(shown) if s == flag] for flag in (False, True)]
    total = sum(len(c) for c in completions)
    parts = []
    for rows in (g for g in groups if g):
        batch = make_token_batch([prompts[i] for i in rows], [completions[i] for i in rows], pad_id).to(device)
        logp, _ = batch_logprobs(model, batch)
        part = -(logp * batch.completion_mask).sum() / total
        part.backward()
        parts.append(part.detach())
    return sum(parts[1:], parts[0])


def train_sft(cfg: WarmStartConfig, task, device: torch.device, progress: bool = True):
    """Build the tiny model and fine-tune it; returns (model, tokenizer, metrics)."""
    model, tokenizer = build_tiny(cfg.model.tiny, sft_seed(cfg))
    model.to(device).train()
    sft = cfg.sft
    optimizer = build_optimizer(model, sft.lr, cfg.optim.betas, sft.weight_decay)
    scheduler = warmup_cosine(optimizer, sft.warmup_steps, sft.steps, sft.min_lr_ratio)
    start = time.perf_counter()
    bar = progress_bar(sft.steps, "sft", progress)
    loss_value, done = float("nan"), 0  # sft.steps = 0: the model as built
    for step in range(sft.steps):
        first = SFT_INDEX_OFFSET + step * sft.batch_size
        prompts, completions, shown = demonstrations(task, tokenizer, list(range(first, first + sft.batch_size)),
                                                     sft_seed(cfg), sft.context_share, cfg.bicc, sft.context_attempts)
        optimizer.zero_grad(set_to_none=True)
        loss = sft_loss(model, prompts, completions, shown, tokenizer.pad_token_id, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad)
        optimizer.step()
        scheduler.step()
        loss_value, done = loss.item(), step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        if sft.time_budget_s and time.perf_counter() - start > sft.time_budget_s:
            break
    bar.close()
    metrics = {"sft/loss": loss_value, "sft/steps": done, "sft/seconds": time.perf_counter() - start}
    return model, tokenizer, metrics


def warm_start(cfg: WarmStartConfig, task, device: torch.device, progress: bool = True) -> Path:
    """Path of the cached SFT checkpoint, training and saving it first if it is missing."""
    path = cache_path(cfg)
    if (path / COMPLETE).exists():
        print(f"[sft] reusing cached warm start {path}")
        return path
    model, tokenizer, metrics = train_sft(cfg, task, device, progress)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_hf(model, tokenizer, tmp)
    (tmp / "sft_metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    (tmp / COMPLETE).write_text("ok\n", encoding="utf-8")
    tmp.replace(path)
    print(f"[sft] {metrics['sft/steps']} steps in {metrics['sft/seconds']:.0f}s, final loss {metrics['sft/loss']:.3f} -> {path}")
    return path
