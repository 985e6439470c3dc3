"""Fixtures for fault-injection tests (the node and client fixtures come from tests/conftest.py).

Tier tests import vLLM inside their own files (`pytest.importorskip`), so this folder is
collected, and its vLLM-free tests run, without vLLM.
"""

from __future__ import annotations

import pytest

from tests.faults.figures import record


@pytest.fixture
def figures(request):
    """`figures(**values)` records this test's figures for docs/reliability.md."""
    return lambda **values: record(request.node.nodeid, **values)
