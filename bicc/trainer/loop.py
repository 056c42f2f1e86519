"""The run around the step: warm start, the initial evaluation (cached per warm start), the RL loop with
checkpoints (atomic, resumable, distributed) and the final evaluation. ``train.py`` composes the config and
calls ``run``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bicc.config import StepConfig, WarmStartConfig, diag_every
from bicc.data import build_task
from bicc.evaluation.evaluate import evaluate, format_eval
from bicc.machine import dcp, distributed
from bicc.machine.distributed import DTYPES
from bicc.machine.host import allocator_conf, torch_threads, usable_cores
from bicc.machine.preemption import REQUEUE_EXIT, Preempted, Preemption, launcher_grace, measured_contract
from bicc.machine.progress import progress
from bicc.machine.tracking import Tracker, rewind_jsonl
from bicc.method.conditioning import context_budget
from bicc.model.gguf import resolve_model_path
from bicc.model.load import num_parameters, tokenizer_and_positions
from bicc.model.lora import has_adapters
from bicc.rollout import EngineOptions, build_engine, eval_engine_config
from bicc.rollout.agreement import SamplerGate, mismatch_limit
from bicc.rollout.collect import DataCursor
from bicc.rollout.workers import RolloutWorkers
from bicc.trainer import checkpoint as checkpoints
from bicc.trainer.banner import describe_choices, forward_layout
from bicc.trainer.fit import check_workers, launch_check, predicted_run, preemption_check
from bicc.trainer.samples import sample_rows, write_samples
from bicc.trainer.sft import config_hash, warm_start
from bicc.trainer.state import RLState, build_rl_state
from bicc.trainer.step import rl_step
from bicc.trainer.validation import validate_lengths


def initial_eval_cache(init_path: str, model, cache_dir: str, evaluation, data, seed: int, engine: str) -> Path | None:
    """Where the initial policy's score is kept, so that every run from one starting checkpoint shares it: inside
    a dir this library built and keyed (a warm start of ``model.tiny``, or a GGUF file converted under
    ``cache_dir``), named by the evaluation, task, seed, engine and ``model.dtype``. None for any other model (an HF
    id, a dir that may change)."""
    init = Path(init_path)
    if model.tiny is None and init.resolve().parent != Path(cache_dir).resolve():
        return None
    return init / f"eval-{config_hash(evaluation, data, seed, engine, model.dtype)}.json"


def eval_engine(s: RLState, rollout, evaluation):
    """vLLM evaluates with the rollout engine itself; HF with an engine over the sampling module (a full
    copy under FSDP2) batched by eval.batch_size. Under rollout.async_steps the workers sample and the trainer's
    engine is given the current weights here first (synchronously, every step does that)."""
    if rollout.async_steps and s.engine.version != s.step:
        s.engine.update_weights(s.model, s.step)
    if s.engine.model is None:
        return s.engine
    return build_engine("hf", s.engine.model, s.tokenizer, eval_engine_config(rollout, evaluation),
                        EngineOptions(end_ids=s.end_ids))


def save_rl_checkpoint(s: RLState, model_cfg, keep_last: int, ckpt_dir: Path) -> None:
    """Atomic checkpoint (bicc.trainer.checkpoint); every process calls this. HF-format weights in the compute
    dtype (``model.dtype``, what vLLM and evaluation load), gathered to a full state dict under FSDP2 and
    written by rank 0 with the trainer state; under FSDP2 each rank also writes its optimizer shard (DCP),
    and when the master weights are kept in a wider dtype they are written too (DCP, sharded under FSDP2),
    so that a resume is exact. Rank 0 marks the checkpoint complete last."""
    d = s.dist
    sharded = distributed.is_sharded(s.model)
    mixed = DTYPES[model_cfg.master_dtype] != DTYPES[model_cfg.dtype]
    weights = None  # one process or DDP in the master dtype: rank 0 writes the model as is
    if sharded or (mixed and d.is_main):  # every FSDP2 rank joins the gathers; rank 0 alone keeps the host copy
        weights = distributed.full_state_dict(s.model, DTYPES[model_cfg.dtype], keep=d.is_main)
        if s.model.config.tie_word_embeddings:  # gathered copies are no longer shared: keep the HF layout
            weights.pop("lm_head.weight", None)
    tmp = checkpoints.tmp_dir(ckpt_dir)
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier(d)
    state = s.trainer_state()
    if sharded:
        dcp.save_sharded_optimizer(s.model, s.optimizer, tmp)
        del state["optimizer"]
    if mixed:
        dcp.save_master_weights(s.model, tmp)
    distributed.barrier(d)
    if d.is_main:
        checkpoints.save_checkpoint(ckpt_dir, s.model, s.tokenizer, state, keep_last, state_dict=weights, keep_tmp=True)
    distributed.barrier(d)


def start_or_resume(resume: str | None, build, init_path: str, run_dir: Path, async_steps: int,
                    d: distributed.Dist = distributed.Dist()) -> RLState:
    """The state at the start: ``build(policy_path, init_path)`` (``build_rl_state``) from ``init_path``, or under
    ``resume`` from the checkpoint it names, its trainer state, optimizer, RNG and drawn batches restored."""
    ckpt = checkpoints.resume_dir(resume, run_dir) if resume else None
    ckpt = distributed.broadcast_object(ckpt, d)  # rank 0's choice (nodes may not share a file system view)
    if ckpt is None:
        return build(init_path, init_path)
    state = checkpoints.load_trainer_state(ckpt)
    s = build(str(ckpt), state["init_path"])
    dcp.load_master_weights(s.model, ckpt)  # the fp32 master behind the checkpoint's bf16 weights
    s.load_trainer_state(state)
    if "optimizer" not in state:  # written sharded by an FSDP2 run (any number of processes)
        dcp.load_sharded_optimizer(s.model, s.optimizer, ckpt)
        s.apply_schedule()
    checkpoints.set_rng_state(state["rng"])
    s.engine.version = s.step  # it was built from the checkpoint's weights, the version of this step
    print(f"[rl] resumed from {ckpt} at step {s.step}")
    if s.pending and not async_steps:  # drawn by an async run's workers: the synchronous step redraws them
        s.cursor = DataCursor(**s.pending["batches"][0]["cursors"]["before"])
        print(f"[rl] {len(s.pending['batches'])} batch(es) drawn ahead by rollout workers are drawn again synchronously")
        s.pending = None
    return s


def serve_line(rollout, dist_cfg):
    """The store rank 0 serves its rollout workers (``bicc.rollout.channel``) on ``rollout.worker_port`` (null: a free
    one)."""
    from bicc.rollout.channel import serve

    return serve(rollout.worker_port or 0, dist_cfg.timeout_minutes * 60)


def start_workers(s: RLState, workers: RolloutWorkers, r, dtype: str) -> None:
    """The rollout workers of ``rollout.async_steps`` (``r``), started with the policy's weights at ``s.step`` (sent
    in ``dtype``, ``model.dtype``) and any batches the checkpoint it resumed from held."""
    s.workers = workers
    if s.dist.is_main:
        where = [p.label for p in s.workers.places] + [f"{r.remote_workers} from other nodes"] * bool(r.remote_workers)
        print(f"[rollout] async_steps={r.async_steps}: {r.engine} on {s.workers.workers} worker(s) ({'; '.join(where)}), "
              f"weights over {s.workers.kind} in {dtype}; the trainer keeps {torch.get_num_threads()} "
              "thread(s)" + (f"; {len(s.pending['batches']) - s.workers.dropped} drawn batch(es) read back from the "
                             "checkpoint" if s.pending else ""))
        if s.workers.dropped:
            print(f"[rollout] {s.workers.dropped} drawn batch(es) of the checkpoint are older than rollout.async_steps="
                  f"{r.async_steps} allows: drawn again")
    s.workers.start(s.model, s.step)
    s.pending = None
    s.engine.sleep()  # the trainer's engine only evaluates now: vLLM's sleep mode frees its memory until then


def step_on_every_rank(s: RLState, cfg: StepConfig) -> tuple[dict, dict]:
    """This process's RL step (``rl_step``), then what the ranks share: every shard's data position (each rank
    advanced its own shards'; a checkpoint holds them all) and each metric's mean over the ranks that report it."""
    metrics, diag_record = rl_step(s, cfg)
    if s.cursor.shard_pos and s.dist.enabled:
        s.cursor.shard_pos = distributed.merge_shard_positions(s.cursor.shard_pos, cfg.rollout, s.dist)
    return distributed.mean_metrics(metrics, s.dist), diag_record


def run_rl(s: RLState, cfg, run_dir: Path, tracker: Tracker, preemption: Preemption | None = None) -> RLState:
    if s.dist.is_main:
        trains = sum(p.numel() for p in s.model.parameters() if p.requires_grad)
        adapters = f" ({trains / 1e6:.3f}M of them in LoRA adapters, which alone train)" if has_adapters(s.model) else ""
        print(f"[rl] {cfg.algo.name}: {num_parameters(s.model) / 1e6:.2f}M parameters{adapters}, {cfg.train.steps} steps of "
              f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples on {s.dist.world} process(es)")
        every = diag_every(cfg.diag, cfg.rcc)
        extra = f"; every {every} steps the diagnostics add their own" if every else ""
        print(f"[rl] passes per step: {' -> '.join(s.plan.describe())}{extra}")
        print(f"[rl] forwards: {forward_layout(s.model, cfg.bicc, cfg.train)}")
    start, step_cfg, preemption = time.perf_counter(), StepConfig.of(cfg), preemption or Preemption()
    gate = SamplerGate(mismatch_limit(cfg.train.max_sampler_mismatch, cfg.model.dtype), cfg.train.sampler_mismatch_steps)
    bar = progress(cfg.train.steps, "rl", cfg.logger.progress and s.dist.is_main, initial=s.step)
    last_eval = None  # the last evaluation's pass@1, shown on the progress line
    limits = launcher_grace(), cfg.train.preemption_lead_s  # checked again once a step and a save are measured
    while s.step < cfg.train.steps:
        step_start = time.perf_counter()
        metrics, diag_record = step_on_every_rank(s, step_cfg)
        step_s = time.perf_counter() - step_start
        every = cfg.logger.samples_every
        if every and s.step % every == 0 and s.samples and s.dist.is_main:  # rows kept for reading
            write_samples(run_dir, sample_rows(s.step, *s.samples, s.tokenizer, cfg.logger), tracker)
        s.samples = None
        if diag_record and s.dist.is_main:  # raw per-sample values for the delta histograms (bicc.evaluation.plots)
            with open(run_dir / "diagnostics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(diag_record) + "\n")
        if s.step % cfg.train.log_every == 0:
            tracker.log(metrics, step=s.step)
        if cfg.train.eval_every and s.step % cfg.train.eval_every == 0 and s.step < cfg.train.steps:
            # before the step's checkpoint: a run killed between the two evaluates again, after the rewind
            with s.peaks.phase("evaluation"):
                scores = evaluate(eval_engine(s, cfg.rollout, cfg.eval), s.tokenizer, s.task, cfg.eval, cfg.seed, d=s.dist)
            if s.workers is not None:
                s.engine.sleep()
            tracker.log(scores, step=s.step)
            last_eval = f"{100 * scores['eval/pass@1']:.1f}%"
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", loss=f"{metrics['train/loss']:.3f}",
                        **({"eval": last_eval} if last_eval else {}))
        share = metrics.get("bicc/samples_conditioned_share")
        if share is not None and share < 0.5 and s.dist.is_main and (s.step == 1 or s.step % 50 == 0):
            print(f"[bicc] warning: step {s.step}: only {100 * share:.0f}% of samples see an opposite attempt "
                  f"({metrics['bicc/attempts_shown']:.1f} shown on average, "
                  f"{100 * metrics['bicc/dropped_share']:.0f}% of attempts dropped by the budget "
                  f"bicc.context_ratio x bicc.max_tokens = {context_budget(cfg.bicc)} tokens)")
        out_of_time = cfg.train.time_budget_s and time.perf_counter() - start > cfg.train.time_budget_s
        out_of_time = bool(s.ranks.sum_value(float(bool(out_of_time))))  # all stop together
        preempted = bool(s.ranks.sum_value(float(preemption.requested)))  # any rank's signal
        diverged = s.nonfinite_streak >= cfg.train.max_nonfinite_steps
        mismatch = gate.check(metrics.get("rollout/token_prob_ratio"), s.step)  # the ranks' mean: one verdict
        ckpt = run_dir / "checkpoints" / f"step_{s.step}"
        if ((cfg.train.save_every and s.step % cfg.train.save_every == 0) or s.step == cfg.train.steps or out_of_time
                or diverged or preempted or mismatch):
            save_start = time.perf_counter()
            save_rl_checkpoint(s, cfg.model, cfg.train.keep_last, ckpt)
            late = measured_contract(step_s, time.perf_counter() - save_start, *limits, cfg.train.save_every)
            if late and s.dist.is_main and not preempted:
                print(f"[preemption] warning: {late}", flush=True)
                limits = None, None  # once
        if preempted:  # the step in progress was finished (bicc.machine.preemption says why) and is saved
            raise Preempted(f"[rl] preempted ({preemption.describe()}): step {s.step} finished, checkpoint {ckpt}; "
                            f"exit {REQUEUE_EXIT}, resume=auto continues from it")
        if diverged:
            raise RuntimeError(f"[rl] {s.nonfinite_streak} optimizer steps in a row had a non-finite loss or gradient "
                               f"norm (up to step {s.step}); stopped with a checkpoint at "
                               f"{run_dir / 'checkpoints' / f'step_{s.step}'}. Lower optim.lr or check the data.")
        if mismatch:
            raise RuntimeError(f"{mismatch} Stopped with a checkpoint at {ckpt}.")
        if out_of_time:
            print(f"[rl] time budget {cfg.train.time_budget_s}s reached at step {s.step}")
            break
    bar.close()
    return s


def run(cfg, d: distributed.Dist, run_dir: Path, choices: dict) -> dict:
    """Warm start (tiny models), RL, final evaluation; ``choices``: the config group choices, for the
    start-up summary. Returns the results (also written to ``run_dir/results.json``)."""
    torch.set_num_threads(torch_threads(cfg.threads, d.world))
    cuda = f"cuda:{d.local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(cuda if cfg.device == "auto" else cfg.device)
    torch.manual_seed(cfg.seed)
    if d.enabled:
        print(f"[dist] rank {d.rank}/{d.world} (local rank {d.local_rank}) on {device}, collectives on {d.device}")
    if d.is_main:
        print(f"[run] {describe_choices(choices, StepConfig.of(cfg), cfg.model, cfg.data, cfg.sft)}")
        cuda_line = f", CUDA allocator: {allocator_conf()}" if device.type == "cuda" else ""
        print(f"[host] usable cores: {usable_cores()}, torch threads per process: {torch.get_num_threads()}{cuda_line}")
    # rank 0 serves the rollout workers' store first thing, so that workers started beside it (another node's, by
    # Slurm) find it while it loads, and wait as long as it is there (bicc.rollout.worker)
    line_store = serve_line(cfg.rollout, cfg.dist) if cfg.rollout.async_steps and d.is_main else None
    status = lambda text: line_store.set("line/status", text) if line_store is not None else None  # noqa: E731
    status("building the task and checking its reward")
    task = build_task(cfg.data)
    cfg.model.path = resolve_model_path(cfg.model.path, cfg.sft.cache_dir)  # gguf:<package>/<file>: an HF dir
    tokenizer, *positions = tokenizer_and_positions(cfg.model)
    max_model_len = validate_lengths(cfg.rollout, cfg.bicc, cfg.data, cfg.eval, task, tokenizer, *positions)
    predict = lambda gib: predicted_run(cfg, task, tokenizer, d.world, d.enabled and d.strategy == "fsdp2", gib)  # noqa: E731
    fit = launch_check(cfg.train, cfg.model, predict, device) if cfg.stage != "sft" else None
    workers = check_workers(cfg.rollout, cfg.train, predict, d, device) if cfg.rollout.async_steps and d.is_main else []
    if d.is_main:  # the engine that samples the rollouts and both evaluations, sized to what they need
        print(f"[rollout] {cfg.rollout.engine} engine; longest sequence {max_model_len} tokens (prompt + context + "
              "new tokens, training or evaluation)")
        if fit:
            print(f"[memory] {fit}")
        for line in workers:
            print(f"[rollout] {line}")
        for line in preemption_check(cfg.train, cfg.model, tokenizer, d) if cfg.stage != "sft" else ():
            print(f"[preemption] {line}")

    # ---- warm start: tiny models are fine-tuned first (cached by settings; rank 0 builds it) --------
    init_path = cfg.model.path
    if cfg.model.tiny is not None:
        if d.is_main:
            init_path = str(warm_start(WarmStartConfig.of(cfg), task, device, cfg.logger.progress))
        distributed.barrier(d)
        if not d.is_main:
            init_path = str(warm_start(WarmStartConfig.of(cfg), task, device, False))  # the cached one
    if cfg.stage == "sft":
        print(f"[sft] warm start at {init_path}")
        return {"init_path": init_path}
    torch.manual_seed(cfg.seed)  # RL draws the same numbers whether its warm start was built here or cached

    tracker = Tracker(run_dir, cfg.run_name, OmegaConf.to_container(cfg, resolve=True), cfg.logger.wandb_mode,
                      cfg.logger.wandb_project, enabled=d.is_main)
    build = lambda policy, init: build_rl_state(cfg, policy, init, device, d, max_model_len)  # noqa: E731
    status("loading the policy")
    s = start_or_resume(cfg.resume, build, init_path, run_dir, cfg.rollout.async_steps, d)
    if d.is_main and s.engine.kv_bytes:
        print(f"[rollout] vLLM KV space {s.engine.kv_bytes / 2**30:.2f} GiB (rollout.vllm.kv_cache_bytes)")
    if s.step > 0 and d.is_main:  # rows of steps after the checkpoint are recomputed, identically: drop the old ones
        for name in ("metrics.jsonl", "diagnostics.jsonl", "samples.jsonl"):
            rewind_jsonl(run_dir / name, s.step)
    baseline = None
    if s.step == 0:  # score the initial policy with the model RL will train (no second load), on every rank
        cache = initial_eval_cache(init_path, cfg.model, cfg.sft.cache_dir, cfg.eval, cfg.data, cfg.seed, cfg.rollout.engine)
        baseline = distributed.broadcast_object(
            json.loads(cache.read_text(encoding="utf-8")) if d.is_main and cache is not None and cache.exists() else None, d)
        if baseline is None:
            status("evaluating the initial policy")
            with s.peaks.phase("evaluation"):
                baseline = evaluate(eval_engine(s, cfg.rollout, cfg.eval), s.tokenizer, task, cfg.eval, cfg.seed, d=s.dist)
            if cache is not None and d.is_main:
                cache.write_text(json.dumps(baseline), encoding="utf-8")
        if d.is_main:
            print(f"[eval] initial policy: {format_eval(baseline)}")

    preemption = Preemption().install()  # SIGTERM / SIGUSR1: the loop saves its last step and stops
    try:
        if cfg.rollout.async_steps:
            status("starting its rollout workers")
            start_workers(s, RolloutWorkers(cfg, s.init_path, s.cursor, d, max_model_len, pending=s.pending,
                                            end_ids=s.end_ids, store=line_store, stop=preemption.reason),
                          cfg.rollout, cfg.model.dtype)
        s = run_rl(s, cfg, run_dir, tracker, preemption)
    finally:
        if s.workers is not None:
            s.workers.close()
            s.workers = None
        preemption.restore()
    with s.peaks.phase("evaluation"):
        final = evaluate(eval_engine(s, cfg.rollout, cfg.eval), s.tokenizer, task, cfg.eval, cfg.seed, out_dir=run_dir / "eval",
                         progress=cfg.logger.progress, d=s.dist)
    s.engine.close()
    if not d.is_main:
        return {"steps": s.step, "init_path": init_path}
    tracker.log(final, step=s.step)
    tracker.finish()
    results = {"initial": baseline, "final": final, "steps": s.step, "init_path": init_path}
    peaks = s.peaks.gib()  # CUDA's allocated and reserved peaks per phase and of the whole run (make gpu-check reads them)
    if peaks:
        results["cuda_peaks_gib"] = peaks
        results["cuda_max_reserved_gib"], results["cuda_max_allocated_gib"] = peaks["run"]["reserved"], peaks["run"]["allocated"]
    (run_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(f"[eval] final policy:   {format_eval(final)}")
    print(f"[done] outputs in {run_dir}")
    return results
