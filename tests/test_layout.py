"""The house's layout: one folder per concern, imports running down ``bicc.LAYERS`` only, short modules, and the
move into this layout changed no preset's values."""

import ast
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bicc import LAYERS
from bicc.config import diag_every, tis_cap
from tests.conftest import ROOT, compose_cfg

BICC = ROOT / "bicc"


def modules() -> list[Path]:
    return sorted(p for p in BICC.rglob("*.py") if "__pycache__" not in p.parts)


def concern(path: Path) -> str:
    """The layer a module belongs to: its folder under bicc/, or its own name for a top-level module."""
    parts = path.relative_to(BICC).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported(path: Path) -> list[tuple[int, str]]:
    """Every ``bicc`` module a file imports, at module level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bicc":
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "bicc" else [node.module]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "bicc"]
    return found


def test_imports_run_down_the_layers_only():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in modules():
        here = concern(path)
        if here == "__init__":
            continue
        for line, name in imported(path):
            target = name.split(".")[1]
            if rank.get(target, -1) > rank[here]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {name} ({target})")
    assert not upward, "imports that run up the layers of bicc/__init__.py:\n" + "\n".join(upward)


def test_every_module_lives_in_a_concern_folder_that_says_what_belongs_there():
    top = sorted(p.name for p in BICC.glob("*.py"))
    assert len(top) <= 3, top
    folders = sorted(p.name for p in BICC.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert sorted(folders + [p[:-3] for p in top if p != "__init__.py"]) == sorted(LAYERS)
    for name in folders:
        doc = ast.get_docstring(ast.parse((BICC / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc) > 40, f"bicc/{name}/__init__.py: a docstring saying what belongs there"


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 350}
    assert not long, long


# Keys that left the method's groups when the layout changed, and where their values went.
MOVED = {
    "bicc.packing": lambda cfg: cfg.train.context_packing,
    "bicc.packing_impl": lambda cfg: cfg.train.context_packing_impl,
    "bicc.max_packed_len": lambda cfg: cfg.train.max_packed_len,
    "rcc.delta_from_update": lambda cfg: cfg.train.delta_from_update,
    "rcc.diag_every": diag_every,
    "rcc.diag_splits": lambda cfg: cfg.diag.splits,
    "rcc.stage_steps": lambda cfg: cfg.diag.stage_steps,
}
NEW = {"train.context_packing", "train.context_packing_impl", "train.max_packed_len", "train.delta_from_update",
       "diag.every", "diag.splits", "diag.stage_steps",
       # added since: rollout workers, evaluation during training, kept samples, datasets by subset/split/revision
       "rollout.async_steps", "rollout.devices", "train.eval_every", "logger.samples_every", "logger.samples_rows",
       "logger.samples_max_chars", "data.math.subset", "data.math.revision", "data.math.train_split",
       "data.math.test_split", "data.math.test_subset", "data.rewards", "data.reward_weights", "data.reward_errors",
       "data.max_prompt_length", "data.prompt_overflow",
       # RCC's diagnostic form over the group std (rcc=std)
       "rcc.scale",
       # rollout workers at scale: several CPU workers, workers on other nodes, a shared GPU, the push's buckets
       "rollout.cpu_workers", "rollout.remote_workers", "rollout.worker_port", "rollout.share_gpus",
       "rollout.push_bucket_mib"}
# Keys whose value a run now reads another way, and how to read it as before: rollout.tis_cap's default became null
# ("chosen by the run"), and each benchmark gained the keys subset and revision (null).
RESOLVED = {"rollout.tis_cap": lambda cfg: tis_cap(cfg.rollout),
            "eval.benchmarks": lambda cfg: [{k: v for k, v in b.items() if k not in ("subset", "revision")}
                                            for b in flat(OmegaConf.to_container(cfg, resolve=True))["eval.benchmarks"]]}
# Every group option, preset and the paper's command lines, resolved at 33c7de3 (before the layout changed): the
# values of the default config, and each preset's differences from it.
SNAPSHOT = json.loads((Path(__file__).parent / "data" / "presets_33c7de3.json").read_text(encoding="utf-8"))


def flat(node, prefix=""):
    """``{"a.b": value}`` for every leaf; this checkout's root reads ``<repo>``, as it does in the snapshot."""
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.loads(json.dumps(node).replace(json.dumps(str(ROOT))[1:-1], "<repo>"))}


# What the YAML reads from the environment (CI sets WANDB_MODE=disabled): the snapshot was taken without them.
ENVIRONMENT = ("WANDB_MODE", "BICC_CACHE", "BICC_DATA_DIR", "BICC_DAPO_MATH")


@pytest.mark.parametrize("preset", ["", *SNAPSHOT["presets"]])
def test_every_preset_resolves_as_before_the_layout_changed(preset, monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    entry = SNAPSHOT["presets"].get(preset, {})
    before = {k: v for k, v in SNAPSHOT["base"].items() if k not in entry.get("absent", [])} | entry.get("differs", {})
    cfg = compose_cfg([*SNAPSHOT["overrides_always"], *preset.split()])
    now = flat(OmegaConf.to_container(cfg, resolve=True))
    assert set(now) == set(before) - set(MOVED) | NEW
    resolve = {**MOVED, **RESOLVED}
    changed = {k: (v, resolve[k](cfg) if k in resolve else now[k]) for k, v in before.items()
               if v != (resolve[k](cfg) if k in resolve else now[k])}
    assert not changed, changed
