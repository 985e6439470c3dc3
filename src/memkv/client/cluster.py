"""`memkv.Client`: the cluster client. HRW placement, per-node pools, batched zero-copy I/O.

Placement: a key's owner is computed by weighted rendezvous hashing over the *configured*
server list (client/hrw.py). A node that is marked down keeps its keys: reads of them answer
MISS and writes fail fast until its retry time, so there is only ever one placement and no
orphan copies appear on other nodes.

Failure semantics (what callers can rely on):
  * reads (`get`, `exists`, `batch_get_into`) never raise for a node failure: the affected
    keys answer miss / False. A value counts as loaded only when it arrived whole and its
    checksum verified; anything else is False, whatever bytes reached the buffer.
  * `exists` and `delete` read every node's replies as they arrive (memkv.client.pipeline):
    a silent node delays only its own keys' answers, which `exists(on_answer=...)` and
    `exists_stream()` hand over per node; `exists(timeout_s=...)` stops waiting for them.
  * batch writes (`batch_put_views`, `delete`) report per-key success and never raise for a
    node failure; the single-key `put` raises (NodeUnavailable, TransportError, ...).
  * `lease` / `release` follow `exists`: an unreachable node's keys answer False (not leased;
    a lease that may have been granted anyway expires by itself), `timeout_s` bounds the wait.
    A leased value cannot be evicted, deleted or overwritten on its node until the lease
    expires or is released (docs/protocol.md section 11); leases are this client's own (one
    random token per Client), renewed by leasing again, and end when the node restarts.
  * `probe()`, `exists_on()` and `lease_on()` raise, naming the server: they exist to surface problems.
  * `list_keys()` asks every server and never raises for a node failure: the listing names
    each server that did not answer (its keys are missing from it) in `failed`.
  * usage errors (a key over 480 bytes, a value over the node's limit, a buffer that is not
    contiguous) raise ValueError/LocalProtocolError before anything is sent.

Lifecycle (`Client.state`, a `ClientState`): UNOPENED until the first call (the constructor
never connects), OPENED from then on, CLOSED after `close()` (or the end of a `with` block).
Every public method of a closed client raises `memkv.ClientClosed` (a usage error: a
RuntimeError, not a MemKVError), reads included; `close()` itself is idempotent.

Structure: the configured nodes, placement and fan-out are the client core
(memkv.client.nodeset.NodeSet); loads go through a transport built on that core
(memkv.transport), EXISTS/DELETE through a pipeline built on it (memkv.client.pipeline). This
module is the public API over them: key and buffer checks, stores, metrics of whole calls.

Threading: a Client is thread-safe and meant to be shared; batches that span several nodes
run their per-node parts in parallel on a small internal executor, one part inline (EXISTS
and DELETE instead pipeline every node on the calling thread; only connects go to the
executor). An `exists_stream()` pipeline belongs to one thread; see its docstring. `close()`
may be called from any thread; a call already running when it happens ends like a call to a
failed node (misses, or the error of a single-key `put`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memkv import protocol as p
from memkv.client import metrics as m
from memkv.client.node import Connect, NodeClient, tcp_connect
from memkv.client.nodeset import NodeSet, byte_chunks, chunks
from memkv.client.pipeline import StatusPipeline
from memkv.config import ClientConfig, ServerAddress
from memkv.errors import ClientClosed, MemKVError, ServerError
from memkv.integrity import Checksummer, parse_integrity
from memkv.transport import LoadResult, open_way, select_transport

log = logging.getLogger("memkv.client")

KeyLike = bytes | str


def _keys(keys: Sequence[KeyLike]) -> list[bytes]:
    """Validated key list; the all-bytes batch (the tier's case) is checked at C speed."""
    if all(type(k) is bytes for k in keys):
        if keys and (min(map(len, keys)) == 0 or max(map(len, keys)) > p.DEFAULT_MAX_KEY_BYTES):
            return [_key(k) for k in keys]  # let _key name the bad one
        return list(keys)  # type: ignore[arg-type]  # all bytes: checked just above
    return [_key(k) for k in keys]


def _key(k: KeyLike) -> bytes:
    if isinstance(k, str):
        key = k.encode()
    elif isinstance(k, (bytes, bytearray, memoryview)):
        key = bytes(k)
    else:
        raise TypeError(f"keys must be bytes or str, got {type(k).__name__}")
    if not 0 < len(key) <= p.DEFAULT_MAX_KEY_BYTES:
        # A usage error, raised before any I/O: it must not read as a node failure (a miss).
        raise ValueError(f"keys must be 1..{p.DEFAULT_MAX_KEY_BYTES} bytes, got {len(key)}: {key[:64]!r}")
    return key


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a caller's buffer, without copying."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous (a CPU-pool row or a bytearray slice)")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class ClientState(enum.Enum):
    """Where a Client is in its life (`Client.state`)."""

    UNOPENED = 1  # constructed: nothing connected yet (the constructor never connects)
    OPENED = 2  # a call was made or a `with` block entered: connections may be pooled
    CLOSED = 3  # close() ran: connections closed; every method raises ClientClosed


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    server: str
    node_id: str
    rtt_ms: float
    max_value_bytes: int


@dataclasses.dataclass(frozen=True)
class ListedKey:
    key: bytes
    length: int  # bytes of the stored value
    server: str  # the server that holds it


@dataclasses.dataclass(frozen=True)
class KeyListing:
    """What `Client.list_keys` found. `keys` is in ascending byte order and complete up to
    `limit` for the servers that answered; `failed` maps each server that did not to why."""

    keys: tuple[ListedKey, ...]
    truncated: bool  # more keys matched than `limit` (on the servers that answered)
    failed: dict[str, str]

    @property
    def complete(self) -> bool:
        """Every server answered (the listing may still be truncated)."""
        return not self.failed


class Client:
    """A MemKV cluster client. See the module docstring for the failure semantics and the
    lifecycle; every method raises ClientClosed once the client is closed."""

    def __init__(self, config: ClientConfig, *, connect: Connect = tcp_connect) -> None:
        """Build a client; nothing connects until the first call. `connect` is the socket seam
        (`memkv.client.node.Connect`): how each connection's socket is made, TCP by default.
        With `config.tls` each socket it makes is wrapped in TLS (memkv/tls.py); the CA and
        certificate files are read here (a ConfigError names a missing one)."""
        self.config = config
        if config.tls is not None:
            from memkv.tls import client_connect

            connect = client_connect(config.tls, connect)
        self.checksummer = Checksummer(config.auth_key.raw, parse_integrity(config.integrity))
        nodes = [
            NodeClient(
                addr,
                config.auth_key.raw,
                pool_size=config.pool_size,
                connect_timeout_s=config.connect_timeout_s,
                io_timeout_s=config.io_timeout_s,
                down_for_s=config.down_for_s,
                checksummer=self.checksummer,
                open_way=open_way,
                on_health=self._on_health,
                connect=connect,
                local_socket=config.local_socket and config.tls is None,
                shared_memory=config.shared_memory,
            )
            for addr in config.servers
        ]
        self._nodeset = NodeSet(
            nodes, [a.weight for a in config.servers], self.checksummer, config.io_timeout_s, config.pool_size
        )
        self._nodes = self._nodeset.nodes  # in configuration order (the CLI and the tier iterate them)
        self._state = ClientState.UNOPENED
        self._state_lock = threading.Lock()
        self.lease_token = secrets.randbits(64)  # names this client's leases on every node
        try:
            self._transport = select_transport(self._nodeset, config)  # MEMKV_TRANSPORT (memkv/transport)
        except BaseException:
            self._nodeset.close()  # the executor's threads must not outlive a client that never was
            raise
        for node in nodes:
            m.SERVER_UP.labels(node.name).set(1)
        if config.prometheus_bind:
            m.start_exporter(*config.prometheus_bind)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Client:
        """Build from MEMKV_CONFIG / the MEMKV_* variables (see memkv.config)."""
        return cls(ClientConfig.from_env(env))

    def __enter__(self) -> Client:
        self._use()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(servers={[n.name for n in self._nodes]}, state={self._state.name})"

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def state(self) -> ClientState:
        return self._state

    def _use(self) -> None:
        """Every public method starts here: a closed client refuses, an unopened one opens."""
        state = self._state
        if state is ClientState.OPENED:
            return
        if state is ClientState.CLOSED:
            raise ClientClosed("this memkv.Client is closed; create a new one")
        with self._state_lock:
            if self._state is ClientState.CLOSED:
                raise ClientClosed("this memkv.Client is closed; create a new one")
            self._state = ClientState.OPENED

    def close(self) -> None:
        """Close every connection and release the transport. Idempotent, any thread."""
        with self._state_lock:
            if self._state is ClientState.CLOSED:
                return
            self._state = ClientState.CLOSED
        self._nodeset.close()
        self._transport.close()  # after the connections: a node drops our RDMA metadata when they close

    # -- topology -------------------------------------------------------------------------------

    def servers(self) -> list[ServerAddress]:
        self._use()
        return list(self.config.servers)

    def owner(self, key: KeyLike) -> ServerAddress:
        self._use()
        return self.config.servers[self._nodeset.ring.owner(_key(key))]

    def local_servers(self) -> list[str]:
        """The servers whose connections go to their same-host socket (docs/protocol.md section 2.6):
        known once a connection to each was made (after `probe`, for example)."""
        self._use()
        return [node.name for node in self._nodes if node.local]

    def shared_memory_servers(self) -> list[str]:
        """The servers whose values this client copies from their shared memory (docs/protocol.md
        section 13): same-host ones that offer it, with `shared_memory` on here."""
        self._use()
        return [node.name for node in self._nodes if node.shared]

    def has_rdma(self) -> bool:
        """True while loads into the registered pool move by RDMA (MEMKV_TRANSPORT, docs/rdma.md):
        False before `register_pool`, with the TCP transport, and after `auto` latched to TCP."""
        self._use()
        return self._transport.rdma_active

    def register_pool(self, buffer: Any) -> bool:
        """Register the whole destination pool once (the tier's CPU pool) so that nodes can
        WRITE loads straight into it. Returns has_rdma(). With MEMKV_TRANSPORT=rdma a pool that
        cannot be used over RDMA raises RdmaError (a MemKVError); `auto` falls back to TCP."""
        self._use()
        return self._transport.register_pool(_byte_view(buffer))

    def health(self) -> list[dict[str, Any]]:
        self._use()
        return [
            {
                "server": n.name,
                "up": not n.is_down,
                "failures": n.failures,
                "last_error": n.last_error,
                "busy_timeouts": n.busy_timeouts,
                "node_id": n.node_id,
            }
            for n in self._nodes
        ]

    def _on_health(self, server: str, failure: str | None) -> None:
        """`failure`: why the node was marked down, None when it is usable again."""
        m.SERVER_UP.labels(server).set(0 if failure else 1)
        if failure:
            log.warning("memkv server %s marked down for %.1fs: %s", server, self.config.down_for_s, failure)

    # -- single-key convenience -------------------------------------------------------------------

    def put(self, key: KeyLike, value: Any) -> None:
        """Store one value. Raises on failure (NodeUnavailable, TransportError, ServerError)."""
        self._use()
        k = _key(key)
        node = self._nodeset.owner(k)
        view = _byte_view(value)
        statuses = self._put_on(node, [k], [view], raise_errors=True)
        if statuses[0] != p.ItemStatus.OK:
            raise ServerError(f"{node.name}: value not stored ({p.ItemStatus(statuses[0]).name})", statuses[0])

    def get(self, key: KeyLike) -> bytes | None:
        """One value as bytes, or None on a miss (including an unreachable node)."""
        self._use()
        k = _key(key)
        node = self._nodeset.owner(k)
        try:
            with node.connection() as conn:
                t = time.perf_counter()
                (value,), bad_sums = conn.way.get_values([k], self.checksummer)
            m.SECONDS.labels("get").observe(time.perf_counter() - t)
            m.REQUESTS.labels(node.name, "get", "ok").inc()
        except MemKVError as exc:
            self._nodeset.count_failure(node, "get", exc)
            return None
        if bad_sums:  # as every read path counts it (memkv/transport)
            m.INTEGRITY_FAILURES.labels(node.name).inc(bad_sums)
            log.warning("%s: a value failed checksum verification; treated as a miss", node.name)
        m.KEYS.labels("get", "hit" if value is not None else "miss").inc()
        if value is not None:
            m.BYTES.labels("in").inc(len(value))
        return value

    # -- batches ----------------------------------------------------------------------------------

    def exists(
        self,
        keys: Sequence[KeyLike],
        *,
        on_answer: Callable[[list[int], list[bool]], None] | None = None,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Which keys are stored. An unreachable node's keys answer False.

        Partial results: `on_answer(indices, hits)` is called (on this thread, before `exists`
        returns) as each node's answers arrive, so the keys of healthy nodes are known while a
        stopped node is still silent; every key is passed exactly once. `timeout_s` returns
        after at most that long: keys not answered by then answer False (their connections are
        closed, never reused half-read; the node is not marked down for it)."""
        self._use()
        return self._status_batch("exists", _keys(keys), p.ExistsRequest, on_answer, timeout_s)

    def exists_stream(self) -> StatusPipeline:
        """A long-lived EXISTS pipeline for one thread (the vLLM tier's lookup thread):
        `submit(keys, on_answer)` sends at once and never waits, `poll(timeout_s)` delivers
        answers as they arrive, `wake()` (any thread) interrupts a `poll`, `close()` ends it.
        A node that stops answering holds only its own keys. See memkv.client.pipeline."""
        self._use()
        return StatusPipeline(self._nodeset, "exists", p.ExistsRequest, check_keys=_keys, wakeable=True)

    def exists_on(self, server: ServerAddress | str, keys: Sequence[KeyLike]) -> list[bool]:
        """Ask one server directly (ignores placement and the down mark). Raises on failure."""
        self._use()
        node = self._nodeset.named(str(server))
        ks = [_key(k) for k in keys]
        out: list[bool] = []
        with node.connection(fail_fast=False) as conn:
            for chunk in chunks(node, ks):
                reply = conn.request(p.ExistsRequest(tuple(chunk)))
                assert isinstance(reply, p.StatusReply)
                out += [s == p.ItemStatus.OK for s in reply.statuses]
        return out

    def lease(
        self,
        keys: Sequence[KeyLike],
        ttl_s: float,
        *,
        on_answer: Callable[[list[int], list[bool]], None] | None = None,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Lease the keys' values for `ttl_s` (each node caps it: `lease_on` says by how much),
        or renew this client's leases of them. True where the value exists and is leased; False
        on a miss, on a lease beyond the node's bounds, and for an unreachable node's keys.
        `on_answer` and `timeout_s` as for `exists`."""
        self._use()
        return self._status_batch("lease", _keys(keys), self._lease_request(ttl_s), on_answer, timeout_s)

    def lease_stream(self, ttl_s: float) -> StatusPipeline:
        """A long-lived LEASE pipeline for one thread, as `exists_stream` (the direct mode's
        lookup thread): every key submitted is leased for `ttl_s` under this client's token."""
        self._use()
        return StatusPipeline(self._nodeset, "lease", self._lease_request(ttl_s), check_keys=_keys, wakeable=True)

    def release(self, keys: Sequence[KeyLike], *, timeout_s: float | None = None) -> list[bool]:
        """End this client's leases of the keys early; True where one ended. An unreachable
        node's keys answer False (their leases expire by themselves)."""
        self._use()
        token = self.lease_token
        return self._status_batch("release", _keys(keys), lambda ks: p.ReleaseRequest(ks, token), None, timeout_s)

    def lease_on(self, server: ServerAddress | str, keys: Sequence[KeyLike], ttl_s: float) -> p.LeaseReply:
        """LEASE on one server directly (ignores placement and the down mark), for checks: the
        reply has each key's status and length and the ttl the node granted. Raises on failure."""
        self._use()
        node = self._nodeset.named(str(server))
        with node.connection(fail_fast=False) as conn:
            reply = conn.request(self._lease_request(ttl_s)(tuple(_key(k) for k in keys)))
        assert isinstance(reply, p.LeaseReply)  # one status per key: NodeConnection.matched
        return reply

    def _lease_request(self, ttl_s: float) -> Callable[[tuple[bytes, ...]], p.Request]:
        ttl_ms = int(ttl_s * 1000)
        if not 1 <= ttl_ms <= p.MAX_LEASE_MS:
            raise ValueError(f"ttl_s must be 0.001..{p.MAX_LEASE_MS / 1000:g}, got {ttl_s}")
        token = self.lease_token
        return lambda keys: p.LeaseRequest(keys, ttl_ms, token)

    def delete(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Delete keys; True where a value was deleted. An unreachable node's keys answer False, and
        so does a leased value: it is removed when its last lease ends (EXISTS misses it at once)."""
        self._use()
        return self._status_batch("delete", _keys(keys), p.DeleteRequest)

    def batch_put_views(self, items: Sequence[tuple[KeyLike, Any]]) -> list[bool]:
        """Store (key, buffer) pairs; each buffer is sent from the caller's memory in place.
        Returns per item whether the node stored it."""
        self._use()
        ks = [_key(k) for k, _ in items]
        views = [_byte_view(v) for _, v in items]
        limit = self._max_value_bytes()
        for k, v in zip(ks, views):
            if len(v) > limit:
                raise ValueError(f"value for key {k[:64]!r} is {len(v)} bytes; the node's limit is {limit}")

        def run(node: NodeClient, idx: list[int]) -> list[bool]:
            try:
                st = self._put_on(node, [ks[i] for i in idx], [views[i] for i in idx], raise_errors=False)
            except MemKVError:
                return [False] * len(idx)
            return [s == p.ItemStatus.OK for s in st]

        return self._nodeset.scatter(ks, run)

    def batch_get_into(self, items: Sequence[tuple[KeyLike, Any]]) -> list[bool]:
        """Load values into the caller's buffers in place. True only where the stored value had
        exactly the buffer's length, arrived whole and verified; False is a miss (the buffer's
        content is then unspecified)."""
        return self.batch_load_into(items).ok

    def batch_load_into(self, items: Sequence[tuple[KeyLike, Any]]) -> LoadResult:
        """`batch_get_into` plus `may_land_late`: True when a node may still write into a buffer
        whose load failed (RDMA; see memkv.transport.LoadResult). Such a buffer must not be
        reused until no write can arrive (the tier withholds the job for load_failure_grace_s)."""
        self._use()
        ks = [_key(k) for k, _ in items]
        views = [_byte_view(v) for _, v in items]
        for v in views:
            if v.readonly:
                raise ValueError("batch_get_into needs writable buffers")
        result = self._transport.load_into(ks, views)
        hits = sum(result.ok)
        m.KEYS.labels("get", "hit").inc(hits)
        m.KEYS.labels("get", "miss").inc(len(result.ok) - hits)
        return result

    def list_keys(self, prefix: KeyLike = b"", limit: int = 1000) -> KeyListing:
        """The first `limit` stored keys (byte order) that start with `prefix`, over every
        configured server, with each value's length and server. For operators: each node scans
        all its keys. Servers are asked in parallel, ignoring down marks; a server that fails is
        reported in `failed` (never raised), so a partial listing never passes for a whole one."""
        self._use()
        pre = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        if len(pre) > p.DEFAULT_MAX_KEY_BYTES:
            raise ValueError(f"a key prefix must be 0..{p.DEFAULT_MAX_KEY_BYTES} bytes, got {len(pre)}")
        most = p.Limits().max_list_keys
        if not 1 <= limit <= most:
            raise ValueError(f"limit must be 1..{most}, got {limit}")

        def ask(node: NodeClient) -> p.ListReply:
            return self._nodeset.timed(node, "list", lambda: node.list_keys(pre, limit))

        # Every node holds its share of a prefix (HRW spreads keys), so every node is asked;
        # in parallel, so a dead node costs one timeout, not one per node.
        futures = [(node, self._nodeset.executor.submit(ask, node)) for node in self._nodes]
        found: list[ListedKey] = []
        failed: dict[str, str] = {}
        truncated = False
        for node, fut in futures:
            try:
                reply = fut.result()
            except MemKVError as exc:
                self._nodeset.count_failure(node, "list", exc)
                failed[node.name] = str(exc)
                continue
            truncated |= reply.truncated
            found += [ListedKey(k, n, node.name) for k, n in zip(reply.keys, reply.lengths)]
        # Each node sent its own first `limit` keys, so the first `limit` of the union are the
        # cluster's first `limit`.
        found.sort(key=lambda e: e.key)
        truncated |= len(found) > limit
        return KeyListing(tuple(found[:limit]), truncated, failed)

    # -- health checks ----------------------------------------------------------------------------

    def probe(self) -> list[ProbeResult]:
        """One authenticated round trip to every configured server, in order. Raises the first
        failure, naming the server (connect error, wrong auth key, not a MemKV node...)."""
        self._use()
        results = []
        for node in self._nodes:
            rtt = node.ping()
            assert node.limits is not None
            results.append(ProbeResult(node.name, node.node_id or "", rtt * 1000, node.limits.max_value_bytes))
        return results

    # -- internals --------------------------------------------------------------------------------

    def _max_value_bytes(self) -> int:
        known = [n.limits.max_value_bytes for n in self._nodes if n.limits]
        return min(known) if known else p.DEFAULT_MAX_VALUE_BYTES

    def _status_batch(
        self,
        op: str,
        keys: list[bytes],
        request: Callable[[tuple[bytes, ...]], p.Request],
        on_answer: Callable[[list[int], list[bool]], None] | None = None,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """EXISTS / DELETE / LEASE / RELEASE over the keys' owners, pipelined on this thread: every node's
        requests are sent at once and replies are read in the order they arrive (poll over the
        connections), so a batch costs about one round trip of the slowest node, no thread
        handoff, and a silent node delays no other node's answers (`on_answer`). A node that
        fails answers False for its keys; see memkv.client.pipeline."""
        out = [False] * len(keys)
        if not keys:
            return out

        def answer(idx: list[int], hits: list[bool]) -> None:
            for i, hit in zip(idx, hits):
                out[i] = hit
            if on_answer is not None:
                on_answer(idx, hits)

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pipe = StatusPipeline(self._nodeset, op, request)
        try:
            pipe.submit(keys, answer)
            # Bounded: each node answers, fails its io_timeout_s or its connect, or `deadline` passes.
            while pipe.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                pipe.poll(left)
        finally:
            pipe.close()  # what is still outstanding answers False; every connection goes back
        return out

    def _put_on(self, node: NodeClient, keys: list[bytes], views: list[memoryview], raise_errors: bool) -> bytes:
        statuses = bytearray()
        try:
            for lo, hi in byte_chunks(node, views):
                part = views[lo:hi]
                put = functools.partial(node.put, keys[lo:hi], part, self.checksummer)  # it hashes them
                statuses += self._nodeset.timed(node, "put", put)
                m.BYTES.labels("out").inc(sum(len(v) for v in part))
        except MemKVError as exc:
            self._nodeset.count_failure(node, "put", exc)
            if raise_errors:
                raise
            statuses += bytes([p.ItemStatus.MISS]) * (len(keys) - len(statuses))
        ok = sum(1 for s in statuses if s == p.ItemStatus.OK)
        m.KEYS.labels("put", "ok").inc(ok)
        m.KEYS.labels("put", "failed").inc(len(statuses) - ok)
        return bytes(statuses)
