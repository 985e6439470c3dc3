"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from tests.unit.loopback import tcp_pair


@pytest.fixture
def pair():
    """A connected (sender, receiver) pair of TCP sockets on 127.0.0.1."""
    with tcp_pair() as socks:
        yield socks
