"""The package's modules import one way: no module imports, directly or through others, itself.

Behaviour under test: the graph of every import between `memkv` / `memkv_vllm` modules (read
from their source, so imports under `if TYPE_CHECKING:` and inside functions count too) has no
cycle, and the layering the docstrings promise holds for everything an import runs. Importing
`a.b.c` runs the package `__init__` files `a` and `a.b` first, so those are edges too (an edge
to the importer's own packages is left out: they run before it, and are counted where the
importer is reached). A package's lazy re-exports (PEP 562: its `__getattr__`, with the
`if TYPE_CHECKING:` imports that give them their types) run when a name is asked for, not when
the package is imported: `from memkv import Client` is an edge to `memkv.client.cluster`, a
bare `import memkv` is not. Layers:
* the client core (memkv.client.nodeset) and the transports never import the public Client;
* the client core (memkv.client.node, .nodeset, .pipeline, .shared) never imports the transports
  built on it (a connection's way for values is handed to it: `memkv.client.node.OpenWay`);
* the node (memkv.server) never imports the client package, nor the transports (which are
  built on it); what `import memkv.server.node` loads in a real interpreter is checked too;
* the sans-I/O codec (memkv.protocol) imports no socket, thread or clock.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("memkv", "memkv_vllm")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        # *.pyi without a .py: a compiled module of ours (memkv._recv_verify); it imports nothing of ours
        for path in sorted([*(SRC / package).rglob("*.py"), *(SRC / package).rglob("*.pyi")]):
            if path.suffix == ".pyi" and path.with_suffix(".py").exists():
                continue
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _lazy_blocks(path: Path, tree: ast.Module) -> list[ast.stmt]:
    """A package `__init__`'s lazy re-exports: its module-level `__getattr__` and `if TYPE_CHECKING:`."""
    if path.name != "__init__.py":
        return []
    return [
        stmt
        for stmt in tree.body
        if (isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__")
        or (isinstance(stmt, ast.If) and _is_type_checking(stmt.test))
    ]


def _statements(name: str, path: Path, body: list[ast.stmt]) -> list[tuple[ast.ImportFrom | ast.Import, str]]:
    """(import statement, the module of ours it names) for every import in `body`, however deep."""
    is_package = path.name == "__init__.py"
    out: list[tuple[ast.ImportFrom | ast.Import, str]] = []
    for node in (n for stmt in body for n in ast.walk(stmt)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `from a.b import name`: the module is a.b
                target = target.rpartition(".")[0]
            if target:
                out.append((node, target))
    return out


def _lazy_names() -> dict[str, dict[str, str]]:
    """{package: {name: the module its lazy re-export imports}}, from each package's
    `if TYPE_CHECKING:` imports (test_the_lazy_re_exports_are_what_their_imports_name checks
    that `__getattr__` gives those very objects)."""
    out: dict[str, dict[str, str]] = {}
    for name, path in MODULES.items():
        for node, target in _statements(name, path, _lazy_blocks(path, ast.parse(path.read_text(), str(path)))):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    out.setdefault(name, {})[alias.asname or alias.name] = target
    return out


LAZY = _lazy_names()


def _packages_of(module: str) -> list[str]:
    """The package `__init__` files Python runs before `module`: memkv.server.node ->
    memkv, memkv.server."""
    parts = module.split(".")
    return [pkg for pkg in (".".join(parts[:i]) for i in range(1, len(parts))) if pkg in MODULES]


def _imports(name: str, path: Path) -> set[str]:
    """Modules of ours that importing `name` may run: every module its source imports, with
    the package `__init__` files that import runs first; a package's lazy re-exports only
    where a name is taken from it."""
    tree = ast.parse(path.read_text(), str(path))
    lazy = _lazy_blocks(path, tree)
    body = [stmt for stmt in tree.body if stmt not in lazy]
    out: set[str] = set()
    for node, target in _statements(name, path, body):
        out |= {target, *_packages_of(target)}
        if isinstance(node, ast.ImportFrom) and target in LAZY:  # `from memkv import Client`
            out |= {LAZY[target][a.name] for a in node.names if a.name in LAZY[target]}
    # The importer's own packages have run before it (not a loop); they count where it is reached.
    return {m for m in out if m != name and m not in _packages_of(name)}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import cycle, as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := visit(name)):
            return found
    return None


def _reaches(start: str) -> set[str]:
    """Every module of ours `import start` may run, its own packages included."""
    seen: set[str] = set(_packages_of(start))
    todo = [start, *seen]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_graph_covers_the_modules_the_layers_are_made_of() -> None:
    for name in (
        "memkv.client.nodeset",
        "memkv.transport.tcp",
        "memkv.transport.rdma",
        "memkv.server.rdma",
        "memkv.client.pipeline",
        "memkv.client.cluster",
        "memkv.protocol",
    ):
        assert name in GRAPH
    assert "memkv.client.nodeset" in GRAPH["memkv.transport.tcp"]
    # the package `__init__` files an import runs are edges: tcp's `import memkv.client.node` runs memkv/client/__init__
    assert "memkv.client" in GRAPH["memkv.transport.tcp"]
    assert {"memkv", "memkv.server"} <= _reaches("memkv.server.node")


def test_no_module_imports_itself_through_others() -> None:
    assert _cycle() is None


@pytest.mark.parametrize(
    "module",
    [
        "memkv.client.nodeset",
        "memkv.client.pipeline",
        "memkv.transport",
        "memkv.transport.tcp",
        "memkv.transport.rdma",
        "memkv.transport.stream",
        "memkv.transport.shm",
    ],
)
def test_the_client_core_transports_and_pipeline_never_reach_the_public_client(module) -> None:
    assert "memkv.client.cluster" not in _reaches(module)


@pytest.mark.parametrize(
    "module", ["memkv.client.node", "memkv.client.nodeset", "memkv.client.pipeline", "memkv.client.shared"]
)
def test_the_client_core_never_reaches_the_transports(module) -> None:
    assert {m for m in _reaches(module) if m.startswith("memkv.transport")} == set()


def test_each_way_values_move_is_built_on_the_client_core() -> None:
    assert "memkv.client.node" in GRAPH["memkv.transport.stream"]
    assert {"memkv.client.shared", "memkv.transport.stream"} <= GRAPH["memkv.transport.shm"]


@pytest.mark.parametrize("module", ["memkv.server.node", "memkv.server.rdma", "memkv.server.store"])
def test_the_node_never_imports_the_client_package(module) -> None:
    # memkv.transport is built on the client core: its package __init__ loads the client
    assert {m for m in _reaches(module) if m.startswith(("memkv.client", "memkv.transport"))} == set()


def test_the_nixl_adapter_is_a_leaf() -> None:
    """The node's side of RDMA and the client's both import it: it imports neither."""
    assert GRAPH["memkv.nixl_adapter"] <= {"memkv.errors"}


def test_importing_the_node_loads_no_client_or_transport_module() -> None:
    """In a fresh interpreter, as `memkv serve` starts: the graph above reads source, this checks what runs."""
    loaded = "sorted(m for m in sys.modules if m.startswith('memkv.client') or m.startswith('memkv.transport'))"
    code = f"import memkv.server.node, sys; print({loaded}); from memkv import Client; print({loaded})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    node_only, with_client = done.stdout.splitlines()
    assert node_only == "[]"
    assert "memkv.client.cluster" in with_client  # the probe sees a client module once one is loaded


@pytest.mark.parametrize("package", sorted(LAZY))
def test_the_lazy_re_exports_are_what_their_imports_name(package) -> None:
    """The graph takes a lazy name's module from the TYPE_CHECKING imports; `__getattr__` must agree."""
    module = importlib.import_module(package)
    for name, source in LAZY[package].items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), name


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if m == "memkv.protocol" or m.startswith("memkv.protocol."))
)
def test_the_codec_imports_no_socket_thread_or_clock(module) -> None:
    tree = ast.parse(MODULES[module].read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imported & {"socket", "threading", "time", "select", "asyncio"}
