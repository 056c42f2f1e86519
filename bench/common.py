"""What the benches share: the composed config, the shapes and peaks they measure against, the labelled
completions' lengths, and a ``train.py`` run launched into a dir of its own. Benches import this and ``bicc``,
never each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bicc.machine.memory import GIB  # noqa: F401 (re-exported: every bench's unit)

ROOT = Path(__file__).resolve().parents[1]
# Output lengths of real reasoning completions (beside a checkout only; never needed to train).
LABELLED = ROOT.parent / "shared" / "data" / "labelled_completions.jsonl"
# Dense bf16 peak TFLOP/s by device name (the SXM parts; a PCIe card is slower: --peak-tflops).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=40_960)


def compose_cfg(overrides: list[str]):
    """``train.py``'s config with these overrides, validated, its warm starts cached where ``train.py`` caches them
    (``BICC_CACHE``, else the checkout's ``.cache/bicc``)."""
    from hydra import compose, initialize_config_dir  # here: gpu_check reads this module's constants before a venv

    from bicc.config import register_configs
    from bicc.trainer.validation import validate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cache = os.environ.get("BICC_CACHE", str(ROOT / ".cache" / "bicc"))
        cfg = compose(config_name="train", overrides=[f"sft.cache_dir={cache}", *overrides])
    validate(cfg)
    return cfg


def drawn_lengths(max_tokens: int, tokenizer):
    """Token lengths of the labelled completions under ``tokenizer``, scaled so that the 99th percentile is
    ``max_tokens`` (the longest is 5 x that percentile: scaling by it would squeeze the rest to a few
    tokens); the 1% above are truncated there, as a run truncates them. A long tensor, one length a completion."""
    import torch

    texts = [json.loads(line)["completion"] for line in LABELLED.read_text(encoding="utf-8").splitlines() if line.strip()]
    lengths = torch.tensor([len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts], dtype=torch.float)
    return (lengths * max_tokens / lengths.quantile(0.99)).round().clamp(2, max_tokens).long()


def run_dir_of(out_root: Path, name: str, seed: int) -> Path:
    # no "=" in the dir name: Hydra reads it in paths
    return out_root / name.replace(" (", "_").replace(")", "").replace(" ", "-").replace("=", "") / f"s{seed}"


TRAINING_CODE = ("bicc", "conf", "train.py")  # what a run's numbers depend on (benches and docs do not)


def code_commit() -> str:
    """The checkout's commit, with "+changes" when the training code differs from it (such a run is no commit's)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", *TRAINING_CODE).stdout.strip()
    return head + ("+changes" if dirty else "")


def run_one(name: str, overrides: list[str], seed: int, steps: int, threads: int, out_root: Path, extra: list[str]) -> Path:
    """One ``train.py`` run (kept: a run dir with ``results.json`` is not run again), the diagnostics every 10 steps."""
    run_dir = run_dir_of(out_root, name, seed)
    if (run_dir / "results.json").exists():
        return run_dir
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"seed={seed}", "sft.seed=0",
           f"train.steps={steps}", f"threads={threads}", "logger.wandb_mode=disabled", "logger.progress=false",
           "diag.every=10",  # the gradient-variance comparison needs the diagnostics on every row
           f"hydra.run.dir={run_dir}", *extra]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "commit.txt").write_text(code_commit() + "\n", encoding="utf-8")  # what the run's numbers come from
    t0 = time.perf_counter()
    with open(run_dir / "stdout.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}); see {run_dir / 'stdout.log'}")
    seconds = time.perf_counter() - t0
    (run_dir / "wall_s.txt").write_text(f"{seconds:.0f}\n", encoding="utf-8")  # what a later summary quotes
    print(f"[results] {name} s{seed}: {seconds:.0f}s", flush=True)
    return run_dir


# ---- reading a finished train.py run dir -------------------------------------------------------------
def per_problem(run_dir: Path) -> dict[str, float]:
    """The final evaluation's accuracy per problem at the headline sampling (``eval/<benchmark>/per_problem.jsonl``)."""
    files = sorted((run_dir / "eval").glob("*/per_problem.jsonl"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir / 'eval'}: expected one benchmark's per_problem.jsonl, found {len(files)}")
    rows = [json.loads(line) for line in files[0].read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["id"]: r["accuracy"] for r in rows}


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text(encoding="utf-8"))


def processes_marked(mark: str) -> list[int]:
    """Live processes (zombies aside) whose environment holds ``BICC_RUN_MARK=<mark>``: every process a run started
    inherits it from the one that was started with it (the soak's and the tests' way to find what a kill left)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"BICC_RUN_MARK={mark}".encode() in (entry / "environ").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
