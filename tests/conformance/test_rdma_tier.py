"""The memkv tier over the RDMA transport, inside vLLM's real TieringOffloadingManager.

Behaviour under test (issue: RDMA end to end):
* with MEMKV_TRANSPORT=rdma the tier registers the whole CPU pool once at startup, its ready
  line says `rdma=True`, and promotions land byte-exact in the pool rows by the nodes' RDMA
  WRITEs (the nodes served RDMA_GET, never GET);
* MEMKV_TRANSPORT=rdma refuses to start when a node cannot do RDMA, naming the node;
* MEMKV_TRANSPORT=tcp says `rdma=False` and registers nothing.
NIXL runs over UCX on loopback (UCX_TLS from the environment, tcp by default; UCX_NET_DEVICES=lo;
a tamed progress thread). The rest of the suite runs over RDMA too with MEMKV_TEST_TRANSPORT=rdma
(docs/rdma.md, "Testing").
"""

from __future__ import annotations

import os
import re
import urllib.request

import pytest

from memkv.local import LocalNode
from memkv.nixl_adapter import INSTALL_HINT, nixl_available, ucx_tls_for_host
from tests.conformance import vllm_harness as h
from tests.conformance.conftest import PluginLog, point_at

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(not nixl_available()[0], reason=f"NIXL is not installed ({INSTALL_HINT})"),
]


def memkv() -> dict:
    return {"type": "memkv", "n_read_threads": 2, "n_write_threads": 2}


def node_requests(node: LocalNode, op: str) -> float:
    with urllib.request.urlopen(f"{node.admin_url}/v1/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf'^memkv_node_requests_total{{op="{op}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class TierLog(PluginLog):
    def ready_line(self) -> str:
        (line,) = [x for x in self.lines if x.startswith("MemKV tier ready")]
        return line


@pytest.fixture
def ucx_nodes(monkeypatch, auth_key_hex):
    monkeypatch.setenv("UCX_TLS", ucx_tls_for_host(os.environ.get("UCX_TLS") or "tcp"))  # + cuda_copy on a GPU host
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("MEMKV_NIXL_PROGRESS_DELAY_US", "100")
    nodes = []
    try:
        nodes = [LocalNode(auth_key_hex, capacity="256MiB") for _ in range(2)]
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_tier_registers_the_pool_and_promotes_by_rdma_write(monkeypatch, ucx_nodes, auth_key_hex):
    import memkv_vllm

    point_at(monkeypatch, ucx_nodes, auth_key_hex)
    monkeypatch.setenv("MEMKV_TRANSPORT", "rdma")
    memkv_vllm.register()
    geometry = h.Geometry(world_size=2, num_rows=8)
    with TierLog() as log, h.HeadlessEngine([memkv()], geometry) as engine:
        (tier,) = engine.manager.secondary_tiers
        assert tier.client.has_rdma() and "rdma=True" in log.ready_line()
        assert tier.client._transport._pool.length == geometry.row_bytes * geometry.num_rows  # the whole pool, once
        keys = h.make_keys(4)
        req = engine.new_request()
        engine.store_chunks(req, keys)
        engine.finish_request(req)
        engine.step()
        engine.run_until_idle(timeout_s=20)
        engine.fill_pool_to_evict(keys)
        loaded = engine.promote_and_read(keys)
        assert loaded.trace.final == (h.LookupResult.HIT,) * 4
        for key in keys:
            assert loaded.data[key] == engine.payloads[key], f"promoted row differs for {key.hex()[:16]}"
    assert sum(node_requests(n, "rdma_get") for n in ucx_nodes) >= 1
    assert sum(node_requests(n, "get") for n in ucx_nodes) == 0


def test_rdma_transport_refuses_to_start_when_a_node_cannot(monkeypatch, ucx_nodes, auth_key_hex, no_leaked_regions):
    import memkv_vllm

    tcp_only = LocalNode(auth_key_hex, capacity="64MiB", env={"MEMKV_TRANSPORT": "tcp"})
    try:
        point_at(monkeypatch, [*ucx_nodes, tcp_only], auth_key_hex)
        monkeypatch.setenv("MEMKV_TRANSPORT", "rdma")
        memkv_vllm.register()
        with pytest.raises(Exception) as info:
            h.HeadlessEngine([memkv()])
        message = str(info.value)
        assert "MemKV tier cannot start" in message and "MEMKV_TRANSPORT=rdma" in message
        assert tcp_only.address in message
    finally:
        tcp_only.stop()


def test_tcp_transport_reports_no_rdma(monkeypatch, ucx_nodes, auth_key_hex):
    import memkv_vllm

    point_at(monkeypatch, ucx_nodes, auth_key_hex)
    monkeypatch.setenv("MEMKV_TRANSPORT", "tcp")
    memkv_vllm.register()
    with TierLog() as log, h.HeadlessEngine([memkv()]) as engine:
        (tier,) = engine.manager.secondary_tiers
        assert not tier.client.has_rdma() and "rdma=False" in log.ready_line()
