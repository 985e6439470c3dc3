"""The MemKV node: accept loop and one blocking thread per connection.

Why threads: on loopback and real NICs a blocking socket per connection moving values with
`recv_into`/`sendall` on memoryviews runs at the kernel's copy speed and releases the GIL for
each syscall; asyncio streams lose 60-70% of that (docs/performance.md). Per-request Python
work is O(keys) metadata under the store lock; value bytes go socket <-> store buffer directly.

Connection lifecycle: handshake (bounded by io_timeout_s) -> frames until the client closes,
idles past idle_timeout_s, or breaks the protocol. Any protocol or authentication error is
answered with an ERROR frame (or AuthReject during the handshake), counted in metrics, and
the connection is closed: after a bad frame the stream position cannot be trusted. Nothing a
client sends can stop the node: every handler catches its own exceptions.

Threading: `serve_forever` runs the accept loop in the calling thread; each connection gets a
daemon thread. `shutdown()` may be called from any thread (e.g. a SIGTERM handler) and is
idempotent; it closes the listener and every client socket, so clients see a closed
connection (a miss), never a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from memkv import protocol as p
from memkv.config import ServerConfig
from memkv.errors import AuthError, LocalProtocolError, RemoteProtocolError
from memkv.server.metrics import NodeMetrics
from memkv.server.rdma import RdmaResponder, RequestContext
from memkv.server.store import NoSpace, Store
from memkv.sockio import PeerClosed, discard, recv_exactly, recv_exactly_into, send_all, set_recv_timeout, set_timeouts

log = logging.getLogger("memkv.node")

_OP_NAMES = {
    p.Opcode.PING: "ping",
    p.Opcode.PUT: "put",
    p.Opcode.GET: "get",
    p.Opcode.EXISTS: "exists",
    p.Opcode.DELETE: "delete",
    p.Opcode.LIST: "list",
    p.Opcode.RDMA_ATTACH: "rdma_attach",  # RDMA control messages: memkv/server/rdma.py
    p.Opcode.RDMA_GET: "rdma_get",
}


class _CleanClose(Exception):
    """The client closed the connection between frames."""


class Node:
    def __init__(self, config: ServerConfig, auth_key: bytes) -> None:
        self.config = config
        self._auth_key = auth_key
        self.store = Store(config.capacity_bytes, config.lanes)
        self.metrics = NodeMetrics(self.store)
        self.rdma = RdmaResponder(self.store, config.transport, config.rdma_devices)  # NIXL loads on the first attach
        self.limits = p.Limits(max_value_bytes=config.max_value_bytes)
        self._listener = socket.create_server(
            (config.host, config.port),
            family=socket.AF_INET6 if ":" in config.host else socket.AF_INET,
            reuse_port=False,
            backlog=256,
        )
        self.address = self._listener.getsockname()[:2]
        self.node_id = config.node_id or f"{socket.gethostname()}:{self.address[1]}"
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self.started_at = time.time()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return not self._stopping.is_set()

    def serve_forever(self) -> None:
        self._listener.settimeout(0.25)  # wake up to notice shutdown()
        try:
            while not self._stopping.is_set():
                try:
                    sock, peer = self._listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    if self._stopping.is_set():
                        break
                    raise
                self._start_connection(sock, peer)
        finally:
            self._listener.close()
            self._stopped.set()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection, wait (bounded) for the accept loop."""
        self._stopping.set()
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._stopped.wait(timeout_s)

    def connection_count(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def _start_connection(self, sock: socket.socket, peer) -> None:
        if not self._slots.acquire(blocking=False):
            self.metrics.refused_connections.inc()
            try:
                sock.settimeout(1.0)
                sock.sendall(p.ServerHandshake.refusal(p.ErrorCode.SERVER_BUSY))
            except OSError:
                pass
            sock.close()
            return
        self.metrics.connections_total.inc()
        with self._conns_lock:
            self._conns.add(sock)
        threading.Thread(target=self._run_connection, args=(sock, peer), name=f"memkv-conn-{peer[1]}", daemon=True).start()

    def _run_connection(self, sock: socket.socket, peer) -> None:
        self.metrics.connections.inc()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(sock, self.config.io_timeout_s)
            Connection(self, sock, peer).run()
        except Exception:  # never let one connection take the node down
            log.exception("connection from %s failed", peer)
        finally:
            self.metrics.connections.dec()
            with self._conns_lock:
                self._conns.discard(sock)
            self.rdma.detach(sock)  # a closed connection no longer authorises RDMA writes
            try:
                sock.close()
            except OSError:
                pass
            self._slots.release()


class Connection:
    """One client connection: handshake, then a loop of request -> reply."""

    def __init__(self, node: Node, sock: socket.socket, peer) -> None:
        self.node = node
        self.sock = sock
        self.peer = peer
        self.metrics = node.metrics
        self.codec: p.FrameCodec | None = None
        self._scratch: memoryview | None = None
        self._deadline = 0.0  # when the frame being received must be complete (monotonic)

    def run(self) -> None:
        if not self._handshake():
            return
        while not self.node._stopping.is_set():
            try:
                self._serve_one()
            except _CleanClose:
                return
            except (socket.timeout, TimeoutError):
                self.metrics.errors.labels("timeout").inc()
                return
            except OSError:
                self.metrics.errors.labels("io").inc()
                return
            except AuthError as exc:
                reason = "bad_sequence" if "sequence" in str(exc) else "bad_mac"
                self.metrics.auth_failures.labels(reason).inc()
                self._send_error(p.ErrorCode.BAD_SEQUENCE if reason == "bad_sequence" else p.ErrorCode.BAD_MAC, str(exc))
                return
            except RemoteProtocolError as exc:
                code = exc.code or p.ErrorCode.MALFORMED
                self.metrics.errors.labels(p.error_name(code).lower()).inc()
                self._send_error(code, str(exc))
                return

    # -- handshake ------------------------------------------------------------------------------

    def _handshake(self) -> bool:
        hs = p.ServerHandshake(self.node._auth_key, os.urandom(p.NONCE_BYTES))
        # The whole handshake, not each read, must finish within io_timeout_s: a peer dripping a
        # byte at a time cannot hold a connection slot longer than that.
        deadline = time.monotonic() + self.node.config.io_timeout_s
        try:
            hello = recv_exactly(self.sock, p.CLIENT_HELLO.size, deadline)
            try:
                send_all(self.sock, [hs.receive_hello(bytes(hello))], deadline)
            except RemoteProtocolError as exc:
                reason = "unsupported_version" if exc.code == p.ErrorCode.UNSUPPORTED_VERSION else "bad_hello"
                self.metrics.auth_failures.labels(reason).inc()
                self.sock.sendall(p.ServerHandshake.refusal(exc.code or p.ErrorCode.BAD_MAGIC))
                return False
            if self.node._stopping.is_set():
                return False
            try:
                auth = recv_exactly(self.sock, p.CLIENT_AUTH.size, deadline)
            except PeerClosed as exc:
                # Closed right after our proof without a byte of answer: what a MemKV client
                # holding another key does (it never proves itself to a node it cannot verify).
                self.metrics.auth_failures.labels("wrong_key" if exc.got == 0 else "incomplete").inc()
                return False
            try:
                hs.receive_auth(bytes(auth))
            except (AuthError, RemoteProtocolError):
                self.metrics.auth_failures.labels("bad_proof").inc()
                self.sock.sendall(p.auth_reject(p.ErrorCode.AUTH_FAILED))
                return False
            self.codec = hs.codec(self.node.limits)
            send_all(self.sock, [self.codec.encode(p.HelloOk(self.node.node_id, self.node.limits))], deadline)
            return True
        except (OSError, ConnectionError):
            self.metrics.auth_failures.labels("incomplete").inc()
            return False

    # -- requests -------------------------------------------------------------------------------

    def _serve_one(self) -> None:
        cfg = self.node.config
        codec = self.codec
        assert codec is not None
        prefix = bytearray(p.FRAME_PREFIX_BYTES)
        view = memoryview(prefix)
        set_recv_timeout(self.sock, cfg.idle_timeout_s)
        try:
            n = self.sock.recv_into(view)
        except BlockingIOError:  # SO_RCVTIMEO expired: idle past idle_timeout_s
            raise socket.timeout("idle timeout") from None
        if n == 0:
            raise _CleanClose()
        # From its first byte, the whole frame (prefix, meta, values) must arrive within
        # io_timeout_s: a client trickling bytes cannot keep the connection or a reserved buffer.
        self._deadline = time.monotonic() + cfg.io_timeout_s
        if n < len(prefix):
            recv_exactly_into(self.sock, view[n:], self._deadline)
        header = codec.parse_header(prefix)
        meta = recv_exactly(self.sock, header.meta_len, self._deadline)
        msg = codec.open(header, prefix, meta)
        op = header.opcode
        name = _OP_NAMES.get(op)
        if name is None:
            raise RemoteProtocolError(f"opcode 0x{op:02x} is not a request", p.ErrorCode.UNKNOWN_OPCODE)
        started = time.perf_counter()
        # Counted before the reply goes out: a client that got its answer then reads the
        # metrics must see its request (counting after the send raced such a reader).
        self.metrics.requests.labels(name).inc()
        seconds = self.metrics.request_seconds.labels(name)  # the series exists from now on too
        if isinstance(msg, p.PingRequest):
            self._reply(p.PingReply())
        elif isinstance(msg, p.ExistsRequest):
            statuses = self.node.store.exists(msg.keys)
            self._count_keys(name, statuses)
            self._reply(p.StatusReply(p.Opcode.EXISTS, statuses))
        elif isinstance(msg, p.DeleteRequest):
            statuses = self.node.store.delete(msg.keys)
            self._count_keys(name, statuses)
            self._reply(p.StatusReply(p.Opcode.DELETE, statuses))
        elif isinstance(msg, p.ListRequest):
            found, truncated = self.node.store.list_keys(msg.prefix, msg.limit)
            if found:
                self.metrics.keys.labels(name, "ok").inc(len(found))
            self._reply(p.ListReply(tuple(k for k, _ in found), tuple(n for _, n in found), truncated))
        elif isinstance(msg, p.PutRequest):
            self._put(msg)
        elif isinstance(msg, p.GetRequest):
            self._get(msg)
        elif isinstance(msg, (p.RdmaAttachRequest, p.RdmaGetRequest)):  # memkv/server/rdma.py
            ctx = RequestContext(self.sock, self.peer, cfg.io_timeout_s, self._count_rdma_get)
            self._reply(self.node.rdma.handle(ctx, msg))
        seconds.observe(time.perf_counter() - started)

    def _put(self, msg: p.PutRequest) -> None:
        store = self.node.store
        statuses = bytearray()
        for item in msg.items:
            try:
                ticket = store.begin_put(item.key, item.length, item.algo, item.checksum)
            except NoSpace:
                if self._scratch is None:
                    self._scratch = memoryview(bytearray(1 << 20))
                discard(self.sock, item.length, self._scratch, self._deadline)
                statuses.append(p.ItemStatus.NO_SPACE)
                continue
            try:
                recv_exactly_into(self.sock, ticket.target, self._deadline)
            except BaseException:
                store.abort(ticket)  # a half-received value never becomes visible
                raise
            store.commit(ticket)
            statuses.append(p.ItemStatus.OK)
            self.metrics.bytes_in.inc(item.length)
        self._count_keys("put", statuses)
        self._reply(p.StatusReply(p.Opcode.PUT, bytes(statuses)))

    def _get(self, msg: p.GetRequest) -> None:
        store = self.node.store
        found = store.acquire(msg.keys, msg.expected_lengths, p.ANY_LENGTH)
        pinned = [e for e in found if not isinstance(e, int)]
        try:
            items = []
            values = []
            budget = self.node.limits.max_payload_bytes
            for e in found:
                if isinstance(e, int):
                    items.append(p.GetReplyItem(e, 0, 0, bytes(p.CHECKSUM_BYTES)))
                elif e.length > budget:  # the reply would exceed the frame bound: a miss
                    items.append(p.GetReplyItem(p.ItemStatus.MISS, 0, 0, bytes(p.CHECKSUM_BYTES)))
                else:
                    budget -= e.length
                    items.append(p.GetReplyItem(p.ItemStatus.OK, e.length, e.algo, e.checksum))
                    values.append(e.value)
            statuses = bytes(it.status for it in items)
            self._count_keys("get", statuses)
            assert self.codec is not None
            # A reply too must be taken within io_timeout_s: a slow reader cannot pin these values.
            send_all(self.sock, [self.codec.encode(p.GetReply(tuple(items)), validate=False), *values],
                     time.monotonic() + self.node.config.io_timeout_s)
            self.metrics.bytes_out.inc(sum(len(v) for v in values))
        finally:
            store.release(pinned)

    def _count_rdma_get(self, statuses: bytes, bytes_out: int) -> None:
        self._count_keys("get", statuses)
        if bytes_out:
            self.metrics.bytes_out.inc(bytes_out)

    def _count_keys(self, op: str, statuses: bytes) -> None:
        hits = statuses.count(p.ItemStatus.OK)
        if hits:
            self.metrics.keys.labels(op, "ok").inc(hits)
        if len(statuses) - hits:
            self.metrics.keys.labels(op, "miss").inc(len(statuses) - hits)

    def _reply(self, msg: p.Message) -> None:
        assert self.codec is not None
        send_all(self.sock, [self.codec.encode(msg, validate=False)], time.monotonic() + self.node.config.io_timeout_s)

    def _send_error(self, code: int, message: str) -> None:
        """Best effort: tell the client why before closing."""
        if self.codec is None:
            return
        try:
            frame = self.codec.encode_error(code, message)  # goes out even after the codec broke
            set_timeouts(self.sock, 1.0)
            self.sock.sendall(frame)
        except (OSError, LocalProtocolError):
            pass
