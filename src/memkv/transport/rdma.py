"""The RDMA transport (client side): loads land by server-driven RDMA WRITE into the pool.

Data path of a load (docs/rdma.md has the picture):
  1. once: `register_pool(view)` registers the whole destination pool (the tier's CPU pool)
     as one region with NIXL, and every node's first connection gets RDMA_ATTACH with this
     agent's metadata (~300 bytes: connection info and the region's key). The metadata only
     ever travels inside an authenticated, MACed frame, after the handshake;
  2. per batch and node: one RDMA_GET (keys, exact lengths, slot addresses, a window, a token)
     on an authenticated connection, or with MEMKV_RDMA_PIPELINE_MB set, several of about that
     many bytes, all sent at once; for each, the node WRITEs its values into the slots in one
     transfer whose notification is the token, and answers with per-key statuses and checksums;
  3. the client reads the replies in turn; for each it waits for the token's notification, then
     verifies each slot's checksum over the bytes that landed (pipelined: while the node writes
     the next request's values). Only then is the block reported loaded.

Which buffers: only views that lie inside the registered pool go over RDMA; any other buffer
(a bytearray of a CLI call, a benchmark's scratch) takes the TCP path.

Slot safety: `LoadResult.may_land_late` is True when a failed item's WRITE may have been
posted and its completion was not seen (a reply that timed out or never came, a
TRANSFER_FAILED status, a missing notification, a checksum mismatch). The caller (the tier)
withholds such a job for load_failure_grace_s. A MISS or SIZE_MISMATCH was never written.

Modes: `auto` latches to TCP for the rest of the client's life on the first RDMA failure
(logged once at WARNING); items whose WRITE was never posted (the node refused the attach)
are retried over TCP at once, the others fail and are withheld. `rdma` never falls back:
startup fails without RDMA, and a failed RDMA load is a failed load.

Threading: thread-safe. `_lock` guards the agent, the registration and the latch; `_attached`
(connection -> the node's agent name) is only touched by the thread that borrowed the
connection; `_NotifInbox` has its own lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Sequence

from memkv import protocol as p
from memkv.client import metrics as m
from memkv.client.node import NodeClient, NodeConnection
from memkv.client.nodeset import NodeSet
from memkv.errors import ConfigError, MemKVError, RdmaError, RemoteProtocolError, ServerError
from memkv.nixl_adapter import NixlAgent, Registration, buffer_address
from memkv.transport.base import LoadResult, Transport
from memkv.transport.tcp import TcpTransport

log = logging.getLogger("memkv.client")

# The node starts no write later than this share of the client's io_timeout_s after it got
# the request, so its reply (sent when the write completed or the window closed) arrives
# before the client's read timeout.
WINDOW_SHARE = 0.5
ATTACH_TIMEOUT_S = 10.0  # at least this long for an RDMA_ATTACH reply (see _attach)
ENV_PIPELINE_MB = "MEMKV_RDMA_PIPELINE_MB"
# Off by default: over UCX cma (the node's CPU copies) 16 MiB parts were 4-8% slower than one
# RDMA_GET per batch, inside vLLM and outside (docs/archive/performance-log.md, runs 39-40). A host whose
# NIC does the writes may gain from verifying one part while the next is written.
DEFAULT_PIPELINE_MB = 0


def pipeline_bytes() -> int:
    """MEMKV_RDMA_PIPELINE_MB, checked: the bytes of one RDMA_GET within a node's batch (0: the
    whole batch in one RDMA_GET)."""
    text = os.environ.get(ENV_PIPELINE_MB, "").strip()
    if not text:
        return DEFAULT_PIPELINE_MB << 20
    if not text.isdigit() or int(text) > 65536:
        raise ConfigError(f"{ENV_PIPELINE_MB}: expected MiB in 0..65536, got {text!r}")
    return int(text) << 20


def pipeline_parts(lengths: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """`(lo, hi)` ranges of consecutive values, each at most `limit` bytes or one value (a value
    larger than `limit` goes alone); `limit` 0 keeps them all in one range."""
    if not lengths:
        return []
    if limit <= 0:
        return [(0, len(lengths))]
    parts = []
    lo, size = 0, 0
    for i, length in enumerate(lengths):
        if i > lo and size + length > limit:
            parts.append((lo, i))
            lo, size = i, 0
        size += length
    parts.append((lo, len(lengths)))
    return parts


class RdmaRefused(RdmaError):
    """A node answered RDMA_ATTACH with a refusal: nothing was written, the TCP path is fine.
    `connection_closed`: the node answered with an ERROR frame (a node that predates RDMA:
    UNKNOWN_OPCODE) and closed the connection."""

    def __init__(self, message: str, connection_closed: bool = False) -> None:
        super().__init__(message)
        self.connection_closed = connection_closed


class _Ticket:
    """One expected notification: `(peer, message)`; `arrived` once it came (`event` then set)."""

    __slots__ = ("arrived", "event", "key")

    def __init__(self, key: tuple[str, bytes]) -> None:
        self.key = key
        self.event = threading.Event()
        self.arrived = False


class _NotifInbox:
    """Notifications of one agent, handed to the loading thread that waits for each.

    A loader takes a ticket (`expect`) *before* it sends its RDMA_GET, so no notification of
    its own can come before the inbox knows whom it belongs to; a notification with no ticket
    (its loader gave up, a duplicate, another client's token) is dropped and counted in
    `dropped`. `wait(ticket, deadline)` reads NIXL's new notifications itself when no other
    loader is reading at that moment (`_reading` is only ever tried, never waited for) and
    wakes the tickets of every notification it read; otherwise, or when its own has not come
    yet, it waits on its ticket's event, without the GIL, for 20 us doubling to 1 ms, and
    tries again, until the deadline. So the common case (the notification is there when the
    reply arrives) costs one NIXL call, and a loader never queues for the GIL while holding a
    lock that other loaders wait on. NIXL's getNotifs releases the GIL inside (nixl 1.5.1).

    Why no notification thread: one was built (it read NIXL while loaders slept on their
    events) and measured in the same run as this inbox under a busy scheduler: no difference
    (RDMA / TCP 0.90 vs 0.92, docs/archive/performance-log.md "RDMA vs TCP under a busy scheduler"), and
    under a scheduler that holds the GIL every hand-off between threads costs a GIL
    acquisition (a thread that reads and wakes the loader needs three where the loader
    reading itself needs one). `close()` wakes every waiting loader (its wait returns False)."""

    POLL_MIN_S = 20e-6
    POLL_MAX_S = 1e-3

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self._lock = threading.Lock()  # guards _tickets, _closed, dropped; never held in NIXL
        self._tickets: dict[tuple[str, bytes], _Ticket] = {}
        self._closed = False
        self._reading = threading.Lock()  # one reader of NIXL's notifications at a time (only tried)
        self.dropped = 0  # notifications that had no ticket (late, duplicate, unknown)

    def expect(self, peer: str, notif: bytes) -> _Ticket:
        """A ticket for the notification `notif` from `peer`; take it before the request goes."""
        ticket = _Ticket((peer, notif))
        with self._lock:
            if self._closed:
                raise RdmaError("the RDMA transport is closed")
            if ticket.key in self._tickets:  # tokens are unique per client: a bug, not a peer's doing
                raise ValueError(f"a notification {notif!r} from {peer} is already expected")
            self._tickets[ticket.key] = ticket
        return ticket

    def cancel(self, ticket: _Ticket) -> None:
        """Give up a ticket (the request was never sent, nothing was written, or it failed)."""
        with self._lock:
            if self._tickets.get(ticket.key) is ticket:
                del self._tickets[ticket.key]

    @property
    def expected(self) -> int:
        """Tickets outstanding (for tests: 0 once every load has returned)."""
        with self._lock:
            return len(self._tickets)

    def wait(self, ticket: _Ticket, deadline: float) -> bool:
        """True once the ticket's notification arrived; False at `deadline` or on close. The
        ticket is spent either way (a notification arriving after this is dropped). Raises
        RdmaError when NIXL fails to read notifications."""
        pause = self.POLL_MIN_S
        try:
            while True:  # bounded by the deadline
                if ticket.event.is_set():
                    return ticket.arrived
                if self._reading.acquire(blocking=False):
                    try:
                        self._read()
                    finally:
                        self._reading.release()
                    if ticket.event.is_set():
                        return ticket.arrived
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                ticket.event.wait(min(pause, remaining))  # set at once by whoever reads it
                pause = min(2 * pause, self.POLL_MAX_S)
        finally:
            self.cancel(ticket)

    def _read(self) -> None:
        """Take NIXL's new notifications and wake their tickets. The caller holds `_reading`."""
        got = self._agent.take_notifs()
        if not got:
            return
        with self._lock:
            for sender, messages in got.items():
                for msg in messages:
                    ticket = self._tickets.pop((sender, msg), None)
                    if ticket is None:
                        self.dropped += 1
                        continue
                    ticket.arrived = True
                    ticket.event.set()

    def close(self) -> None:
        """Wake every waiting loader (their waits return False); later tickets are refused."""
        with self._lock:
            self._closed = True
            tickets = list(self._tickets.values())
            self._tickets.clear()
        for ticket in tickets:
            ticket.event.set()  # arrived stays False


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(self, nodes: NodeSet, mode: str, devices: Sequence[str] = ()) -> None:
        assert mode in ("auto", "rdma")
        self._nodes = nodes
        self._tcp = TcpTransport(nodes)  # buffers outside the pool, and `auto` after the latch
        self.mode = mode
        self._devices = tuple(devices)
        self._lock = threading.Lock()
        self._agent: NixlAgent | None = None
        self._pool: Registration | None = None
        self._metadata = b""
        self._latched: str | None = None
        self._attached: weakref.WeakKeyDictionary[NodeConnection, str] = weakref.WeakKeyDictionary()
        self._tokens = itertools.count(1)
        self._inbox: _NotifInbox | None = None  # with the agent
        self._warned = False
        self.register_ms: float | None = None  # how long NIXL took to register the pool
        self.pipeline_bytes = pipeline_bytes()  # raises ConfigError at startup

    @property
    def rdma_active(self) -> bool:
        return self._pool is not None and self._latched is None

    # -- startup ----------------------------------------------------------------------------------

    def register_pool(self, view: memoryview) -> bool:
        address = buffer_address(view)
        with self._lock:
            if self._pool is not None:
                if (self._pool.address, self._pool.length) != (address, len(view)):
                    raise ValueError("this client already registered a pool; register one pool per client")
                return self.rdma_active
            if self._latched is not None:
                return False
            agent = None
            error = None
            try:
                agent = NixlAgent("client", self._devices)
                t = time.perf_counter()
                pool = agent.register(address, len(view))
                took_ms = (time.perf_counter() - t) * 1000
                metadata = agent.metadata()
            except RdmaError as exc:
                if agent is not None:
                    agent.close()
                error = f"cannot register the pool: {exc}"
            else:
                self._agent, self._pool, self._metadata = agent, pool, metadata
                self._inbox = _NotifInbox(agent)
                self.register_ms = took_ms
        if error is not None or agent is None:
            self._give_up(error or "no NIXL agent")
            return False
        log.info(
            "MemKV: registered the pool for RDMA (%d bytes in %.1f ms, agent %s, metadata %d bytes)",
            len(view),
            took_ms,
            agent.name,
            len(metadata),
        )
        for node in self._nodes.nodes:  # attach now: a node without RDMA shows at startup
            try:
                with node.connection(fail_fast=False) as conn:
                    self._attach(conn)
            except RdmaRefused as exc:
                self._unregister()
                self._give_up(str(exc))
                return False
            except MemKVError as exc:  # unreachable: a node failure, not an RDMA one
                if self.mode == "rdma":
                    self._unregister()
                    raise RdmaError(f"MEMKV_TRANSPORT=rdma: cannot attach RDMA to {node.name}: {exc}") from exc
                log.warning("MemKV: cannot attach RDMA to %s yet: %s", node.name, exc)
        return self.rdma_active

    def _unregister(self) -> None:
        """Undo a registration at startup (nothing was loaded over RDMA yet)."""
        with self._lock:
            agent, pool, inbox = self._agent, self._pool, self._inbox
            self._agent = self._pool = self._inbox = None
            self._attached = weakref.WeakKeyDictionary()  # a later registration attaches afresh
        _release(agent, pool, inbox)

    def _give_up(self, reason: str) -> None:
        """RDMA cannot be set up: `rdma` refuses to start, `auto` latches to TCP."""
        if self.mode == "rdma":
            raise RdmaError(f"MEMKV_TRANSPORT=rdma: {reason}")
        self._failed(reason)

    def _attach(self, conn: NodeConnection) -> str:
        """RDMA_ATTACH once per connection; returns the node's agent name. Raises RdmaRefused
        when the node answers without RDMA; MemKVError on transport errors."""
        peer = self._attached.get(conn)
        if peer is not None:
            return peer
        try:
            # The node builds its NIXL agent on the first attach and loads our metadata: hundreds
            # of ms on a busy host. Once per connection, so not held to the data path's timeout.
            timeout_s = max(conn.io_timeout_s, ATTACH_TIMEOUT_S)
            reply = conn.request(p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, self._metadata), timeout_s=timeout_s)
        except ServerError as exc:
            if exc.code != p.ErrorCode.UNKNOWN_OPCODE:
                raise
            raise RdmaRefused(
                f"{conn.name} does not speak RDMA_ATTACH (an older node)", connection_closed=True
            ) from exc
        if not isinstance(reply, p.RdmaAttachReply):
            raise RemoteProtocolError(f"{conn.name}: unexpected reply to RDMA_ATTACH")
        if reply.status != p.RdmaAttachStatus.OK:
            try:
                why = p.RdmaAttachStatus(reply.status).name
            except ValueError:
                why = f"status {reply.status}"
            raise RdmaRefused(f"{conn.name} refused RDMA ({why}): {reply.info}")
        self._attached[conn] = reply.info
        return reply.info

    # -- loads ------------------------------------------------------------------------------------

    def load_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> LoadResult:
        pool = self._pool
        if pool is None or not self.rdma_active:
            return LoadResult(self._tcp.get_into(list(keys), list(views)))
        addrs = [buffer_address(v) for v in views]
        rdma_idx = [i for i, (a, v) in enumerate(zip(addrs, views)) if pool.covers(a, len(v))]
        ok = [False] * len(keys)
        late = False
        if len(rdma_idx) < len(keys):  # buffers outside the pool: the TCP path
            tcp_idx = sorted(set(range(len(keys))) - set(rdma_idx))
            for i, r in zip(tcp_idx, self._tcp.get_into([keys[i] for i in tcp_idx], [views[i] for i in tcp_idx])):
                ok[i] = r
        if rdma_idx:
            sub_k = [keys[i] for i in rdma_idx]
            sub_v = [views[i] for i in rdma_idx]
            sub_a = [addrs[i] for i in rdma_idx]

            def run(node: NodeClient, idx: list[int]) -> list[tuple[bool, bool]]:
                out: list[tuple[bool, bool]] = []
                step = (node.limits or p.Limits()).max_batch
                for lo in range(0, len(idx), step):
                    part = idx[lo : lo + step]
                    out += self._load_chunk(
                        node, [sub_k[i] for i in part], [sub_v[i] for i in part], [sub_a[i] for i in part]
                    )
                return out

            for i, (good, unsettled) in zip(rdma_idx, self._nodes.scatter(sub_k, run)):
                ok[i] = good
                late |= unsettled and not good
        return LoadResult(ok, late)

    def _load_chunk(
        self, node: NodeClient, keys: list[bytes], views: list[memoryview], addrs: list[int]
    ) -> list[tuple[bool, bool]]:
        """One node's batch as pipelined RDMA_GETs on one connection: all requests are sent,
        then each reply is read and its values verified while the node writes the next
        request's values. Per item: (loaded and verified, a write may still land)."""
        nodes = self._nodes
        n = len(keys)
        inbox = self._inbox
        if inbox is None or not self.rdma_active:  # latched (or closed) meanwhile
            return [(ok, False) for ok in self._tcp.get_into(keys, views)]
        io_timeout_s = nodes.io_timeout_s
        window_ms = max(1, min(p.MAX_RDMA_WINDOW_MS, int(io_timeout_s * 1000 * WINDOW_SHARE)))
        parts = pipeline_parts([len(v) for v in views], self.pipeline_bytes)
        try:
            conn = node.borrow()
        except MemKVError as exc:
            nodes.count_failure(node, "get", exc)
            return [(False, False)] * n
        tickets: list[_Ticket] = []
        t = time.perf_counter()
        try:
            peer = self._attach(conn)
            for lo, hi in parts:
                # The ticket comes before the request: the notification cannot precede it.
                token = next(self._tokens)
                tickets.append(inbox.expect(peer, struct.pack(">Q", token)))
                lengths = tuple(len(v) for v in views[lo:hi])
                conn.send(p.RdmaGetRequest(tuple(keys[lo:hi]), lengths, tuple(addrs[lo:hi]), window_ms, token))
        except RdmaRefused as exc:  # raised by the attach: nothing was sent
            node.give_back(conn, exc if exc.connection_closed else None)  # else the connection is in step
            self._failed(str(exc))
            if self.mode == "auto":  # nothing was posted: these slots can take the TCP path now
                return [(ok, False) for ok in self._tcp.get_into(keys, views)]
            return [(False, False)] * n
        except BaseException as exc:
            # A request whose send began may have reached the node: its writes may still land.
            sent_to = parts[len(tickets) - 1][1] if tickets else 0
            for ticket in tickets:
                inbox.cancel(ticket)  # a notification that still comes is dropped
            node.give_back(conn, exc)
            if not isinstance(exc, MemKVError):
                raise
            nodes.count_failure(node, "get", exc)
            self._abandoned(node, exc, sent_to)
            return [(False, True)] * sent_to + [(False, False)] * (n - sent_to)
        out: list[tuple[bool, bool]] = []
        for k, ((lo, hi), ticket) in enumerate(zip(parts, tickets)):
            try:
                reply = conn.read_reply()
                if not isinstance(reply, p.RdmaGetReply) or len(reply.items) != hi - lo:
                    raise RemoteProtocolError(f"{node.name}: RDMA_GET reply does not match the request")
            except BaseException as exc:
                for later in tickets[k:]:
                    inbox.cancel(later)
                node.give_back(conn, exc)
                if not isinstance(exc, MemKVError):
                    raise
                nodes.count_failure(node, "get", exc)
                self._abandoned(node, exc, n - lo)
                return out + [(False, True)] * (n - lo)
            out += self._settle(node, reply, views[lo:hi], ticket, inbox)
        node.give_back(conn)
        m.SECONDS.labels("rdma_get").observe(time.perf_counter() - t)
        m.REQUESTS.labels(node.name, "rdma_get", "ok").inc()
        return out

    def _abandoned(self, node: NodeClient, exc: MemKVError, items: int) -> None:
        if items:
            log.warning(
                "%s: RDMA load abandoned after its request was sent (%s); %d slot(s) stay "
                "reserved until no write can land",
                node.name,
                exc,
                items,
            )

    def _settle(
        self, node: NodeClient, reply: p.RdmaGetReply, views: list[memoryview], ticket: _Ticket, inbox: _NotifInbox
    ) -> list[tuple[bool, bool]]:
        """Wait for one RDMA_GET's notification and verify its values in their slots."""
        nodes = self._nodes
        notified = True
        if any(it.status == p.ItemStatus.OK for it in reply.items):
            try:
                notified = inbox.wait(ticket, time.monotonic() + nodes.io_timeout_s)
            except RdmaError as exc:
                log.debug("%s", exc)
                notified = False
        else:  # nothing was written: no notification comes
            inbox.cancel(ticket)
        out: list[tuple[bool, bool]] = []
        problem = None
        bad_sums = 0
        for item, view in zip(reply.items, views):
            if item.status == p.ItemStatus.OK:
                if not notified:
                    problem = "the write's notification did not arrive"
                    out.append((False, True))
                elif item.length == len(view) and nodes.checksummer.verify(view, item.algo, item.checksum):
                    out.append((True, False))
                else:
                    bad_sums += 1
                    problem = "a value written by RDMA failed its checksum"
                    out.append((False, True))
            elif item.status == p.ItemStatus.TRANSFER_FAILED:
                problem = "the node's RDMA write failed or missed its window"
                out.append((False, True))
            else:  # MISS, SIZE_MISMATCH: nothing was written
                out.append((False, False))
        m.BYTES.labels("in").inc(sum(len(v) for v, (good, _) in zip(views, out) if good))
        if bad_sums:
            m.INTEGRITY_FAILURES.labels(node.name).inc(bad_sums)
            log.warning(
                "%s: %d value(s) written by RDMA failed checksum verification; treated as misses", node.name, bad_sums
            )
        if problem:
            self._failed(f"{node.name}: {problem}")
        return out

    def _failed(self, reason: str) -> None:
        """An RDMA failure: `auto` latches to TCP (one WARNING); `rdma` just reports it."""
        with self._lock:
            first = not self._warned
            self._warned = True
            if self.mode == "auto" and self._latched is None:
                self._latched = reason
                log.warning("MemKV: RDMA failed (%s); this client uses TCP from now on (MEMKV_TRANSPORT=auto)", reason)
                return
        if self.mode == "rdma":
            (log.warning if first else log.debug)(
                "MemKV: RDMA load failed (%s); MEMKV_TRANSPORT=rdma does not fall back to TCP", reason
            )

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the inbox (a loader still waiting gets False), deregister the pool
        and drop the agent: after this no node can write into the pool through this client's
        UCX endpoint (the client closed its connections first, so nodes have already dropped
        its metadata). Idempotent."""
        with self._lock:
            agent, pool, inbox = self._agent, self._pool, self._inbox
            self._agent = self._pool = self._inbox = None
            if self._latched is None:
                self._latched = "client closed"
        _release(agent, pool, inbox)


def _release(agent: NixlAgent | None, pool: Registration | None, inbox: _NotifInbox | None = None) -> None:
    """Close the inbox (if any), deregister the pool (if any) and close the agent (if any): a
    failure only logs."""
    if inbox is not None:
        inbox.close()  # before the agent goes: waiting loaders return instead of calling into it
    if agent is None:
        return
    if pool is not None:
        try:
            agent.deregister(pool)
        except RdmaError as exc:
            log.debug("%s", exc)
    agent.close()
