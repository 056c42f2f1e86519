"""Where an RL step's time goes at the default config.

Times model forward passes outside generation, backward passes and rollout generation, and reports
the rest of the step (tokenising, rewards, batching, advantages, optimizer, logging glue) as loop
overhead. Run: ``.venv/bin/python bench/step_profile.py [hydra overrides...]``
Ends with ``RESULT loop_overhead_share=<share> target<=0.10``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from bicc.config import register_configs, validate  # noqa: E402
from bicc.data import build_task  # noqa: E402
from bicc.sft import warm_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Timers:
    def __init__(self):
        self.generate = self.forward = self.backward = 0.0
        self.in_generate = False
        self._forward_start = 0.0


def instrument(state, timers: Timers) -> None:
    """Wrap the engine's generate, the policy's forward (outside generate) and Tensor.backward."""
    generate = state.engine.generate

    def timed_generate(*args, **kwargs):
        timers.in_generate = True
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            timers.generate += time.perf_counter() - start
            timers.in_generate = False

    state.engine.generate = timed_generate

    def pre_hook(module, args, kwargs):
        timers._forward_start = time.perf_counter()

    def post_hook(module, args, kwargs, output):
        if not timers.in_generate:
            timers.forward += time.perf_counter() - timers._forward_start

    state.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    state.model.register_forward_hook(post_hook, with_kwargs=True)

    backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return backward(self, *args, **kwargs)
        finally:
            timers.backward += time.perf_counter() - start

    torch.Tensor.backward = timed_backward


def main(overrides: list[str], warmup: int = 3, steps: int = 20) -> None:
    import train  # the entry point's step function, as the real run uses it

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"sft.cache_dir={ROOT / '.cache' / 'bicc'}", *overrides])
    validate(cfg)
    torch.set_num_threads(cfg.threads or os.cpu_count())
    device = torch.device("cpu")
    init_path = str(warm_start(cfg, build_task(cfg.data), device, progress=True))
    state = train.build_rl_state(cfg, init_path, init_path, device)
    for _ in range(warmup):
        train.rl_step(state, cfg)
    timers = Timers()
    instrument(state, timers)
    step_times, gen_times = [], []
    start = time.perf_counter()
    for _ in range(steps):
        t0, g0 = time.perf_counter(), timers.generate
        train.rl_step(state, cfg)
        step_times.append(time.perf_counter() - t0)
        gen_times.append(timers.generate - g0)
    total = time.perf_counter() - start
    inside = timers.generate + timers.forward + timers.backward
    share = 1 - inside / total
    print(f"steps {steps}, total {total:.1f}s, median step {statistics.median(step_times):.2f}s, "
          f"max step {max(step_times):.2f}s")
    print(f"generate {timers.generate:.1f}s ({timers.generate / total:.0%}; median call {statistics.median(gen_times):.2f}s, "
          f"max {max(gen_times):.2f}s), forward {timers.forward:.1f}s ({timers.forward / total:.0%}), "
          f"backward {timers.backward:.1f}s ({timers.backward / total:.0%})")
    print(f"RESULT loop_overhead_share={share:.3f} target<=0.10")


if __name__ == "__main__":
    main(sys.argv[1:])
