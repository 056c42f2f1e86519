"""What a user runs, its resolved values recorded: ``tests/data/presets.json`` holds the default config and, for each
experiment and each of the paper's command lines, its differences from it (a group option alone is held by its own
tests: tests/test_method_keys.py, tests/test_algorithms.py, tests/test_config.py). ``tests/test_layout.py`` holds
today's config to the record, so a default that changes by accident fails, naming the keys.

A change you mean: ``.venv/bin/python -m tests.presets`` rewrites the record; commit its diff with the change, where
a reviewer reads each value that moved. A new option (a variant's YAML) is not compared until it is recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from tests.conftest import CONF, ROOT, compose_cfg

RECORD = Path(__file__).parent / "data" / "presets.json"
OVERRIDES_ALWAYS = ["sft.cache_dir=/cache"]
# What the YAML reads from the environment (CI sets WANDB_MODE=disabled): the record is made without them.
ENVIRONMENT = ("WANDB_MODE", "BICC_CACHE", "BICC_DATA_DIR", "BICC_DAPO_MATH")
# The paper's command lines, over the settings the README names.
COMMANDS = [f"{base}algo={a} bicc={b} rcc={r}".strip() for base in ("", "experiment=paper_qwen3_4b ",
            "experiment=smollm2_arith ") for a in ("grpo", "dapo") for b in ("off", "on", "stable")
            for r in ("off", "on", "mean")]


def flat(node, prefix=""):
    """``{"a.b": value}`` for every leaf; this checkout's root reads ``<repo>``."""
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.loads(json.dumps(node).replace(json.dumps(str(ROOT))[1:-1], "<repo>"))}


def resolved(preset: str) -> dict:
    """The flat resolved config of ``preset`` (overrides separated by spaces), the environment's keys unset."""
    saved = {name: os.environ.pop(name) for name in ENVIRONMENT if name in os.environ}
    try:
        return flat(OmegaConf.to_container(compose_cfg([*OVERRIDES_ALWAYS, *preset.split()]), resolve=True))
    finally:
        os.environ.update(saved)


def presets() -> list[str]:
    """Every experiment in conf/experiment, and the paper's command lines."""
    return sorted({f"experiment={path.stem}" for path in (CONF / "experiment").glob("*.yaml")} | set(COMMANDS))


def record() -> dict:
    base = resolved("")
    out = {}
    for preset in presets():
        now = resolved(preset)
        out[preset] = {"differs": {k: v for k, v in now.items() if base.get(k, object()) != v},
                       "absent": sorted(set(base) - set(now))}
    return {"base": base, "presets": out}


if __name__ == "__main__":
    RECORD.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {RECORD.relative_to(ROOT)}: the default and {len(presets())} presets")
