"""Fixtures for fault-injection tests (the node and client fixtures come from tests/conftest.py).

Tier tests import vLLM inside their own files (`pytest.importorskip`), so this folder is
collected, and its vLLM-free tests run, without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import NodeFactory, _node_factory
from tests.faults.figures import record


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module with `OVER_TLS_TOO = True` runs each test that starts nodes twice: against
    plain nodes and against TLS-only ones (clients from make_client then speak TLS)."""
    if getattr(metafunc.module, "OVER_TLS_TOO", False) and "start_node" in metafunc.fixturenames:
        metafunc.parametrize("wire", ["plain", "tls"])


@pytest.fixture
def wire() -> str:
    return "plain"


@pytest.fixture
def start_node(auth_key_hex: str, wire: str) -> Iterator[NodeFactory]:
    yield from _node_factory(auth_key_hex, tls=wire == "tls")


@pytest.fixture
def figures(request):
    """`figures(**values)` records this test's figures for docs/reliability.md."""
    return lambda **values: record(request.node.nodeid, **values)
