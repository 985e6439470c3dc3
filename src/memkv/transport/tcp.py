"""The TCP transport: MemKV's own data path, unchanged.

The node sends each value after the GET reply's meta on the authenticated connection and the
client receives it with `recv_into` straight into the caller's buffer, hashing each chunk
while it is in cache (client/node.py `NodeConnection.get_into`). When the call returns, no
byte can reach the buffer any more: `may_land_late` is always False.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memkv.transport.base import LoadResult, Transport

if TYPE_CHECKING:
    from memkv.client.cluster import Client


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, client: Client) -> None:
        self._client = client

    @property
    def rdma_active(self) -> bool:
        return False

    def register_pool(self, view: memoryview) -> bool:
        return False  # nothing to register: the kernel copies into the buffer

    def load_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> LoadResult:
        return LoadResult(self._client._get_into_tcp(list(keys), list(views)))
