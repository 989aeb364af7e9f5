"""The package's layers, read from the source: every import of every mpper module
(function-level imports included), checked for cycles and for imports that go up.

Layers, lowest first (a module may import its own layer and the ones below):

0. ``mpper.shm``, ``mpper.atomic``, ``mpper.safe_files``, ``mpper.extras``, ``mpper.env_ids``: shared
   memory, atomic writes, received files read and appended safely, optional dependencies, what an
   env.id names;
1. ``mpper.replay``: the replay core (knows no algorithm, env or process);
2. ``mpper.config``, ``mpper.config_files``: the config sections and their checks; reading
   config files (shipped names, ``"base"``);
3. ``mpper.envs``, ``mpper.checkpoint``;
4. ``mpper.algos``: each algorithm's folder imports ``mpper.algos.base``, the modules
   beside the folders that algorithms share (``mpper.algos.muzero_family``) and itself,
   never another algorithm; only ``mpper.algos.registry`` (the algorithms) and
   ``mpper.algos.configs`` (their config sections) name them all;
5. ``mpper.runtime``: processes, scheduling, the run directory;
6. ``mpper.tools``: evaluate, inspect, plot;
7. ``mpper.cli`` and the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpper"

LAYERS = [
    ("mpper.shm", "mpper.atomic", "mpper.safe_files", "mpper.extras", "mpper.env_ids"),
    ("mpper.replay",),
    ("mpper.config", "mpper.config_files"),
    ("mpper.envs", "mpper.checkpoint"),
    ("mpper.algos",),
    ("mpper.runtime",),
    ("mpper.tools",),
    ("mpper.cli", "mpper"),
]


def module_name(path: Path) -> str:
    parts = ("mpper", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The mpper modules ``path`` imports, anywhere in the file (as dotted names; ``from
    X import y`` counts as X.y when X.y is a module, else X)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mpper")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mpper":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    found.discard(name)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_the_graph_was_read():
    assert len(MODULES) > 30
    assert "mpper.replay.buffer" in GRAPH["mpper.runtime.supervisor"]
    assert "mpper.algos.registry" in GRAPH["mpper.runtime.setup"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down(module):
    upward = [f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"
              for dep in sorted(GRAPH[module]) if layer_of(dep) > layer_of(module)]  # fmt: skip
    assert not upward, "\n".join(upward)


def test_algorithms_import_no_other_algorithm():
    algos = {m.split(".")[2] for m in MODULES if m.count(".") >= 2 and m.startswith("mpper.algos.")}
    folders = {a for a in algos if (PACKAGE / "algos" / a).is_dir()}
    assert {"muzero", "dqn"} <= folders
    crossing = []
    for module, deps in GRAPH.items():
        if module.startswith("mpper.algos.") and module.split(".")[2] in folders:
            own = module.split(".")[2]
            crossing += [f"{module} imports {d}" for d in deps
                         if d.startswith("mpper.algos.") and d.split(".")[2] in folders - {own}]  # fmt: skip
    assert not crossing, "\n".join(crossing)


# What the runtime may import of the algorithms: the registry that names them and the
# contract they all meet. Everything else of an algorithm is reached through them.
RUNTIME_SEES_OF_ALGOS = ("mpper.algos.registry", "mpper.algos.base")


def test_the_runtime_reaches_the_algorithms_only_through_the_registry_and_their_contract():
    reaching = [f"{module} imports {dep}" for module, deps in sorted(GRAPH.items()) if module.startswith("mpper.runtime")
                for dep in sorted(deps)
                if (dep == "mpper.algos" or dep.startswith("mpper.algos.")) and dep not in RUNTIME_SEES_OF_ALGOS]
    assert not reaching, "\n".join(reaching)


def test_a_planted_runtime_import_of_an_algorithm_module_is_found(monkeypatch):
    monkeypatch.setitem(globals(), "GRAPH", {"mpper.runtime.x": {"mpper.algos.muzero.player", "mpper.algos.base"}})
    with pytest.raises(AssertionError, match=r"mpper.runtime.x imports mpper.algos.muzero.player\n"):
        test_the_runtime_reaches_the_algorithms_only_through_the_registry_and_their_contract()


def _code_names_and_strings(path: Path) -> set[str]:
    """The identifiers and string constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.add(node.value)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_the_replay_core_writes_no_algorithms_fields_or_counters():
    """MuZero's reanalysed values are a row rewrite its own folder asks for, and its
    counters are declared by its schema: the replay core names neither."""
    naming = [f"{module}: {word!r}" for module, path in sorted(MODULES.items()) if module.startswith("mpper.replay")
              for word in sorted(_code_names_and_strings(path)) if "reanalys" in word.lower()]
    assert not naming, naming


def test_only_the_registry_compares_algorithm_names():
    """``config.algorithm`` is compared in one place: the registry (the config engine
    checks the key's value against the algorithms it is given, and compares no name)."""
    readers = []
    for module, path in MODULES.items():
        if module == "mpper.algos.registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "algorithm" for s in sides):
                    readers.append(f"{module}:{node.lineno}")
    assert not readers, readers


def test_every_algorithm_has_its_config_sections_and_reading_a_config_imports_no_torch():
    """The registry and the config loaders list the same algorithms; the loaders import
    each algorithm's ``config`` module only, so the command line checks a config before
    torch is imported (the forkserver's imports then overlap the supervisor's)."""
    import subprocess
    import sys

    from mpper.algos.configs import ALGORITHM_CONFIGS
    from mpper.algos.registry import ALGORITHMS

    assert list(ALGORITHMS) == list(ALGORITHM_CONFIGS)
    code = ("import sys; from mpper.algos.configs import load_config; "
            "[load_config(f'configs/{n}.json', check_env=False) for n in ('cartpole', 'cartpole_dqn')]; "
            "print(sorted(m for m in ('torch', 'mpper.algos.registry') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_import_cycles():
    """Depth-first search over the whole graph: any back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(GRAPH.get(module, ())):
            if dep not in GRAPH:
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def test_a_planted_cycle_and_upward_import_are_found(monkeypatch):
    """The checks themselves: a graph with a cycle and a replay module importing the
    runtime fails both."""
    fake = {"mpper.replay.a": {"mpper.runtime.b"}, "mpper.runtime.b": {"mpper.replay.a"}}
    monkeypatch.setitem(globals(), "GRAPH", fake)
    with pytest.raises(AssertionError, match="imports mpper.runtime.b"):
        test_imports_go_down("mpper.replay.a")
    with pytest.raises(AssertionError, match="mpper.replay.a -> mpper.runtime.b -> mpper.replay.a"):
        test_no_import_cycles()
