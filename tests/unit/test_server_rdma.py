"""The node's RDMA half (memkv.server.rdma) as the node drives it: settings and request context.

Behaviour under test, without NIXL or sockets:
* `ServerConfig.transport` / `rdma_devices` default to the node's MEMKV_TRANSPORT /
  MEMKV_RDMA_DEVICES (as documented), explicit values win, a bad transport (argument or
  environment) is a ConfigError naming MEMKV_TRANSPORT;
* a node configured with transport "tcp" answers RDMA_ATTACH with UNAVAILABLE and the reason;
* RDMA_GET on a connection that never attached is a protocol error (the node closes it);
* detaching a connection that never attached is a no-op.
"""

from __future__ import annotations

import pytest

from memkv import protocol as p
from memkv.config import ServerConfig
from memkv.errors import ConfigError, RemoteProtocolError
from memkv.server.rdma import RdmaResponder, RequestContext
from memkv.server.store import Store

pytestmark = pytest.mark.unit


def context(connection: object = "conn-1") -> tuple[RequestContext, list[tuple[bytes, int]]]:
    counted: list[tuple[bytes, int]] = []
    ctx = RequestContext(connection, ("127.0.0.1", 40000), 5.0, lambda statuses, n: counted.append((statuses, n)))
    return ctx, counted


@pytest.mark.parametrize(
    "env,transport,devices",
    [
        ({}, "auto", ()),
        ({"MEMKV_TRANSPORT": "tcp"}, "tcp", ()),
        ({"MEMKV_TRANSPORT": " TCP "}, "tcp", ()),
        ({"MEMKV_TRANSPORT": "auto"}, "auto", ()),
        # "rdma": NIXL comes up at the node's start (buffers registered as PUTs make them)
        ({"MEMKV_TRANSPORT": "rdma", "MEMKV_RDMA_DEVICES": "mlx5_0, mlx5_1:1"}, "rdma", ("mlx5_0", "mlx5_1:1")),
    ],
)
def test_server_config_takes_transport_and_devices_from_the_nodes_environment(
    monkeypatch, env, transport, devices
) -> None:
    for var in ("MEMKV_TRANSPORT", "MEMKV_RDMA_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    config = ServerConfig(capacity_bytes=64 << 20)
    assert (config.transport, config.rdma_devices) == (transport, devices)


def test_explicit_server_config_values_win_and_a_bad_transport_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("MEMKV_TRANSPORT", "tcp")
    assert ServerConfig(capacity_bytes=64 << 20, transport="auto", rdma_devices=("rxe0",)).transport == "auto"
    with pytest.raises(ConfigError, match="MEMKV_TRANSPORT"):
        ServerConfig(capacity_bytes=64 << 20, transport="udp")
    monkeypatch.setenv("MEMKV_TRANSPORT", "rmda")  # a typo in the node's environment names the variable
    with pytest.raises(ConfigError, match="MEMKV_TRANSPORT: expected one of auto, tcp, rdma, got 'rmda'"):
        ServerConfig(capacity_bytes=64 << 20)


def test_a_tcp_only_node_answers_attach_with_unavailable_and_the_reason() -> None:
    responder = RdmaResponder(Store(64 << 20), transport="tcp")
    ctx, _ = context()
    reply = responder.handle(ctx, p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, b"metadata"))
    assert reply == p.RdmaAttachReply(
        p.RdmaAttachStatus.UNAVAILABLE, "RDMA is disabled on this node (MEMKV_TRANSPORT=tcp)"
    )


def test_an_unknown_backend_is_rejected_before_any_rdma_is_set_up() -> None:
    responder = RdmaResponder(Store(64 << 20), transport="tcp")
    ctx, _ = context()
    reply = responder.handle(ctx, p.RdmaAttachRequest(7, b"metadata"))
    assert isinstance(reply, p.RdmaAttachReply) and reply.status == p.RdmaAttachStatus.REJECTED


def test_rdma_get_without_an_attach_is_a_protocol_error_and_counts_nothing() -> None:
    responder = RdmaResponder(Store(64 << 20), transport="tcp")
    ctx, counted = context()
    with pytest.raises(RemoteProtocolError, match="did not RDMA_ATTACH") as info:
        responder.handle(ctx, p.RdmaGetRequest((b"k",), (4096,), (0x1000,), 100, 1))
    assert info.value.code == p.ErrorCode.MALFORMED
    assert counted == []
    responder.detach("conn-1")  # never attached: nothing to undo
