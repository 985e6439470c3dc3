"""The transport seam: how a batch of loads reaches the caller's buffers.

Two implementations: `TcpTransport` (memkv/transport/tcp.py: over each node's connections, each
moving values its own way: the socket, or a same-host node's shared memory) and
`RdmaTransport` (memkv/transport/rdma.py: the node WRITEs the value into the client's
registered pool by RDMA; only control messages use the TCP connection). Stores always use
the TCP path (docs/rdma.md, "Stores", has the measurement behind that choice).

A transport is chosen once per client (`memkv.transport.select_transport`) from
MEMKV_TRANSPORT; the RDMA one can latch to TCP for the rest of the client's life. Both are
built on the client core (`memkv.client.nodeset.NodeSet`: the nodes, placement, fan-out),
never on `memkv.Client`. Their errors are in memkv.errors (`RdmaError`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """The outcome of a batch of loads.

    `ok[i]`: the value arrived whole into buffer i and its checksum verified.
    `may_land_late`: some buffer whose `ok` is False may still be written by a node (a WRITE
    was posted or may have been, and its completion was not seen). The caller must not reuse
    such a buffer until no write can arrive any more (the tier's load_failure_grace_s).
    Always False on TCP: there the client's own thread receives the bytes."""

    ok: list[bool]
    may_land_late: bool = False


class Transport(abc.ABC):
    """How a client moves loads. Threading: every method may be called from any thread."""

    name: str

    @property
    @abc.abstractmethod
    def rdma_active(self) -> bool:
        """True while loads into the registered pool go over RDMA."""

    @abc.abstractmethod
    def register_pool(self, view: memoryview) -> bool:
        """Register the whole destination pool once (the tier's CPU pool). True when loads into
        it will go over RDMA. The transport keeps the address range, not the view."""

    @abc.abstractmethod
    def load_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> LoadResult:
        """Load each key into its view (already validated: bytes keys, writable flat views)."""

    def close(self) -> None:  # noqa: B027 - optional: a transport that holds nothing keeps it
        """Release what the transport holds (idempotent)."""
