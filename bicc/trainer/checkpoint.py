"""Checkpoints: the model and tokenizer in HF format (safetensors; loadable by transformers and vLLM)
plus the trainer state (optimizer, scheduler, step, data position, RNG) as tensors and plain values
loaded with ``weights_only=True``; ``resume_dir`` picks the one a run resumes from.

A checkpoint is written into ``<dir>.tmp`` and renamed into place, so a crash mid-write leaves the
previous checkpoint intact; a directory counts as complete only when it has ``COMPLETE``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

TRAINER_STATE = "trainer_state.pt"
COMPLETE = "COMPLETE"


def rng_state() -> dict:
    return {
        "torch": torch.random.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": json.dumps(random.getstate()),
        "numpy": json.dumps(np.random.get_state(legacy=True)[1].tolist()),
    }


def set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", np.array(json.loads(state["numpy"]), dtype=np.uint32), 0, 0, 0.0))


def save_hf(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def tmp_dir(ckpt_dir: Path) -> Path:
    return ckpt_dir.with_name(ckpt_dir.name + ".tmp")


def save_checkpoint(ckpt_dir: Path, model, tokenizer, trainer_state: dict, keep_last: int,
                    state_dict: dict | None = None, keep_tmp: bool = False) -> Path:
    """Write ``ckpt_dir`` atomically and prune older ``step_*`` siblings beyond ``keep_last``.
    ``state_dict``: the weights to write (a sharded model's gathered full state dict); ``keep_tmp``: the
    ``.tmp`` dir already holds parts written by every rank (a sharded optimizer), keep them."""
    tmp = tmp_dir(ckpt_dir)
    try:
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        save_hf(model, tokenizer, tmp, state_dict)
        torch.save({**trainer_state, "rng": rng_state()}, tmp / TRAINER_STATE)
        (tmp / COMPLETE).write_text("ok\n", encoding="utf-8")
    except Exception as err:  # a full disk, a quota, a permission, a write that fails midway: nothing is renamed
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(ckpt_dir, err) from err
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.replace(tmp, ckpt_dir)
    if keep_last > 0:
        for old in list_checkpoints(ckpt_dir.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return ckpt_dir


def list_checkpoints(root: Path) -> list[Path]:
    """Complete ``step_N`` dirs under ``root``, oldest first."""
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / COMPLETE).exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


class CorruptCheckpoint(RuntimeError):
    pass


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written: it names the path, the cause and the checkpoint that stays the resume
    point (its partial ``.tmp`` dir is removed, nothing is renamed into place)."""

    def __init__(self, ckpt_dir: Path, cause: Exception):
        previous = list_checkpoints(ckpt_dir.parent)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        super().__init__(f"checkpoint {ckpt_dir} could not be written ({type(cause).__name__}: {cause}); nothing was "
                         f"renamed into place and {kept}: free the space or fix the permissions, then resume=auto "
                         "continues from it")


def incomplete_checkpoints(root: Path) -> list[Path]:
    """``step_N`` dirs (and ``.tmp`` leftovers of an interrupted write) that are not complete."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p.name.endswith(".tmp") or not (p / COMPLETE).exists()))


def verify_checkpoint(ckpt_dir: Path) -> None:
    """Raise ``CorruptCheckpoint`` naming ``ckpt_dir`` unless its marker, weights and trainer state all
    read back: the safetensors headers parse and every tensor loads; the trainer state loads with
    ``weights_only=True``."""
    from safetensors import safe_open

    if not (ckpt_dir / COMPLETE).exists():
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir} is incomplete (no {COMPLETE} marker: its write was interrupted)")
    weights = sorted(ckpt_dir.glob("*.safetensors"))
    if not weights:
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir} has no *.safetensors weights")
    try:
        for file in weights:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
    except Exception as err:  # safetensors raises several types for truncated or garbled files
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: weights {file.name} unreadable ({err})") from None
    load_trainer_state(ckpt_dir)


def load_trainer_state(ckpt_dir: Path) -> dict:
    path = ckpt_dir / TRAINER_STATE
    if not (ckpt_dir / COMPLETE).exists() or not path.exists():
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir} is incomplete (no {COMPLETE} marker or {TRAINER_STATE})")
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:
        raise CorruptCheckpoint(f"checkpoint {ckpt_dir}: {TRAINER_STATE} unreadable ({err})") from None


def resume_dir(resume: str, run_dir: Path) -> Path | None:
    """``auto``: the latest checkpoint of this run dir that reads back completely, skipping (with a
    warning) incomplete or corrupt ones; a run dir: its latest, which must be sound; else the dir itself."""
    root = run_dir if resume == "auto" else Path(resume)
    for bad in incomplete_checkpoints(root / "checkpoints"):
        print(f"[rl] warning: skipping incomplete checkpoint {bad} (interrupted write)")
    found = list_checkpoints(root / "checkpoints")
    if resume != "auto":
        ckpt = found[-1] if found else root
        verify_checkpoint(ckpt)  # an explicitly named checkpoint must be sound: the error names it
        return ckpt
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CorruptCheckpoint as err:
            print(f"[rl] warning: skipping {err}")
    return None
