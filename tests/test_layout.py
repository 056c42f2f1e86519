"""The house's layout: one folder per concern, imports running down ``bicc.LAYERS`` only, short modules, and every
preset's values as recorded."""

import ast
import json
from pathlib import Path

import pytest

from bicc import LAYERS
from tests.conftest import ROOT
from tests.presets import RECORD, resolved

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


def test_the_readmes_layout_lists_the_folders_in_the_order_imports_run():
    """README's layout table names bicc/'s folders top to bottom in the order imports may run (``bicc.LAYERS`` read
    from its end), so its sentence "imports run down that list" is true."""
    import re

    table = (ROOT / "README.md").read_text(encoding="utf-8").split("## Layout", 1)[1].split("\n\n", 2)[1]
    listed = [name for row in table.splitlines() for name in re.findall(r"`bicc/(\w+)/`", row)]
    folders = [name for name in reversed(LAYERS) if (BICC / name).is_dir()]
    assert sorted(listed) == sorted(folders), listed
    assert sorted(listed, key=lambda name: -LAYERS.index(name)) == listed, listed  # nothing listed below what it imports


def test_every_module_lives_in_a_concern_folder_that_says_what_belongs_there():
    top = sorted(p.name for p in BICC.glob("*.py"))
    assert len(top) <= 3, top
    folders = sorted(p.name for p in BICC.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert sorted(folders + [p[:-3] for p in top if p != "__init__.py"]) == sorted(LAYERS)
    for name in folders:
        doc = ast.get_docstring(ast.parse((BICC / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc) > 40, f"bicc/{name}/__init__.py: a docstring saying what belongs there"


def test_each_folders_docstring_names_every_module_in_it():
    """bicc/<folder>/__init__.py says what each of its modules holds, so a module added there is named there too (as
    ``name`` or in a parenthesised list: (name, other)); the losses' folder, whose modules are found on disk (a variant
    is its own module), says so instead."""
    import re

    unnamed = []
    for init in sorted(BICC.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if init.parent == BICC or "Every module of this folder is imported here" in doc:
            continue
        unnamed += [str(p.relative_to(ROOT)) for p in sorted(init.parent.glob("*.py"))
                    if p.stem != "__init__" and not re.search(rf"(?:[(`]|, ){p.stem}(?:\.py)?[),`]", " ".join(doc.split()))]
    assert not unnamed, f"modules their folder's docstring does not name: {unnamed}"


def test_no_module_is_over_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 350}
    assert not long, long


# Every preset's resolved values as recorded by ``python -m tests.presets`` (the default config, and each preset's
# differences from it). A change meant: rerun it and commit the record's diff.
RECORDED = json.loads(RECORD.read_text(encoding="utf-8"))


@pytest.mark.parametrize("preset", ["", *RECORDED["presets"]])
def test_every_preset_resolves_as_recorded(preset):
    entry = RECORDED["presets"].get(preset, {})
    before = {k: v for k, v in RECORDED["base"].items() if k not in entry.get("absent", [])} | entry.get("differs", {})
    now = resolved(preset)
    changed = {k: (before.get(k, "<absent>"), now.get(k, "<absent>")) for k in set(before) | set(now)
               if before.get(k, "<absent>") != now.get(k, "<absent>")}
    assert not changed, (f"{preset or 'the default'}: {changed} (recorded, now); if you meant it, rerun "
                         "`.venv/bin/python -m tests.presets` and commit the record's diff")
