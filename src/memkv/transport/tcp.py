"""The TCP transport: MemKV's own data path for loads, over each node's connections.

Each connection moves the values its own way, chosen when it was opened (`NodeConnection.way`):
the node sends each value after the GET reply's meta and the client receives it straight into
the caller's buffer, hashing each piece while it is in cache (memkv/transport/stream.py), or,
on a same-host connection, the client copies it from the node's sealed memfds
(memkv/transport/shm.py). Either way the client's own thread writes the buffer: when the call
returns no byte can reach it any more, and `may_land_late` is always False.

A batch is split by owner (`NodeSet.scatter`) and, per node, into requests within the node's
batch and payload bounds (`byte_chunks`). A node that fails answers False for the keys it had
not delivered yet; a value whose checksum fails is False and counted, and the connection stays
in use (the stream is still in step).

Threading: thread-safe; `load_into` may be called from any thread (each node's part borrows
its own pooled connection).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from memkv.client import metrics as m
from memkv.client.node import NodeClient
from memkv.client.nodeset import NodeSet, byte_chunks
from memkv.errors import MemKVError
from memkv.transport.base import LoadResult, Transport

log = logging.getLogger("memkv.client")


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, nodes: NodeSet) -> None:
        self._nodes = nodes

    @property
    def rdma_active(self) -> bool:
        return False

    def register_pool(self, view: memoryview) -> bool:
        return False  # nothing to register: the kernel copies into the buffer

    def load_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> LoadResult:
        return LoadResult(self.get_into(list(keys), list(views)))

    def get_into(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """GET frames over the keys' owners, values received in place; True where loaded."""
        nodes = self._nodes

        def run(node: NodeClient, idx: list[int]) -> list[bool]:
            sub_k = [keys[i] for i in idx]
            sub_v = [views[i] for i in idx]
            out: list[bool] = []
            try:
                for lo, hi in byte_chunks(node, sub_v):
                    t = time.perf_counter()
                    with node.connection() as conn:
                        got, bad = conn.way.get_into(sub_k[lo:hi], sub_v[lo:hi], nodes.checksummer)
                    m.SECONDS.labels("get").observe(time.perf_counter() - t)
                    m.REQUESTS.labels(node.name, "get", "ok").inc()
                    if bad:
                        m.INTEGRITY_FAILURES.labels(node.name).inc(bad)
                        log.warning("%s: %d value(s) failed checksum verification; treated as misses", node.name, bad)
                    m.BYTES.labels("in").inc(sum(len(v) for v, ok in zip(sub_v[lo:hi], got) if ok))
                    out += got
            except MemKVError as exc:
                nodes.count_failure(node, "get", exc)
                out += [False] * (len(idx) - len(out))
            return out

        return nodes.scatter(keys, run)
