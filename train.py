"""Train a policy with a GRPO-family algorithm: ``python train.py algo=grpo bicc=on rcc=on``.

Stages: SFT warm start (tiny models; cached) -> RL -> final evaluation (``bicc.trainer.loop.run``); each RL step is
``bicc.trainer.step.rl_step``, the paper's Algorithm 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bicc.machine.host import console_never_fails, cuda_allocator_default

cuda_allocator_default()  # before torch is imported: it reads the CUDA allocator's settings once

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from bicc.config import register_configs  # noqa: E402
from bicc.trainer.validation import validate  # noqa: E402

register_configs()  # torch and the run's modules are imported in main: an unknown config choice fails at once
console_never_fails()


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> dict:
    validate(cfg)
    import torch

    from bicc.machine.host import check_torch_build

    check_torch_build(cfg.device, torch.version.cuda, torch.__version__)  # a CPU torch on a GPU machine stops here
    from transformers.utils import logging as hf_logging

    from bicc.machine import distributed
    from bicc.machine.preemption import REQUEUE_EXIT, Preempted
    from bicc.trainer.loop import run

    hf_logging.disable_progress_bar()
    d = distributed.init(cfg.dist)
    try:
        runtime = HydraConfig.get().runtime
        return run(cfg, d, Path(runtime.output_dir), dict(runtime.choices))
    except Preempted as stop:  # SIGTERM / SIGUSR1: the last step is saved (bicc.machine.preemption)
        if d.is_main:
            print(stop, flush=True)
    finally:
        distributed.shutdown(d)
    sys.exit(REQUEUE_EXIT)


if __name__ == "__main__":
    main()
