"""`NodeSet`: the client core that the cluster client, the transports and the pipeline build on.

It holds the configured nodes (one `NodeClient` each, in configuration order), places keys on
them by weighted rendezvous hashing over that *configured* list (client/hrw.py), and fans a
batch out over the owners on a small executor, reassembling the results in the caller's order.
It also holds what every data path shares: the checksummer, the io timeout, and the request
metrics of one node's part of a batch (`timed`, `count_failure`).

Layering (imports point one way only):

    client/node.py      one node: connections, pool, health
    client/nodeset.py   the configured nodes, placement, fan-out (this module)
    transport/*         how values move (socket, shared memory, RDMA), built on the above
    client/pipeline.py  pipelined EXISTS / DELETE, built on a NodeSet
    client/cluster.py   `memkv.Client`: the public API over all of the above

Threading: a NodeSet is thread-safe. `scatter` runs the first node's part on the calling
thread and the others on the executor, in parallel; `run` callbacks must therefore be safe to
call from several threads at once (each call gets its own node and indices). `close` is
idempotent; after it the executor takes no more work and every node refuses to connect
(`NodeClient.borrow` raises ConnectError), so a call racing with close answers like a failed
node (a miss), never a hang.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from memkv import protocol as p
from memkv.client import metrics as m
from memkv.client.hrw import RendezvousRing
from memkv.client.node import NodeClient
from memkv.errors import MemKVError, NodeUnavailable
from memkv.integrity import Checksummer

log = logging.getLogger("memkv.client")

T = TypeVar("T")

# Executor size: enough for every pooled connection of a few nodes, bounded both ways so a
# one-node client still overlaps a slow connect and a large cluster does not spawn hundreds.
_MIN_WORKERS = 4
_MAX_WORKERS = 64


class NodeSet:
    """The configured nodes of one client, their placement and the executor. Thread-safe."""

    def __init__(
        self,
        nodes: Sequence[NodeClient],
        weights: Sequence[float],
        checksummer: Checksummer,
        io_timeout_s: float,
        pool_size: int,
    ) -> None:
        if not nodes:
            raise ValueError("a NodeSet needs at least one node")
        self.nodes: list[NodeClient] = list(nodes)
        self.checksummer = checksummer
        self.io_timeout_s = io_timeout_s
        self.ring = RendezvousRing([n.name for n in self.nodes], list(weights))
        workers = min(_MAX_WORKERS, max(_MIN_WORKERS, len(self.nodes) * pool_size))
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="memkv-client")

    # -- placement --------------------------------------------------------------------------------

    def owner(self, key: bytes) -> NodeClient:
        return self.nodes[self.ring.owner(key)]

    def group(self, keys: list[bytes]) -> dict[int, list[int]]:
        """Key indices by owning node (index into `nodes`), each list in the caller's order."""
        if len(self.nodes) == 1:
            return {0: list(range(len(keys)))}
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(self.ring.owners(keys)):
            groups.setdefault(n, []).append(i)
        return groups

    def named(self, name: str) -> NodeClient:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ValueError(f"{name} is not a configured server ({[n.name for n in self.nodes]})")

    # -- fan-out ----------------------------------------------------------------------------------

    def scatter(self, keys: list[bytes], run: Callable[[NodeClient, list[int]], list[T]]) -> list[T]:
        """Group key indices by owner, run each node's part (in parallel when several), and
        reassemble results in the caller's order. `run(node, indices)` returns one result per
        index; it is expected to turn node failures into results (misses), not raise."""
        if not keys:
            return []
        if len(self.nodes) == 1:
            return run(self.nodes[0], list(range(len(keys))))
        parts = list(self.group(keys).items())
        out: list[T | None] = [None] * len(keys)
        inline = [parts[0]]
        futures = []
        for n, idx in parts[1:]:
            try:
                futures.append((idx, self.executor.submit(run, self.nodes[n], idx)))
            except RuntimeError:  # close() shut the executor meanwhile: here the closed node fails fast
                inline.append((n, idx))
        for n, idx in inline:
            for i, r in zip(idx, run(self.nodes[n], idx)):
                out[i] = r
        for idx, fut in futures:
            for i, r in zip(idx, fut.result()):
                out[i] = r
        return out  # type: ignore[return-value]  # every index was filled by exactly one part

    # -- per-node request bookkeeping ---------------------------------------------------------------

    def timed(self, node: NodeClient, op: str, fn: Callable[[], T]) -> T:
        """Run one request to `node`, observing its latency and counting it as ok."""
        t = time.perf_counter()
        out = fn()
        m.SECONDS.labels(op).observe(time.perf_counter() - t)
        m.REQUESTS.labels(node.name, op, "ok").inc()
        return out

    def count_failure(self, node: NodeClient, op: str, exc: MemKVError) -> None:
        """Count a failed request: "down" when the node was marked down (no I/O), else "error"."""
        result = "down" if isinstance(exc, NodeUnavailable) else "error"
        m.REQUESTS.labels(node.name, op, result).inc()
        if result == "error":
            log.debug("%s %s failed: %s", node.name, op, exc)

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the executor's running parts, then close every node's connections."""
        self.executor.shutdown(wait=True)
        for node in self.nodes:
            node.close()


def chunks(node: NodeClient, keys: list[bytes]) -> Iterator[list[bytes]]:
    """`keys` cut into requests of at most the node's max_batch keys."""
    step = (node.limits or p.Limits()).max_batch
    for i in range(0, len(keys), step):
        yield keys[i : i + step]


def byte_chunks(node: NodeClient, views: Sequence[memoryview]) -> Iterator[tuple[int, int]]:
    """(lo, hi) ranges of `views` such that no request exceeds the node's batch or payload bounds."""
    limits = node.limits or p.Limits()
    lo, size = 0, 0
    for i, v in enumerate(views):
        if i > lo and (i - lo >= limits.max_batch or size + len(v) > limits.max_payload_bytes):
            yield lo, i
            lo, size = i, 0
        size += len(v)
    if lo < len(views):
        yield lo, len(views)


__all__ = ["NodeSet", "byte_chunks", "chunks"]
