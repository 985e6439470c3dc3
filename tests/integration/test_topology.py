"""The node topology the suite runs against is the one it claims (tests/conftest.py, TOPOLOGY).

Behaviour under test: with MEMKV_TEST_TOPOLOGY=remote every node the fixtures start is another
host's (its own network namespace, reached over a veth pair): a client reaches it over TCP only,
with no same-host socket and no shared memory (`memkv probe` says via=tcp, the client counts
0 same-host and 0 shared-memory servers), and values still round-trip byte-exact. With the
default topology the nodes are on 127.0.0.1 and a client takes the same-host path to each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REMOTE

pytestmark = pytest.mark.integration


def test_clients_reach_the_nodes_by_the_topology_under_test(start_node, make_client, auth_key_hex) -> None:
    nodes = start_node.many(2)
    client = make_client(nodes)
    value = os.urandom(3 << 20)
    client.put(b"topology", value)
    assert client.get(b"topology") == value
    probe = subprocess.run(
        [sys.executable, "-m", "memkv", "probe", "--json"],
        env={**os.environ, "MEMKV_SERVERS": ",".join(n.address for n in nodes), "MEMKV_AUTH_KEY": auth_key_hex},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    via = {r["server"]: r["via"] for r in json.loads(probe.stdout)["servers"]}
    if REMOTE:
        assert all(not n.host.startswith("127.") for n in nodes)
        assert set(via.values()) == {"tcp"}, via
        assert client.local_servers() == [] and client.shared_memory_servers() == []
    else:
        assert all(n.host == "127.0.0.1" for n in nodes)
        assert "tcp" not in via.values(), via
