"""Who sees the root config: only the entry points and the run loop; the step, its plan, its update and the
rows take typed groups (``bicc.config.StepConfig`` and the groups themselves). And the step's modules name no
rank, no collective, and FSDP's hooks in one place."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST = 10
# the entry points (train.py, eval.py), the run loop around the step, and the views that narrow the root to typed
# groups (bicc.config.GroupsView.of, which StepConfig and WarmStartConfig share)
ENTRY_AND_LOOP = ("bicc/config/__init__.py", "train.py", "eval.py", "bicc/trainer/loop.py", "bicc/trainer/validation.py",
                  "bicc/trainer/state.py", "bicc/trainer/fit.py", "bicc/rollout/workers.py")


def root_groups() -> set[str]:
    tree = ast.parse((ROOT / "bicc/config/__init__.py").read_text())
    schema = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    return {n.target.id for n in schema.body if isinstance(n, ast.AnnAssign)}


def functions_given_the_root(source: str, groups: set[str]) -> list[tuple[str, str]]:
    """(function, parameter) for each function one of whose parameters is the root config: annotated ``RunConfig``,
    or not annotated with a typed group and reading two or more of the root's groups (``x.algo``, ``x.rollout``), or
    named ``cfg`` and reading one. Attributes that are called (``model.train()``) are methods, not groups."""
    tree = ast.parse(source)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            if arg.arg in ("self", "cls") or annotation not in ("", "RunConfig", "DictConfig", "Any"):
                continue
            read = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == arg.arg and n.attr in groups and id(n) not in called}
            if annotation == "RunConfig" or len(read) >= 2 or (arg.arg == "cfg" and read):
                found.append((fn.name, arg.arg))
                break
    return found


def library_files() -> list[Path]:
    return [ROOT / "train.py", ROOT / "eval.py", *sorted((ROOT / "bicc").rglob("*.py"))]


def test_the_counter_sees_the_root_config_and_only_it():
    groups = root_groups()
    assert {"algo", "rollout", "model", "data"} <= groups
    source = ("def a(cfg):\n    return cfg.algo.loss\n"  # cfg reading a group: counted
              "def b(c):\n    return c.model, c.data\n"  # two groups under another name: counted
              "def c(x: RunConfig):\n    pass\n"  # annotated: counted
              "def d(algo: AlgoConfig):\n    return algo.loss\n"  # a typed group: not
              "def e(cfg: StepConfig):\n    return cfg.algo, cfg.rollout\n"  # the step's typed groups: not
              "def f(model):\n    model.train(); model.eval()\n")  # methods named like groups: not
    assert functions_given_the_root(source, groups) == [("a", "cfg"), ("b", "c"), ("c", "x")]


def test_only_the_entry_points_and_the_run_loop_see_the_root_config():
    groups, seen = root_groups(), []
    for path in library_files():
        rel = path.relative_to(ROOT).as_posix()
        seen += [f"{rel}:{fn}({arg})" for fn, arg in functions_given_the_root(path.read_text(), groups)]
    outside = [s for s in seen if not s.startswith(ENTRY_AND_LOOP)]
    assert not outside, f"functions past the run loop given the root config (pass them typed groups): {outside}"
    assert len(seen) <= MOST, f"{len(seen)} functions see the root config (at most {MOST}): {seen}"


RANK_NAMES = {"rank", "world"}  # a name that is exactly one of these, or holds one of these:
RANK_WORDS = ("is_main", "barrier", "all_reduce", "broadcast", "all_gather", "mean_metrics", "merge_shard_positions",
              "torch.distributed")
RANK_CALLS = {"local_shards", "num_shards"}  # a count of prompt shards is data; the rank's shards are the machine's
# where ranks are known: the machine layer (``bicc.machine.ranks.Ranks`` is what the step is handed), the weights'
# transport to the sampler and the rollout workers' processes (behind the engine's and the workers' methods), and
# the state's builder
RANKED = ("bicc/machine/", "bicc/rollout/weight_sync.py", "bicc/rollout/channel.py", "bicc/rollout/workers.py",
          "bicc/trainer/state.py")


def step_modules() -> set[str]:
    """Every library module the step's code reaches by its imports, from ``bicc/trainer/step.py`` and Algorithm 1."""
    seen, todo = set(), ["bicc.trainer.step", "bicc.method.reference"]
    while todo:
        name = todo.pop()
        path = next((p for p in (ROOT / f"{name.replace('.', '/')}.py", ROOT / name.replace(".", "/") / "__init__.py")
                     if p.exists()), None)
        if path is None or name in seen:
            continue
        seen.add(name)
        if path.relative_to(ROOT).as_posix().startswith(RANKED):  # what it calls is the machine's
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bicc"):
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return {(ROOT / f"{n.replace('.', '/')}.py").relative_to(ROOT).as_posix() if (ROOT / f"{n.replace('.', '/')}.py").exists()
            else f"{n.replace('.', '/')}/__init__.py" for n in seen}


FSDP_HOOKS = ("reduce_after_backward(", "reshard_after_backward(", "set_requires_gradient_sync(",
              "set_reshard_after_backward(")


def test_the_steps_body_names_no_rank_and_no_collective():
    modules = step_modules()
    for rel in ("bicc/trainer/update.py", "bicc/kernels/batching.py", "bicc/kernels/rows.py", "bicc/rollout/agreement.py"):
        assert rel in modules  # the walk reaches what the step calls
    for rel in sorted(m for m in modules if not m.startswith(RANKED)):
        names = set()  # every name the code uses, imports or defines (not its docstrings or comments)
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            names |= {getattr(node, field) for field in ("id", "attr", "name", "arg", "module")
                      if isinstance(getattr(node, field, None), str)}
        calls = {getattr(n.func, "id", getattr(n.func, "attr", "")) for n in ast.walk(ast.parse((ROOT / rel).read_text()))
                 if isinstance(n, ast.Call)}
        hits = sorted(RANK_NAMES & names) + sorted(RANK_CALLS & calls) + [n for n in names if any(w in n for w in RANK_WORDS)]
        assert not hits, f"{rel} names {hits}: ranks and collectives belong in bicc.machine (the step's Ranks)"


def test_fsdps_hooks_live_in_one_named_place():
    users = {p.relative_to(ROOT).as_posix() for p in library_files()
             if any(h in p.read_text() for h in FSDP_HOOKS)}
    assert users == {"bicc/machine/ranks.py"}, users


def test_no_engine_is_named_outside_its_own_module():
    """The trainer reads what an engine can do from its class (``samples_from_module``, ``reserves_memory_share``,
    ``weight_route``, ``always_returns_logprobs``, ``longrope_long_everywhere``), never by testing its name: a new
    engine is its own module, and nothing else in the library branches on which one it is."""
    import re

    from bicc.rollout import ENGINES

    compared = re.compile(r"""engine\s*(?:[!=]=|(?:not\s+)?in)\s*[("'{\[]""")
    own = {f"bicc/rollout/{name}.py" for name in ENGINES.names()}
    hits = [f"{path.relative_to(ROOT).as_posix()}:{i}" for path in library_files() if path.relative_to(ROOT).as_posix()
            not in own for i, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line.split("#")[0])]
    assert not hits, f"engine names tested outside the engines' modules (read an ability instead): {hits}"
    assert compared.search('if r.engine == "vllm":') and compared.search("rollout.engine in ('hf',)")  # what it finds
