"""Docs that cannot rot: every ``python -m`` module, ``bench/`` path, config key (``group.key=`` on a command line),
relative link and image, and every section title a YAML comment quotes, named in README.md, docs/*.md (dated
history aside) and conf/'s comments, resolves in this checkout."""

import importlib.util
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF, ROOT, compose_cfg

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def conf_comments() -> dict[Path, str]:
    """Each conf/ YAML's comments, joined into one text (a quoted title may run over two comment lines)."""
    out = {}
    for path in sorted(CONF.rglob("*.yaml")):
        lines = [line.split("#", 1)[1].strip() for line in path.read_text(encoding="utf-8").splitlines() if "#" in line]
        out[path] = " ".join(lines)
    return out


def texts() -> dict[Path, str]:
    return {**{p: p.read_text(encoding="utf-8") for p in DOCS}, **conf_comments()}


def where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def at_named_commit(text: str, start: int, path: str) -> bool:
    """A finished study's file, gone from the tree: the text names, just before it (or on its line), a commit that
    holds ``path``."""
    for commit in re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text[max(0, start - 400):start + 80]):
        if subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True).returncode == 0:
            return True
    return False


def test_every_python_m_module_exists():
    """... or, for a finished bench, at the commit the text names."""
    missing = []
    for p, text in texts().items():
        for match in re.finditer(r"python3? -m ([A-Za-z_][\w.]*\w)", text):
            module = match.group(1)
            if importlib.util.find_spec(module) is None and not (
                    module.startswith("bench.") and at_named_commit(text, match.start(), module.replace(".", "/") + ".py")):
                missing.append(f"{where(p)}: python -m {module}")
    assert not missing, missing


def test_every_bench_path_exists():
    """... or at the commit the text names (``git show <commit>:bench/x.py``)."""
    missing = [f"{where(p)}: {m.group(0)}" for p, text in texts().items()
               for m in re.finditer(r"(?<![\w/:])bench/[\w/.-]*\w", text)
               if not (ROOT / m.group(0)).exists() and not at_named_commit(text, m.start(), m.group(0))]
    assert not missing, missing


def links(text: str) -> list[str]:
    """Targets of markdown links and images, and of HTML ``src``/``href`` attributes, that are paths in this tree."""
    found = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"(?:src|href)=\"([^\"]+)\"", text)
    return [t.split("#")[0] for t in found if not re.match(r"[a-z]+:|#", t) and t.split("#")[0]]


def test_every_relative_link_and_image_resolves():
    missing = [f"{where(p)}: {t}" for p in DOCS for t in links(p.read_text(encoding="utf-8"))
               if not (p.parent / t).exists()]
    assert not missing, missing


def headings(doc: Path) -> list[str]:
    """A page's section titles, and the bold leads of its paragraphs (``**Title.** ...``), lower case, without code
    marks."""
    text = doc.read_text(encoding="utf-8")
    found = [line.lstrip("#") for line in text.splitlines() if line.startswith("#")]
    found += re.findall(r"^\*\*([^*]+)\*\*", text, re.M)
    return [t.replace("`", "").strip().lower() for t in found]


def test_every_section_a_comment_quotes_exists():
    """``docs/x.md, "Title"`` (or ``docs/x.md: "Title``, ``docs/x.md ("Title")``) in a YAML comment names a heading
    of that page that starts with the quoted words."""
    missing = []
    for path, text in conf_comments().items():
        for doc, title in re.findall(r"(docs/[\w/.-]+\.md)[,:]?\s*\(?\"([^\"]+)\"", text):
            if not any(h.startswith(title.lower().rstrip(".")) for h in headings(ROOT / doc)):
                missing.append(f"{where(path)}: {doc} \"{title}\"")
    assert not missing, missing


@lru_cache(maxsize=None)
def config(overrides: tuple[str, ...] = ()) -> dict:
    return OmegaConf.to_container(compose_cfg(["sft.cache_dir=/tmp/x", *overrides]), resolve=False)


def has(node, key: str) -> bool:
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return True


def resolves(key: str) -> bool:
    """A key of the default config, or of some option of its group (``data.math.*`` under ``data=jsonl``)."""
    if has(config(), key):
        return True
    group = CONF / key.split(".")[0]
    return group.is_dir() and any(has(config((f"{group.name}={o.stem}",)), key) for o in group.glob("*.yaml"))


# what a command line sets that is not a key of the config: Hydra's own, and launchers' and tools' settings
NOT_CONFIG = ("hydra.", "hydra/", "ckpt", "experiment", "seed",
              # verl's keys, beside ours in docs/config.md
              "a.", "algorithm.", "actor_rollout_ref.", "trainer.", "data.train_files", "data.val_files",
              "data.train_batch_size", "data.max_response_length")


def test_every_config_key_on_a_command_line_exists():
    missing = []
    for p, text in texts().items():
        for key in sorted(set(re.findall(r"(?<![\w./-])\+?([a-z_]+(?:\.[a-z_0-9]+)+)=", text))):
            if not key.startswith(NOT_CONFIG) and not resolves(key):
                missing.append(f"{where(p)}: {key}=")
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=where)
def test_no_doc_names_a_group_option_that_is_gone(doc):
    """``algo=x``, ``rollout=x``, ``experiment=x`` ...: x is a YAML of that group."""
    groups = {g.name for g in CONF.iterdir() if g.is_dir()}
    missing = [f"{g}={o}" for g, o in re.findall(r"(?<![\w.])([a-z_]+)=([a-z_0-9]+)\b", doc.read_text(encoding="utf-8"))
               if g in groups and not (CONF / g / f"{o}.yaml").exists()]
    assert not missing, missing


def test_every_config_key_a_doc_names_exists():
    """A key written in code marks (`rollout.max_new_tokens`), its first part a group of the config, resolves; a
    module (`bicc.trainer.probe`) or a metric is not a key."""
    top = set(config())
    missing = []
    for p, text in texts().items():
        for key in sorted(set(re.findall(r"`\+?([a-z_]+(?:\.[a-z_0-9]+)+)(?:[=:`\s])", text))):
            if (key.split(".")[0] in top and not key.endswith(".py") and not key.startswith(NOT_CONFIG) and not resolves(key)
                    and importlib.util.find_spec(key.rsplit(".", 1)[0] if key.startswith("bicc.") else "-") is None):
                missing.append(f"{where(p)}: {key}")
    assert not missing, missing
