"""MEMKV_TRANSPORT: tcp, auto and rdma, and what has_rdma() says in each.

Behaviour under test:
* `tcp` never touches NIXL: register_pool answers False and has_rdma() stays False;
* `auto` on a host without an RDMA device is TCP without importing NIXL;
* `rdma` refuses to start without NIXL (ConfigError naming MEMKV_TRANSPORT and the install
  command), with a MEMKV_RDMA_DEVICES name that does not exist, with a bad
  MEMKV_NIXL_PROGRESS_DELAY_US, and when a node cannot do RDMA (RdmaError naming the server):
  no silent downgrade;
* `auto` latches to TCP for the life of the client on the first RDMA failure, with exactly
  one WARNING: a node that refuses the attach or predates RDMA (its loads go over TCP at once,
  nothing was written, the node is not marked down), or a node whose write misses its window
  (that load fails and is withheld; the next ones go over TCP);
* NIXL's progress thread is tamed: an idle agent costs a small fraction of a core.
"""

from __future__ import annotations

import logging
import os
import resource
import time

import pytest

from memkv import Client, ClientConfig, ConfigError, nixl_adapter
from memkv.config import AuthKey, ServerAddress
from memkv.transport import RdmaError, TcpTransport
from tests.rdma.conftest import node_requests, requires_nixl

MiB = 1 << 20


def config(transport: str, **kwargs) -> ClientConfig:
    return ClientConfig(
        servers=(ServerAddress("127.0.0.1", 9),),
        auth_key=AuthKey.from_hex("ab" * 32, "test"),
        transport=transport,
        **kwargs,
    )


@pytest.mark.unit
def test_tcp_mode_never_registers_and_reports_no_rdma(pool, monkeypatch):
    monkeypatch.setattr(nixl_adapter, "nixl_available", lambda: pytest.fail("tcp mode imported NIXL"))
    with Client(config("tcp")) as client:
        assert isinstance(client._transport, TcpTransport)
        assert client.register_pool(pool) is False and client.has_rdma() is False


@pytest.mark.unit
def test_auto_without_an_rdma_device_is_tcp_without_importing_nixl(pool, monkeypatch):
    monkeypatch.setattr(nixl_adapter, "rdma_devices", lambda configured=(): ([], list(configured)))
    monkeypatch.setattr(nixl_adapter, "nixl_available", lambda: pytest.fail("auto imported NIXL without a device"))
    with Client(config("auto")) as client:
        assert isinstance(client._transport, TcpTransport)
        assert client.register_pool(pool) is False and not client.has_rdma()


@pytest.mark.unit
def test_rdma_mode_without_nixl_refuses_to_start(monkeypatch):
    monkeypatch.setattr(
        nixl_adapter,
        "nixl_available",
        lambda: (False, f"NIXL is not installed ({nixl_adapter.INSTALL_HINT}): No module named 'nixl'"),
    )
    with pytest.raises(ConfigError) as info:
        Client(config("rdma"))
    assert "MEMKV_TRANSPORT=rdma" in str(info.value) and "pip install --no-deps nixl-cu12" in str(info.value)


@requires_nixl
@pytest.mark.unit
def test_rdma_mode_with_a_missing_device_or_bad_delay_refuses_to_start(monkeypatch):
    with pytest.raises(ConfigError) as info:
        Client(config("rdma", rdma_devices=("mlx5_99",)))
    assert "MEMKV_RDMA_DEVICES" in str(info.value) and "mlx5_99" in str(info.value)
    monkeypatch.setenv("MEMKV_NIXL_PROGRESS_DELAY_US", "soon")
    with pytest.raises(ConfigError) as info:
        Client(config("rdma"))
    assert "MEMKV_NIXL_PROGRESS_DELAY_US" in str(info.value)
    monkeypatch.delenv("MEMKV_NIXL_PROGRESS_DELAY_US")
    for name, bad in (("MEMKV_NIXL_WORKERS", "0"), ("MEMKV_NIXL_WORKERS", "many"), ("MEMKV_NIXL_SYNC", "none")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError) as info:
            Client(config("rdma"))
        assert name in str(info.value) and repr(bad) in str(info.value)
        monkeypatch.delenv(name)


@requires_nixl
@pytest.mark.integration
def test_agents_get_the_configured_ucx_workers_and_thread_sync(monkeypatch):
    """Over cma the copy runs inside the call that posts a WRITE: NIXL's strict sync mode and
    one UCX worker made a node copy one value at a time (issue 16). The defaults are rw and 8
    workers; the setting reaches NIXL (read back from the backend's own parameters)."""
    monkeypatch.setenv("UCX_TLS", nixl_adapter.ucx_tls_for_host("tcp"))
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    for env, workers, sync in (({}, 8, "rw"), ({"MEMKV_NIXL_WORKERS": "2", "MEMKV_NIXL_SYNC": "strict"}, 2, "strict")):
        for k in ("MEMKV_NIXL_WORKERS", "MEMKV_NIXL_SYNC"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        agent = nixl_adapter.NixlAgent("client")
        try:
            assert (agent.ucx_workers, agent.thread_sync) == (workers, sync)
        finally:
            agent.close()


@requires_nixl
@pytest.mark.integration
def test_rdma_mode_refuses_a_node_without_rdma_naming_it(ucx, start_node, make_client, pool):
    good = start_node()
    tcp_only = start_node(env={"MEMKV_TRANSPORT": "tcp"})
    client = make_client([good, tcp_only], transport="rdma")
    with pytest.raises(RdmaError) as info:
        client.register_pool(pool)
    assert tcp_only.address in str(info.value) and "UNAVAILABLE" in str(info.value)
    assert not client.has_rdma()


def warnings_about_tcp(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "memkv.client" and r.levelno == logging.WARNING and "uses TCP from now on" in r.getMessage()
    ]


@requires_nixl
@pytest.mark.integration
def test_auto_latches_to_tcp_when_a_node_refuses_rdma(ucx, start_node, make_client, pool, monkeypatch, caplog):
    monkeypatch.setattr(nixl_adapter, "rdma_devices", lambda configured=(): (["fake_nic0"], []))  # "a NIC is here"
    node = start_node(env={"MEMKV_TRANSPORT": "tcp"})
    client = make_client([node], transport="auto", shared_memory=False)  # so every load is a node GET
    caplog.set_level(logging.INFO, logger="memkv.client")
    assert client.register_pool(pool) is False and not client.has_rdma()
    value = os.urandom(MiB)
    client.put("auto/k", value)
    for _ in range(3):
        assert client.batch_load_into([("auto/k", pool[:MiB])]).ok == [True]
    assert bytes(pool[:MiB]) == value
    assert node_requests(node, "get") == 3 and node_requests(node, "rdma_get") == 0
    assert len(warnings_about_tcp(caplog)) == 1


@requires_nixl
@pytest.mark.integration
def test_auto_latches_to_tcp_with_a_node_that_predates_rdma(
    ucx, start_late_node, make_client, pool, monkeypatch, caplog
):
    monkeypatch.setattr(nixl_adapter, "rdma_devices", lambda configured=(): (["fake_nic0"], []))
    node = start_late_node(pre_rdma=True)  # answers RDMA_ATTACH with UNKNOWN_OPCODE and closes
    client = make_client([node], transport="auto")
    caplog.set_level(logging.INFO, logger="memkv.client")
    assert client.register_pool(pool) is False and not client.has_rdma()
    value = os.urandom(MiB)
    client.put("auto/old", value)  # the node was not marked down: the put goes through
    assert client.batch_load_into([("auto/old", pool[:MiB])]).ok == [True] and bytes(pool[:MiB]) == value
    assert all(h["up"] for h in client.health())
    assert len(warnings_about_tcp(caplog)) == 1


@requires_nixl
@pytest.mark.integration
def test_auto_latches_to_tcp_after_a_write_misses_its_window(
    ucx, start_late_node, make_client, pool, monkeypatch, caplog
):
    monkeypatch.setattr(nixl_adapter, "rdma_devices", lambda configured=(): (["fake_nic0"], []))
    node = start_late_node(delay_s=1.5, ignore_window=False)  # window = 0.5 * 2 s: the write never starts
    client = make_client([node], transport="auto", io_timeout_s=2.0)
    caplog.set_level(logging.INFO, logger="memkv.client")
    assert client.register_pool(pool) is True and client.has_rdma()
    value = os.urandom(MiB)
    client.put("auto/late", value)
    pool[:MiB] = bytes(MiB)
    first = client.batch_load_into([("auto/late", pool[:MiB])])
    assert first.ok == [False] and first.may_land_late  # the node could not confirm: withhold
    assert not client.has_rdma()
    assert bytes(pool[:MiB]) == bytes(MiB)  # a well-behaved node does not write after its window
    for _ in range(2):
        assert client.batch_load_into([("auto/late", pool[MiB : 2 * MiB])]).ok == [True]
    assert bytes(pool[MiB : 2 * MiB]) == value
    assert len(warnings_about_tcp(caplog)) == 1


@requires_nixl
@pytest.mark.integration
def test_the_progress_thread_is_tamed(monkeypatch):
    monkeypatch.setenv("UCX_TLS", nixl_adapter.ucx_tls_for_host("tcp"))
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("MEMKV_NIXL_PROGRESS_DELAY_US", raising=False)  # the default
    agent = nixl_adapter.NixlAgent("client")
    try:
        assert agent.progress_delay_us >= 10
        before = resource.getrusage(resource.RUSAGE_SELF)
        t = time.monotonic()
        time.sleep(1.0)  # idle: only the agent's threads run
        after = resource.getrusage(resource.RUSAGE_SELF)
        cores = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / (time.monotonic() - t)
        assert cores < 0.25, f"an idle NIXL agent used {cores:.2f} cores (busy-polling progress thread?)"
    finally:
        agent.close()
