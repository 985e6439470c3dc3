"""How values move: one class per way bytes travel, and the choice of one.

    base.py          Transport (the seam of a client's loads), LoadResult
    tcp.py           TcpTransport: loads over each node's connections, the way each moves values
    stream.py        SocketStream: values streamed over one connection (TCP, Unix socket, TLS)
    shm.py           SharedMemory: a same-host node's values as sealed memfds, on one connection
    rdma.py          RdmaTransport: the node WRITEs values into the client's registered pool

The node's halves are beside the node: memkv/server/shm.py (memfds) and memkv/server/rdma.py.

Every NIXL call is in memkv/nixl_adapter.py, a leaf module outside this package: the node's
side of RDMA (memkv/server/rdma.py) uses it too, and must not load the client this package
is built on.

Both transports are built on the client core (`memkv.client.nodeset.NodeSet`), never on
`memkv.Client`; the client's errors, `RdmaError` included, are in memkv.errors.

`open_way` picks the way of each connection once, when NodeClient opens it (its `OpenWay`):
`SharedMemory` for a same-host connection whose node offered shared memory (HELLO_OK) while
`shared_memory` is on here, else `SocketStream`. Every GET and PUT of that connection goes its
way (`NodeConnection.way`).

`select_transport` picks one per client from MEMKV_TRANSPORT (docs/rdma.md):
  * `tcp`: always TCP.
  * `auto` (default): RDMA when NIXL imports and this host has an RDMA device (listed in
    /sys/class/infiniband, restricted to MEMKV_RDMA_DEVICES when set); else TCP without even
    importing NIXL. The RDMA transport latches to TCP on its first failure.
  * `rdma`: RDMA or refuse to start (ConfigError here, RdmaError from `register_pool`), even
    without a NIC: UCX then runs over tcp or cma (how the tests run it; slower than TCP).
Stores always take the TCP path; only loads into the registered pool use RDMA.

Nothing here imports NIXL at module level: a node or client that never uses RDMA never loads it.
"""

from __future__ import annotations

import logging

from memkv.client.node import NodeConnection, Way
from memkv.client.nodeset import NodeSet
from memkv.client.shared import MappedValues
from memkv.config import ClientConfig
from memkv.errors import ConfigError, RdmaError
from memkv.transport.base import LoadResult, Transport
from memkv.transport.shm import SharedMemory
from memkv.transport.stream import SocketStream
from memkv.transport.tcp import TcpTransport

log = logging.getLogger("memkv.client")


def open_way(conn: NodeConnection, memory: MappedValues | None) -> Way:
    """The way of a connection just opened: through `memory` (the mappings of its node process,
    given when that process's shared memory may be used on it), else over its socket."""
    return SocketStream(conn) if memory is None else SharedMemory(conn, memory)


def select_transport(nodes: NodeSet, config: ClientConfig) -> Transport:
    mode = config.transport
    if mode == "tcp":
        return TcpTransport(nodes)
    from memkv import nixl_adapter

    present, missing = nixl_adapter.rdma_devices(config.rdma_devices)
    if mode == "auto" and not present:
        if config.rdma_devices:
            log.warning("MemKV: MEMKV_RDMA_DEVICES names %s, not present on this host; loads use TCP", missing)
        else:
            log.debug("MemKV: no RDMA device on this host; loads use TCP")
        return TcpTransport(nodes)
    ok, why = nixl_adapter.nixl_available()
    if not ok:
        if mode == "rdma":
            raise ConfigError(f"MEMKV_TRANSPORT=rdma but {why}")
        log.warning("MemKV: RDMA device(s) %s present but %s; loads use TCP", present, why)
        return TcpTransport(nodes)
    if mode == "rdma" and missing:
        raise ConfigError(
            f"MEMKV_RDMA_DEVICES: no RDMA device named {', '.join(missing)} on this host "
            f"(present: {', '.join(present) or 'none'})"
        )
    # A bad MEMKV_NIXL_PROGRESS_DELAY_US / _WORKERS / _SYNC fails here, at startup.
    nixl_adapter.progress_delay_us()
    nixl_adapter.ucx_workers()
    nixl_adapter.thread_sync()
    from memkv.transport.rdma import RdmaTransport

    log.info("MemKV: %s: RDMA loads with %s once the pool is registered", f"MEMKV_TRANSPORT={mode}", why)
    return RdmaTransport(nodes, mode, config.rdma_devices)


__all__ = [
    "LoadResult",
    "RdmaError",
    "SharedMemory",
    "SocketStream",
    "TcpTransport",
    "Transport",
    "open_way",
    "select_transport",
]
