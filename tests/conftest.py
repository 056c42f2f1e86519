import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bicc.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_DATA = Path(os.environ.get("BICC_DATA_DIR", ROOT.parent / "shared" / "data"))

register_configs()


def compose_cfg(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


@pytest.fixture
def cfg():
    return compose_cfg(["sft.cache_dir=/tmp/unused"])


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data dir {SHARED_DATA} is absent (set BICC_DATA_DIR)")
    return SHARED_DATA


# What a test run may leave in the checkout: interpreter and pytest caches. Anything else a test writes belongs
# under its tmp_path.
CACHES = {".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}


def repo_files() -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in CACHES]
        found.update(os.path.relpath(os.path.join(dirpath, name), ROOT) for name in [*filenames, *dirnames])
    return found


@pytest.fixture(scope="session", autouse=True)
def tests_write_only_under_tmp():
    before = repo_files()
    yield
    added = sorted(repo_files() - before)
    assert not added, f"tests wrote into the checkout (use tmp_path): {added[:10]}"


def pytest_configure(config):
    """Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``) each worker runs on its own share of the cores,
    and so does every process its tests start: torch sizes its threads from the cores it may use, and two workers'
    threads spinning on the same cores ran the suite slower than one worker did."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers and hasattr(os, "sched_setaffinity"):
        import torch

        from tests.helpers import worker_cores  # helpers imports this module

        mine = worker_cores(sorted(os.sched_getaffinity(0)), worker, int(workers))
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
