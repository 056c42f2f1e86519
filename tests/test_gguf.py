"""``model.path=gguf:<package>/<file>``: a GGUF file inside an installed package, converted once to a cached HF dir
(``bicc/model/gguf.py``). A stand-in package and converter here; the real SmolLM2 wheel in tests/test_smollm2.py (slow)."""

import json
import sys
import threading
import time

import pytest

from bicc.model.gguf import resolve_model_path


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An importable package ``fake_gguf_pkg`` holding ``m.gguf``."""
    root = tmp_path / "site"
    (root / "fake_gguf_pkg").mkdir(parents=True)
    (root / "fake_gguf_pkg" / "__init__.py").write_text("")
    (root / "fake_gguf_pkg" / "m.gguf").write_bytes(b"GGUF weights v1")
    monkeypatch.syspath_prepend(str(root))
    yield root / "fake_gguf_pkg"
    sys.modules.pop("fake_gguf_pkg", None)


def writer(calls):
    def convert(source, out):
        calls.append(source.name)
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"from": source.read_text()}))
    return convert


def test_converted_once_then_read_from_the_cache(package, tmp_path):
    calls = []
    first = resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(tmp_path / "cache"), writer(calls))
    again = resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(tmp_path / "cache"), writer(calls))
    assert first == again and calls == ["m.gguf"]
    assert json.loads((tmp_path / "cache" / first.split("/")[-1] / "config.json").read_text()) == {"from": "GGUF weights v1"}
    (package / "m.gguf").write_bytes(b"GGUF weights v2")  # another file: another dir, converted again
    assert resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(tmp_path / "cache"), writer(calls)) != first
    assert calls == ["m.gguf", "m.gguf"]
    assert resolve_model_path("org/model", str(tmp_path / "cache")) == "org/model"  # not a gguf: spec
    assert resolve_model_path(None, str(tmp_path / "cache")) is None


def test_a_failed_conversion_leaves_nothing_and_the_next_one_works(package, tmp_path):
    def broken(source, out):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half")
        raise ValueError("corrupt GGUF tensor")

    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="corrupt GGUF tensor"):
        resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(cache), broken)
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # no model dir, no half-written one
    calls = []
    path = resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(cache), writer(calls))
    assert calls == ["m.gguf"] and (cache / path.split("/")[-1] / "config.json").exists()


def test_concurrent_callers_convert_once(package, tmp_path):
    calls, results = [], []

    def slow(source, out):
        time.sleep(0.3)
        writer(calls)(source, out)

    threads = [threading.Thread(target=lambda: results.append(
        resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(tmp_path / "cache"), slow))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["m.gguf"] and len(set(results)) == 1 and len(results) == 3


def test_errors_name_the_field_and_the_fix(package, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(ModuleNotFoundError, match="'no_such_pkg_bicc' is not installed; make setup-smollm2"):
        resolve_model_path("gguf:no_such_pkg_bicc/m.gguf", cache)
    with pytest.raises(FileNotFoundError, match="no file other.gguf in .*fake_gguf_pkg"):
        resolve_model_path("gguf:fake_gguf_pkg/other.gguf", cache)
    with pytest.raises(ValueError, match="config field 'model.path': 'gguf:fake_gguf_pkg' is not gguf:<package>/<file>"):
        resolve_model_path("gguf:fake_gguf_pkg", cache)


def test_the_initial_score_is_cached_in_the_converted_dir_keyed_by_task_and_seed(package, tmp_path):
    from omegaconf import OmegaConf

    from bicc.trainer.loop import initial_eval_cache

    cache = tmp_path / "cache"
    converted = resolve_model_path("gguf:fake_gguf_pkg/m.gguf", str(cache), writer([]))
    cfg = OmegaConf.create({"model": {"tiny": None, "dtype": "float32"}, "sft": {"cache_dir": str(cache)}, "seed": 0,
                            "eval": {"num_problems": 200}, "data": {"arith": {"instruction": ""}},
                            "rollout": {"engine": "vllm"}})
    def cached(c, init=converted):
        return initial_eval_cache(init, c.model, c.sft.cache_dir, c.eval, c.data, c.seed, c.rollout.engine)

    first = cached(cfg)
    assert first.parent == cache / converted.split("/")[-1] and first.name.startswith("eval-")
    assert cached(cfg) == first
    keys = {first}
    for field, value in (("seed", 1), ("data.arith.instruction", "Answer."), ("eval.num_problems", 50),
                         ("rollout.engine", "hf"), ("model.dtype", "bfloat16")):
        changed = cfg.copy()
        OmegaConf.update(changed, field, value)
        keys.add(cached(changed))
    assert len(keys) == 6  # each of them scores differently, so each has its own file
    elsewhere = tmp_path / "my_model"  # an HF dir the user may change: never cached
    elsewhere.mkdir()
    assert cached(cfg, str(elsewhere)) is None
