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

Source memory. A value is written from the store's own buffer, registered with NIXL the first
time it is a source and kept registered while the store keeps the buffer (buffers are reused
across values of a size class); `Store.on_drop` deregisters a buffer when the store frees it.
A write NIXL cannot cancel keeps its values pinned until it finishes (`_reap`).

Threading: `handle` runs on connection threads, `on_drop` under the store's lock, `detach`
on a connection's closing thread, `_reap` on its own thread while writes are stuck. `_lock`
guards the peer tables, the registrations and the stuck list; NIXL calls made under it are
short (register, deregister, load or remove metadata). Lock order: store lock, then `_lock`.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from typing import TYPE_CHECKING

from memkv import protocol as p
from memkv.errors import RemoteProtocolError
from memkv.transport.base import RdmaError

if TYPE_CHECKING:
    from memkv.server.node import Connection
    from memkv.server.store import Entry, Store, ValueBuffer
    from memkv.transport.nixl_adapter import NixlAgent, Registration, Write

log = logging.getLogger("memkv.node.rdma")

_NO_CHECKSUM = bytes(p.CHECKSUM_BYTES)
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 500e-6


class RdmaResponder:
    """The node's RDMA state. One per node; NIXL is imported on the first RDMA_ATTACH only."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._engine: NixlAgent | None = None
        self._unavailable: str | None = None
        self._by_conn: dict[object, str] = {}  # connection socket -> peer agent name
        self._peers: dict[str, int] = {}  # peer agent name -> attached connections
        self._regs: dict[int, Registration] = {}  # id(ValueBuffer) -> its registration
        self._stuck: list[tuple[Write, list[Entry]]] = []
        self._reaper: threading.Thread | None = None
        self._warned: set[str] = set()

    # -- dispatch (connection threads) ------------------------------------------------------------

    def handle(self, conn: Connection, msg: p.Message) -> p.Message:
        if isinstance(msg, p.RdmaAttachRequest):
            return self.attach(conn, msg)
        assert isinstance(msg, p.RdmaGetRequest)
        return self.get(conn, msg)

    def attach(self, conn: Connection, msg: p.RdmaAttachRequest) -> p.RdmaAttachReply:
        if msg.backend != p.RdmaBackend.NIXL_UCX:
            return p.RdmaAttachReply(p.RdmaAttachStatus.REJECTED, f"unknown RDMA backend {msg.backend}")
        engine = self._engine_or_none()
        if engine is None:
            return p.RdmaAttachReply(p.RdmaAttachStatus.UNAVAILABLE, self._unavailable or "no RDMA")
        try:
            name = engine.add_peer(msg.metadata)
        except RdmaError as exc:
            return p.RdmaAttachReply(p.RdmaAttachStatus.REJECTED, str(exc))
        with self._lock:
            old = self._by_conn.get(conn.sock)
            self._by_conn[conn.sock] = name
            self._peers[name] = self._peers.get(name, 0) + 1
        if old is not None:
            self.detach_peer(old)
        log.info("RDMA: %s attached from %s", name, conn.peer)
        return p.RdmaAttachReply(p.RdmaAttachStatus.OK, engine.name)

    def get(self, conn: Connection, msg: p.RdmaGetRequest) -> p.RdmaGetReply:
        # The node caps the client's window at its own --io-timeout: pins are held that long at most.
        deadline = time.monotonic() + min(msg.window_ms / 1000, conn.node.config.io_timeout_s)
        with self._lock:
            peer = self._by_conn.get(conn.sock)
        if peer is None or self._engine is None:
            raise RemoteProtocolError("RDMA_GET on a connection that did not RDMA_ATTACH", p.ErrorCode.MALFORMED)
        found = self._store.acquire(msg.keys, msg.lengths, p.ANY_LENGTH)
        pinned = [e for e in found if not isinstance(e, int)]
        outcome, stuck = "none", None
        try:
            if pinned:
                outcome, stuck = self._write(peer, pinned, [a for a, e in zip(msg.addresses, found) if not isinstance(e, int)],
                                             msg.token, deadline)
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
        conn._count_keys("get", statuses)
        if outcome == "DONE":
            conn.metrics.bytes_out.inc(sum(e.length for e in pinned))
        elif pinned:
            self._warn_once(peer, f"RDMA write to {peer} ({conn.peer}) failed: {outcome}")
        return p.RdmaGetReply(tuple(items))

    def detach(self, sock: object) -> None:
        """The connection closed: it can no longer authorise writes to its peer. Never raises
        (it runs in the node's connection teardown)."""
        with self._lock:
            name = self._by_conn.pop(sock, None)
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
            engine = self._engine
        if engine is not None:
            try:
                engine.remove_peer(name)  # no transfer towards it can be created any more
            except RdmaError as exc:
                log.debug("%s", exc)
            log.info("RDMA: %s detached", name)

    def peer_count(self) -> int:
        with self._lock:
            return len(self._peers)

    # -- the write (a seam: tests/rdma/late_node.py delays `_write` and can stretch its window) ----

    def _write(self, peer: str, entries: list[Entry], addresses: list[int], token: int,
               deadline: float) -> tuple[str, Write | None]:
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

    def _post_write(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], notif: bytes,
                    deadline: float) -> Write | None:
        if not self._window_open(deadline):
            return None
        assert self._engine is not None
        return self._engine.write(local, remote, peer, notif)

    def _window_open(self, deadline: float) -> bool:
        return time.monotonic() < deadline

    # -- source registrations ---------------------------------------------------------------------

    def _source(self, buf: ValueBuffer) -> int:
        """The address of a store buffer, registered with NIXL (once per buffer)."""
        from memkv.transport.nixl_adapter import buffer_address

        addr = buffer_address(buf.view)
        with self._lock:
            reg = self._regs.get(id(buf))
            if reg is not None and reg.address == addr and reg.length == buf.size:
                return addr
            assert self._engine is not None
            if reg is not None:  # a stale entry (cannot happen while on_drop sees every free)
                self._engine.deregister(reg)
            self._regs[id(buf)] = self._engine.register(addr, buf.size)
        return addr

    def on_drop(self, buf: ValueBuffer) -> None:
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

    def _engine_or_none(self) -> NixlAgent | None:
        with self._lock:
            if self._engine is not None or self._unavailable is not None:
                return self._engine
            if os.environ.get("MEMKV_TRANSPORT", "").strip().lower() == "tcp":
                self._unavailable = "RDMA is disabled on this node (MEMKV_TRANSPORT=tcp)"
                return None
            from memkv.transport.nixl_adapter import NixlAgent

            devices = [d for d in re.split(r"[,\s]+", os.environ.get("MEMKV_RDMA_DEVICES", "")) if d]
            try:
                self._engine = NixlAgent("node", devices)
            except RdmaError as exc:
                self._unavailable = f"this node cannot do RDMA: {exc}"
                log.warning("%s; clients use TCP", self._unavailable)
                return None
            self._store.on_drop = self.on_drop
            log.info("RDMA: NIXL agent %s ready (UCX_TLS=%s); clients may attach", self._engine.name,
                        os.environ.get("UCX_TLS", "(default)"))
            return self._engine

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            log.debug("%s", message)
            return
        self._warned.add(key)
        log.warning("%s", message)
