"""Fixtures for hostile-input tests: a node with a short I/O timeout, figure recording."""

from __future__ import annotations

import pytest

from memkv.local import LocalNode
from tests.faults.figures import record

IO_TIMEOUT_S = 1.0


@pytest.fixture
def figures(request):
    """`figures(**values)` records this test's figures for docs/reliability.md."""
    return lambda **values: record(request.node.nodeid, **values)


@pytest.fixture(params=["plain", "tls"])
def hostile_node(start_node, request) -> LocalNode:
    """A node for bad input: 1 s --io-timeout, 64 MiB capacity, 16 MiB values; each test runs
    against a plain node and a TLS-only one (the hostile bytes then arrive inside TLS)."""
    return start_node(
        capacity="64MiB",
        extra_args=["--io-timeout", str(IO_TIMEOUT_S), "--max-value-size", "16MiB"],
        tls=request.param == "tls",
    )
