"""Fixtures for fault-injection tests (the node and client fixtures come from tests/conftest.py).

Tier tests import vLLM inside their own files (`pytest.importorskip`), so this folder is
collected, and its vLLM-free tests run, without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import NodeFactory, _node_factory
from tests.faults.figures import record


@pytest.fixture
def start_node(auth_key_hex: str, wire: str) -> Iterator[NodeFactory]:
    """Nodes over `wire` (tests/conftest.py): a module with `OVER_TLS_TOO = True`, or a test
    marked `over_tls_too`, also runs against TLS-only nodes (clients from make_client and
    build_client then speak TLS)."""
    yield from _node_factory(auth_key_hex, tls=wire == "tls")


@pytest.fixture
def figures(request):
    """`figures(**values)` records this test's figures for docs/reliability.md."""
    return lambda **values: record(request.node.nodeid, **values)
