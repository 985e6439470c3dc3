"""The package's modules import one way: no module imports, directly or through others, itself.

Behaviour under test: the graph of every import statement between `memkv` / `memkv_vllm`
modules (read from their source, so imports under `if TYPE_CHECKING:` and inside functions
count too; the parent packages Python runs before a submodule are not edges) has no cycle,
and the layering the docstrings promise holds in the modules' own imports (the top-level
`memkv/__init__.py` re-exports the Client for users, and that is not a layer):
* the client core (memkv.client.nodeset) and the transports never import the public Client;
* the node (memkv.server) never imports the client package;
* the sans-I/O codec (memkv.protocol) imports no socket, thread or clock.
"""

from __future__ import annotations

import ast
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


def _imports(name: str, path: Path) -> set[str]:
    """Modules of ours that `name` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod. (The
            # parent packages every import runs first are left out: they are not a loop.)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target and target not in MODULES:  # `from a.b import name`: the module is a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


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
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_graph_covers_the_modules_the_layers_are_made_of() -> None:
    for name in ("memkv.client.nodeset", "memkv.transport.tcp", "memkv.transport.rdma", "memkv.server.rdma",
                 "memkv.client.pipeline", "memkv.client.cluster", "memkv.protocol"):
        assert name in GRAPH
    assert "memkv.client.nodeset" in GRAPH["memkv.transport.tcp"]


def test_no_module_imports_itself_through_others() -> None:
    assert _cycle() is None


@pytest.mark.parametrize("module", ["memkv.client.nodeset", "memkv.client.pipeline", "memkv.transport",
                                    "memkv.transport.tcp", "memkv.transport.rdma"])
def test_the_client_core_transports_and_pipeline_never_reach_the_public_client(module) -> None:
    assert "memkv.client.cluster" not in _reaches(module)


@pytest.mark.parametrize("module", ["memkv.server.node", "memkv.server.rdma", "memkv.server.store"])
def test_the_node_never_imports_the_client_package(module) -> None:
    assert not {m for m in _reaches(module) if m.startswith("memkv.client")}


def test_the_codec_imports_no_socket_thread_or_clock() -> None:
    tree = ast.parse(MODULES["memkv.protocol"].read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert not imported & {"socket", "threading", "time", "select", "asyncio"}
