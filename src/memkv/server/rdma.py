"""The node's side of the RDMA transport: attached clients and server-driven WRITEs.

Protocol (docs/protocol.md, section 10): on an authenticated connection a client sends
RDMA_ATTACH with its NIXL agent metadata (its registered pool). From then on, and until that
connection closes, RDMA_GET on the connection names keys, exact lengths and slot addresses in
that pool; the node pins the values, WRITEs them into the slots in one NIXL transfer with the
request's token as the notification, waits for completion, and answers with per-key statuses
and checksums (the reply is MACed; the client verifies each checksum over the landed bytes).
No value byte travels on the TCP connection.

The window. RDMA_GET carries `window_ms`: the node starts no write after `receipt + window`
(`_window_open`), and a write still in flight at that time is cancelled if NIXL can and
reported TRANSFER_FAILED either way. The client's timeout is longer than the window, and a
client that gives up still withholds the slot for its grace period (the tier's
load_failure_grace_s), so a late write cannot reach a slot that was reused.

Source memory. A value is written from the store's own buffer, registered with NIXL when the
store makes it (`Store.on_alloc`, buffers of 1 MiB and more, once NIXL is up) or else the first
time it is a source, and kept registered while the store keeps the buffer (buffers are reused
across values of a size class); `Store.on_drop` deregisters a buffer when the store frees it.
Registering at allocation keeps the cost off the read path: a KV value is mostly read once or
twice, so a registration paid on its first read is paid by nearly every read.
A write NIXL cannot cancel keeps its values pinned until it finishes (`_reap`).

The node hands each request a `RequestContext`: the connection's identity (its attach lives
until `detach` with that identity), its peer address for logs, the cap on the window (the
node's io_timeout_s) and a callback for the node's per-key and byte metrics. The responder
knows nothing else about the node's connections. `ServerConfig.transport` ("tcp": refuse
attaches) and `ServerConfig.rdma_devices` (MEMKV_TRANSPORT / MEMKV_RDMA_DEVICES on the node)
decide whether and where NIXL comes up.

Threading: `handle` and `on_alloc` run on connection threads, `on_drop` under the store's lock,
`detach` on a connection's closing thread, `_reap` on its own thread while writes are stuck. `_lock`
guards the peer tables, the registrations and the stuck list; NIXL calls made under it are
short (deregister, load or remove metadata); registrations run outside it. Lock order:
store lock, then `_lock`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from memkv import protocol as p
from memkv.errors import RdmaError, RemoteProtocolError
from memkv.server.store import MMAP_THRESHOLD, Buffer, Entry, Store

if TYPE_CHECKING:  # not a loop: imported for real on the first attach (a node without RDMA never loads it)
    from memkv.nixl_adapter import NixlAgent, Registration, Write

log = logging.getLogger("memkv.node.rdma")

_NO_CHECKSUM = bytes(p.CHECKSUM_BYTES)
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 500e-6


@dataclasses.dataclass(frozen=True)
class RequestContext:
    """What the responder may know of the connection a request arrived on."""

    connection: Hashable  # identity only: an attach is keyed by it until `detach(connection)`
    peer: object  # the client's address, for logs
    max_window_s: float  # the node's io_timeout_s: values stay pinned at most that long
    count: Callable[[bytes, int], None]  # (per-key statuses, value bytes written) -> node metrics
    hung_up: Callable[[], bool] = lambda: False  # the client has closed the connection already


class RdmaResponder:
    """The node's RDMA state. One per node; NIXL is imported on the first RDMA_ATTACH, or at
    `start` (the node calls it when its transport is "rdma"). `on_register` is told of each
    buffer registration (when, seconds).

    `transport` and `devices` are the node's `ServerConfig.transport` / `rdma_devices`."""

    def __init__(
        self,
        store: Store,
        transport: str = "auto",
        devices: Sequence[str] = (),
        on_register: Callable[[str, float], None] | None = None,
    ) -> None:
        self._store = store
        self._on_register = on_register  # (when: "alloc" | "read", seconds) -> node metrics
        self._transport = transport
        self._devices = tuple(devices)
        self._lock = threading.Lock()
        self._engine: NixlAgent | None = None
        self._unavailable: str | None = None
        self._by_conn: dict[Hashable, str] = {}  # RequestContext.connection -> peer agent name
        self._peers: dict[str, int] = {}  # peer agent name -> attached connections
        self._loaded: dict[bytes, str] = {}  # metadata loaded into NIXL -> its agent name (while attached)
        self._regs: dict[int, Registration] = {}  # id(buffer) -> its registration
        self._stuck: list[tuple[Write, list[Entry]]] = []
        self._reaper: threading.Thread | None = None
        self._warned: set[str] = set()

    # -- dispatch (connection threads) ------------------------------------------------------------

    def handle(self, ctx: RequestContext, msg: p.RdmaAttachRequest | p.RdmaGetRequest) -> p.Reply:
        if isinstance(msg, p.RdmaAttachRequest):
            return self.attach(ctx, msg)
        return self.get(ctx, msg)

    def attach(self, ctx: RequestContext, msg: p.RdmaAttachRequest) -> p.RdmaAttachReply:
        if msg.backend != p.RdmaBackend.NIXL_UCX:
            return p.RdmaAttachReply(p.RdmaAttachStatus.REJECTED, f"unknown RDMA backend {msg.backend}")
        engine = self._engine_or_none()
        if engine is None:
            return p.RdmaAttachReply(p.RdmaAttachStatus.UNAVAILABLE, self._unavailable or "no RDMA")
        with self._lock:
            # A client attaches each of its connections with the same metadata: NIXL loads it
            # once (add_remote_agent is exclusive of every transfer in flight under the `rw`
            # sync mode); the later attaches only count. Under `_lock`, so a last detach cannot
            # remove the peer between the lookup and the count.
            name = self._loaded.get(msg.metadata)
            loaded = name is None
            if name is None:
                try:
                    name = engine.add_peer(msg.metadata)
                except RdmaError as exc:
                    return p.RdmaAttachReply(p.RdmaAttachStatus.REJECTED, str(exc))
                self._loaded[msg.metadata] = name
            old = self._by_conn.get(ctx.connection)
            self._by_conn[ctx.connection] = name
            self._peers[name] = self._peers.get(name, 0) + 1
        if old is not None:
            self.detach_peer(old)
        log.info(
            "RDMA: %s attached from %s (%s)", name, ctx.peer, "metadata loaded" if loaded else "metadata already loaded"
        )
        return p.RdmaAttachReply(p.RdmaAttachStatus.OK, engine.name)

    def get(self, ctx: RequestContext, msg: p.RdmaGetRequest) -> p.RdmaGetReply:
        # The node caps the client's window at its own --io-timeout: pins are held that long at most.
        deadline = time.monotonic() + min(msg.window_ms / 1000, ctx.max_window_s)
        with self._lock:
            peer = self._by_conn.get(ctx.connection)
        if peer is None or self._engine is None:
            raise RemoteProtocolError("RDMA_GET on a connection that did not RDMA_ATTACH", p.ErrorCode.MALFORMED)
        found = self._store.acquire(msg.keys, msg.lengths, p.ANY_LENGTH)
        pinned = [e for e in found if not isinstance(e, int)]
        outcome, stuck = "none", None
        try:
            if pinned and ctx.hung_up():
                # The client closed the connection after sending this (it gave up: a node that
                # was stalled reads it late) and may be dropping its NIXL agent right now: a
                # WRITE then races UCX failing that endpoint, which crashed nodes inside
                # ucp_put_nbx (docs/rdma.md, "Known crash"). Nobody would read the reply.
                outcome = "the client hung up before the write"
            elif pinned:
                outcome, stuck = self._write(
                    peer,
                    pinned,
                    [a for a, e in zip(msg.addresses, found) if not isinstance(e, int)],
                    msg.token,
                    deadline,
                )
        finally:
            if stuck is None:
                self._store.release(pinned)
            else:
                self._keep_until_done(stuck, pinned)
        items = []
        for e in found:
            if isinstance(e, int):
                items.append(p.GetReplyItem(e, 0, 0, _NO_CHECKSUM))
            elif outcome == "DONE":
                items.append(p.GetReplyItem(p.ItemStatus.OK, e.length, e.algo, e.checksum))
            else:
                items.append(p.GetReplyItem(p.ItemStatus.TRANSFER_FAILED, 0, 0, _NO_CHECKSUM))
        statuses = bytes(it.status for it in items)
        ctx.count(statuses, sum(e.length for e in pinned) if outcome == "DONE" else 0)
        if pinned and outcome != "DONE":
            self._warn_once(peer, f"RDMA write to {peer} ({ctx.peer}) failed: {outcome}")
        return p.RdmaGetReply(tuple(items))

    def detach(self, connection: Hashable) -> None:
        """The connection closed: it can no longer authorise writes to its peer. Never raises
        (it runs in the node's connection teardown)."""
        with self._lock:
            name = self._by_conn.pop(connection, None)
        if name is not None:
            try:
                self.detach_peer(name)
            except Exception:
                log.exception("RDMA: detaching %s failed", name)

    def detach_peer(self, name: str) -> None:
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
            for metadata in [md for md, n in self._loaded.items() if n == name]:
                del self._loaded[metadata]  # a new attach loads it again
            engine = self._engine
            if engine is not None:
                try:
                    engine.remove_peer(name)  # no transfer towards it can be created any more
                except RdmaError as exc:
                    log.debug("%s", exc)
        if engine is not None:
            log.info("RDMA: %s detached", name)

    # -- the write (a seam: tests/rdma/late_node.py delays `_write` and can stretch its window) ----

    def _write(
        self, peer: str, entries: list[Entry], addresses: list[int], token: int, deadline: float
    ) -> tuple[str, Write | None]:
        """Post one WRITE of `entries` into `addresses`; wait until it completes or the window
        closes. Returns (outcome, a write that could not be cancelled or None)."""
        try:
            local = [(self._source(e.buf), e.length) for e in entries]
            remote = [(a, e.length) for a, e in zip(addresses, entries)]
            write = self._post_write(peer, local, remote, struct.pack(">Q", token), deadline)
        except RdmaError as exc:
            return f"not posted ({exc})", None
        if write is None:
            return "window closed before the write was posted", None
        state = write.state()
        pause = _POLL_MIN_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)  # yield the core: over UCX tcp the client's progress thread copies
            pause = min(2 * pause, _POLL_MAX_S)
            state = write.state()
        if state == "PROC":
            return "window closed with the write in flight", None if write.release() else write
        write.release()
        return state, None

    def _post_write(
        self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], notif: bytes, deadline: float
    ) -> Write | None:
        if not self._window_open(deadline):
            return None
        assert self._engine is not None
        return self._engine.write(local, remote, peer, notif)

    def _window_open(self, deadline: float) -> bool:
        return time.monotonic() < deadline

    # -- source registrations ---------------------------------------------------------------------

    def _source(self, buf: Buffer) -> int:
        """The address of a store buffer, registered with NIXL (once per buffer: at allocation
        through `on_alloc`, or here for a buffer the store made before NIXL came up)."""
        from memkv.nixl_adapter import buffer_address

        addr = buffer_address(buf.view)
        with self._lock:
            reg = self._regs.get(id(buf))
            if reg is not None and reg.address == addr and reg.length == buf.size:
                return addr
        self._register(buf, addr, "read")  # raises RdmaError: the write is not posted
        return addr

    def on_alloc(self, buf: Buffer) -> None:
        """Store hook: a new buffer (a PUT's thread, outside the store's lock). Registering it
        now keeps NIXL's registration off the read path: a value is typically read once."""
        if buf.size < MMAP_THRESHOLD:  # small values: registered on first read, if ever
            return
        from memkv.nixl_adapter import buffer_address

        try:
            self._register(buf, buffer_address(buf.view), "alloc")
        except RdmaError as exc:  # the PUT goes on; the first read registers it (or fails cleanly)
            log.debug("registering a new buffer failed: %s", exc)

    def _register(self, buf: Buffer, addr: int, when: str) -> None:
        """Register `buf` outside `_lock` (under it, a slow registration would stall every other
        connection's write), then record it; a racing registration is undone."""
        engine = self._engine
        assert engine is not None
        t = time.perf_counter()
        reg = engine.register(addr, buf.size)
        if self._on_register is not None:
            self._on_register(when, time.perf_counter() - t)
        stale: Registration | None = reg
        with self._lock:
            old = self._regs.get(id(buf))
            if old is None or old.address != addr or old.length != buf.size:
                stale = old  # None, or a stale entry (cannot happen while on_drop sees every free)
                self._regs[id(buf)] = reg
            # else another thread registered it meanwhile: ours is undone
        if stale is not None:
            with contextlib.suppress(RdmaError):
                engine.deregister(stale)

    def on_drop(self, buf: Buffer) -> None:
        """Store hook: the store frees `buf` (called under the store's lock)."""
        if not self._regs:
            return
        with self._lock:
            reg = self._regs.pop(id(buf), None)
            if reg is not None and self._engine is not None:
                try:
                    self._engine.deregister(reg)
                except RdmaError as exc:
                    log.warning("%s", exc)

    # -- writes NIXL could not cancel -------------------------------------------------------------

    def _keep_until_done(self, write: Write, entries: list[Entry]) -> None:
        with self._lock:
            self._stuck.append((write, entries))
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="memkv-rdma-reaper", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        """Release the pins of stuck writes once NIXL reports them finished (bounded poll)."""
        while True:
            time.sleep(0.05)
            with self._lock:
                stuck, self._stuck = self._stuck, []
            keep = []
            for write, entries in stuck:
                if write.state() == "PROC" or not write.release():
                    keep.append((write, entries))
                else:
                    self._store.release(entries)
            with self._lock:
                self._stuck.extend(keep)
                if not self._stuck:
                    self._reaper = None
                    return

    # -- engine -----------------------------------------------------------------------------------

    def start(self) -> bool:
        """Bring NIXL up now rather than on the first attach. False (and one WARNING) when it
        cannot come up: the node serves TCP, as after a failed first attach."""
        return self._engine_or_none() is not None

    def _engine_or_none(self) -> NixlAgent | None:
        with self._lock:
            if self._engine is not None or self._unavailable is not None:
                return self._engine
            if self._transport == "tcp":
                self._unavailable = "RDMA is disabled on this node (MEMKV_TRANSPORT=tcp)"
                return None
            from memkv.nixl_adapter import NixlAgent

            try:
                self._engine = NixlAgent("node", self._devices)
            except RdmaError as exc:
                self._unavailable = f"this node cannot do RDMA: {exc}"
                log.warning("%s; clients use TCP", self._unavailable)
                return None
            self._store.on_drop = self.on_drop
            self._store.on_alloc = self.on_alloc
            log.info(
                "RDMA: NIXL agent %s ready (UCX_TLS=%s); clients may attach",
                self._engine.name,
                os.environ.get("UCX_TLS", "(default)"),
            )
            return self._engine

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            log.debug("%s", message)
            return
        self._warned.add(key)
        log.warning("%s", message)
