"""Train a policy with a GRPO-family algorithm: ``python train.py algo=grpo bicc=on rcc=on``.

Stages: SFT warm start (tiny models; cached) -> RL -> final evaluation (``bicc.loop.run``); each RL step is
``bicc.step.rl_step``, the paper's Algorithm 1.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from transformers.utils import logging as hf_logging

from bicc import distributed
from bicc.config import register_configs
from bicc.host import console_never_fails
from bicc.loop import run
from bicc.validation import validate

register_configs()
hf_logging.disable_progress_bar()
console_never_fails()


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> dict:
    validate(cfg)
    d = distributed.init(cfg.dist)
    try:
        runtime = HydraConfig.get().runtime
        return run(cfg, d, Path(runtime.output_dir), dict(runtime.choices))
    finally:
        distributed.shutdown(d)


if __name__ == "__main__":
    main()
