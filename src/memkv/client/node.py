"""One MemKV node as seen by the client: authenticated connections, a pool, and health.

`NodeConnection` is one authenticated socket (handshake + frame codec). `NodeClient` keeps a
LIFO pool of them, bounded by `pool_size`, and a small health state: after a transport or
protocol failure the node is marked down for `down_for_s`; while down, calls fail fast with
NodeUnavailable (the cluster turns that into a miss for reads). After that time the next call
tries again. A connection that failed in any way is closed, never returned to the pool
(the stream position after an error is unknown). One failure does not mark the node down: a
request that ran out of io_timeout_s while the node was still taking its bytes
(`node_is_busy`). An overloaded node takes a large batch of stores slowly; marking it down
would turn every lookup and load of its keys into a miss too, while a stalled or unreachable
node stops taking bytes and is marked down as before.

Same-host nodes (docs/protocol.md section 2.6): a node names its abstract Unix socket in
HELLO_OK; once a TCP connection has learnt the name, NodeClient opens its connections there
(same protocol, same handshake; a cheaper kernel path than loopback TCP: docs/archive/performance-log.md) and
closes the TCP one. A name that cannot be reached from here (another host or
network namespace: refused at once) or that answers as another node is not tried again; a node
that restarted names a new socket, learnt on the next TCP connection. Any process may bind a
name its node gave up, so the socket gets a short deadline (`local_handshake_s`) and any
failure there sends that connection to TCP, which names the node's current socket: a socket
alone never marks the node down.

How a connection's values move (`NodeConnection.way`) is chosen once, when NodeClient opens it,
by the `OpenWay` it was given (memkv.transport.open_way): through the node's shared memory on a
same-host connection whose node offered it (HELLO_OK `shared_memory`, with `shared_memory` on
here), else over the socket. This module only sends requests and reads their replies' meta; the
values themselves are the way's (memkv/transport/stream.py, memkv/transport/shm.py).

Threading: NodeClient is thread-safe; a NodeConnection is used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from memkv import protocol as p
from memkv.client.shared import MappedValues
from memkv.config import ServerAddress
from memkv.errors import (
    AuthError,
    ConnectError,
    MemKVError,
    MemKVTimeout,
    NodeUnavailable,
    PoolTimeout,
    ProtocolError,
    RemoteProtocolError,
    ServerError,
    TlsError,
    TransportError,
    WriteTimeout,
    map_os_error,
)
from memkv.integrity import Checksummer
from memkv.sockio import PeerClosed, recv_exactly, send_all, set_timeouts

log = logging.getLogger("memkv.client")

# The socket seam: how a connection's socket comes to be. `Client(config, connect=...)` hands
# one down to every NodeConnection; tests pass an in-memory fake (tests/unit/fakenet.py), so
# everything above the socket, handshake and codec included, runs unchanged.
Connect = Callable[[ServerAddress, float], socket.socket]


def tcp_connect(address: ServerAddress, timeout_s: float) -> socket.socket:
    """A TCP connection to `address` with Nagle off (requests are single writes). Raises OSError."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def local_connect(name: str) -> Connect:
    """The seam that reaches a node's same-host socket `name` ("@" + abstract AF_UNIX name, as
    HELLO_OK advertises it) whatever the address asked for. Raises OSError."""
    if not p.is_local_socket_name(name):
        raise ValueError(f"not a same-host socket name: {name!r}")

    def connect(address: ServerAddress, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)  # a full backlog makes an AF_UNIX connect wait
            sock.connect("\0" + name[1:])
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


class Way(Protocol):
    """How the values of one connection move: over its socket or through the node's shared
    memory. The implementations are memkv/transport/stream.py and memkv/transport/shm.py, which
    the client core does not import: NodeClient is handed an `OpenWay` and calls it once per
    connection it opens. Raises MemKVError subclasses only."""

    def get_into(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """GET into `views` (each exactly the value's length): (loaded, checksum failures)."""
        ...

    def put(self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer) -> bytes:
        """PUT `views` under `keys`: one status per key."""
        ...

    def get_values(self, keys: Sequence[bytes], checksummer: Checksummer) -> tuple[list[bytes | None], int]:
        """GET values of unknown length: (values, checksum failures), None for a miss."""
        ...


# The way of a connection just opened, given the mappings of its node process when the node
# offered its shared memory on that connection and it is on here (else None): memkv.transport.open_way.
OpenWay = Callable[["NodeConnection", MappedValues | None], Way]


def node_is_busy(error: BaseException, io_timeout_s: float) -> bool:
    """Whether `error` is a request that timed out while the node was still taking its bytes:
    the last taken within a quarter of io_timeout_s (at least 0.25 s, at most 1 s) before the
    timeout. Such a node is busy, not gone (the module docstring)."""
    idle_s = error.node_idle_s if isinstance(error, WriteTimeout) else None
    return idle_s is not None and idle_s < min(1.0, max(0.25, io_timeout_s / 4))


def handshake_timeout_s(connect_timeout_s: float, io_timeout_s: float) -> float:
    """The bound of a whole handshake, once the TCP connection is up."""
    return max(connect_timeout_s, io_timeout_s, 1.0)


# The bound of a connect plus handshake on a same-host socket. Its name may belong to another
# process by now (the node exited and anyone bound it: abstract names have no owner or
# permissions); one that accepts and stays silent must cost a caller this much once, not an
# io timeout per call. A live but busy node that misses it only sends that connection to TCP.
LOCAL_HANDSHAKE_S = 1.0


# A busy node (`node_is_busy`) is named in the log at most this often.
BUSY_LOG_S = 10.0


def local_handshake_s(connect_timeout_s: float, io_timeout_s: float) -> float:
    return min(LOCAL_HANDSHAKE_S, connect_timeout_s, handshake_timeout_s(connect_timeout_s, io_timeout_s))


class NodeConnection:
    """One authenticated connection. Raises MemKVError subclasses only."""

    def __init__(
        self,
        address: ServerAddress,
        auth_key: bytes,
        connect_timeout_s: float,
        io_timeout_s: float,
        version: int = p.PROTOCOL_VERSION,
        connect: Connect = tcp_connect,
        handshake_s: float | None = None,
    ) -> None:
        """`handshake_s` bounds connect plus handshake together (the same-host socket's short
        deadline); by default the connect gets connect_timeout_s and the handshake
        `handshake_timeout_s`."""
        self.address = address
        self.name = address.name
        self.io_timeout_s = io_timeout_s
        self._unsent = bytearray()  # queued by queue_request, not yet taken by the socket
        self._rx = bytearray()  # the part of the next reply received by recv_ready so far
        self._rx_header: p.FrameHeader | None = None
        self._way: Way | None = None  # chosen by NodeClient when it opened this connection
        self.local_name: str | None = None  # the same-host socket this connection went to (NodeClient)
        started = time.monotonic()
        try:
            self.sock = connect(address, connect_timeout_s if handshake_s is None else handshake_s)
        except OSError as exc:
            raise map_os_error(exc, "connect", self.name) from exc
        try:
            # The peer accepted: the handshake is an exchange with a live node and gets the time
            # any reply gets. Bounded by connect_timeout_s alone, a node busy receiving values
            # (16 concurrent 16 MiB PUTs on 2 vCPUs: handshakes of 0.4-0.9 s, some past 2 s) was
            # marked down, and the stores queued behind it were lost.
            if handshake_s is None:
                deadline = time.monotonic() + handshake_timeout_s(connect_timeout_s, io_timeout_s)
            else:
                deadline = started + handshake_s
            set_timeouts(self.sock, max(0.001, deadline - time.monotonic()))
            self.codec, self.hello = self._handshake(auth_key, version, deadline)
            set_timeouts(self.sock, io_timeout_s)
        except BaseException:
            self.close()
            raise

    def _handshake(self, auth_key: bytes, version: int, deadline: float) -> tuple[p.FrameCodec, p.HelloOk]:
        """The whole handshake must finish by `deadline` (a peer dripping bytes cannot stretch it)."""
        hs = p.ClientHandshake(auth_key, os.urandom(p.NONCE_BYTES), version)
        with self.io("handshake"):
            send_all(self.sock, [hs.hello()], deadline)
            server_hello = bytes(recv_exactly(self.sock, p.SERVER_HELLO.size, deadline))
            if server_hello.startswith(b"HTTP/"):  # a node's admin port answers a hello in HTTP
                raise RemoteProtocolError(
                    f"{self.name}: answered in HTTP: this is a MemKV node's admin port, not its data port "
                    "(the data port is the admin port - 1 by default)",
                    p.ErrorCode.BAD_MAGIC,
                )
            try:
                auth = hs.receive_server_hello(server_hello)
            except ProtocolError as exc:
                if exc.code == p.ErrorCode.TLS_REQUIRED:
                    raise TlsError(
                        "TLS: this port serves MemKV over TLS only and we connected without TLS (a plain client "
                        "on a TLS port) -- set MEMKV_TLS_CA (or a tls: block in client.yaml)",
                        self.name,
                    ) from None
                if exc.code == p.ErrorCode.SERVER_BUSY:
                    raise ServerError(
                        f"{self.name}: node refused the connection: too many connections", exc.code
                    ) from None
                raise type(exc)(f"{self.name}: {exc}", exc.code) from None
            except AuthError as exc:
                raise AuthError(f"{self.name}: {exc}", exc.reason) from None
            send_all(self.sock, [auth], deadline)
            first = bytes(recv_exactly(self.sock, p.AUTH_REJECT.size, deadline))
            code = p.parse_auth_outcome_prefix(first)
            if code is not None:
                raise AuthError(
                    f"{self.name}: node refused our auth key ({p.error_name(code)}): MEMKV_AUTH_KEY differs from the node's key"
                )
            rest = recv_exactly(self.sock, p.FRAME_PREFIX_BYTES - len(first), deadline)
        codec = hs.codec()
        msg = self._read_reply(codec, first + bytes(rest), deadline)
        if not isinstance(msg, p.HelloOk):
            raise RemoteProtocolError(f"{self.name}: expected HELLO_OK, got {type(msg).__name__}")
        codec.limits = msg.limits
        return codec, msg

    @contextlib.contextmanager
    def io(self, op: str) -> Iterator[None]:
        """An OSError in the block (a timeout included) raised as the MemKVError of `op`."""
        try:
            yield
        except OSError as exc:  # includes socket.timeout and ConnectionError
            raise map_os_error(exc, "write" if op == "write" else "read", self.name) from exc

    def deadline(self) -> float:
        """When a request or reply started now must be complete: io_timeout_s bounds the whole
        frame, not each read, so a peer trickling bytes cannot hold the caller longer."""
        return time.monotonic() + self.io_timeout_s

    def _read_reply(self, codec: p.FrameCodec, prefix: bytes | None = None, deadline: float | None = None) -> p.Message:
        deadline = self.deadline() if deadline is None else deadline
        with self.io("read"):
            if prefix is None:
                prefix = bytes(recv_exactly(self.sock, p.FRAME_PREFIX_BYTES, deadline))
            header = codec.parse_header(prefix)
            meta = recv_exactly(self.sock, header.meta_len, deadline)
        msg = codec.open(header, prefix, meta)
        if isinstance(msg, p.ErrorReply):
            raise ServerError(f"{self.name}: node error {p.error_name(msg.code)}: {msg.message}", msg.code)
        return msg

    @property
    def limits(self) -> p.Limits:
        return self.codec.limits

    @property
    def way(self) -> Way:
        """How values move on this connection (memkv/transport: the socket or the node's shared
        memory), chosen once, when NodeClient opened it."""
        if self._way is None:
            raise RuntimeError(f"{self.name}: a connection NodeClient did not open has no way for values")
        return self._way

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- requests -------------------------------------------------------------------------------

    def request(self, msg: p.Request, payload: Sequence[memoryview] = (), timeout_s: float | None = None) -> p.Message:
        """Send one request (plus value payload) and read a reply that carries no payload, within
        io_timeout_s (or `timeout_s`, for control requests the node may take longer to answer):
        the reply, checked against the request (`matched`)."""
        self.send(msg, payload)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return self.matched(msg, self._read_reply(self.codec, deadline=deadline))

    def matched(self, msg: p.Request, reply: p.Message) -> p.Message:
        """`reply` when it can answer `msg` (protocol.reply_mismatch), else RemoteProtocolError."""
        mismatch = p.reply_mismatch(msg, reply)
        if mismatch is not None:
            raise RemoteProtocolError(f"{self.name}: {mismatch}")
        return reply

    def send(self, msg: p.Request, payload: Sequence[memoryview] = ()) -> None:
        frame = self.codec.encode(msg)
        with self.io("write"):
            send_all(self.sock, [frame, *payload], self.deadline())

    def read_reply(self, deadline: float | None = None) -> p.Message:
        """The next reply's frame (its meta; a value payload stays for the caller), whole by
        `deadline` (by default io_timeout_s from now)."""
        return self._read_reply(self.codec, deadline=deadline)

    # -- without waiting (client/pipeline.py) ---------------------------------------------------
    # Requests queued by `queue_request` leave through `send_ready`; a reply comes in through
    # `recv_ready` piece by piece, as its bytes arrive. Neither call waits, so one thread can
    # serve many connections from poll(); the caller enforces the io_timeout_s of each reply.
    # Only for replies without payload (STATUS), and not mixed with the blocking calls while a
    # request is unsent or a reply half-received (`idle` says when the stream is in step again).

    def queue_request(self, msg: p.Request) -> None:
        self._unsent += self.codec.encode(msg)

    @property
    def unsent(self) -> bool:
        return bool(self._unsent)

    @property
    def idle(self) -> bool:
        """Nothing unsent and no reply half-received."""
        return not self._unsent and not self._rx

    def send_ready(self) -> bool:
        """Send what the socket takes now; True once nothing queued is left."""
        with self.io("write"), self._no_wait() as flags:
            while self._unsent:
                try:
                    sent = self.sock.send(self._unsent, flags)
                except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    return False
                del self._unsent[:sent]
        return True

    @contextlib.contextmanager
    def _no_wait(self) -> Iterator[int]:
        """The flags for a send or recv that must not wait. An SSLSocket takes no flags: it is
        made non-blocking for the block instead (its would-block is SSLWantRead/WriteError;
        OpenSSL keeps a partly written record and resumes it on the next send)."""
        if not isinstance(self.sock, ssl.SSLSocket):
            yield socket.MSG_DONTWAIT
            return
        self.sock.settimeout(0.0)
        try:
            yield 0
        finally:
            set_timeouts(self.sock, self.io_timeout_s)

    def recv_ready(self) -> p.Message | None:
        """Take the bytes of the next reply that have arrived; the reply once it is whole, else
        None. Reads exactly up to the end of that reply, never into the next one."""
        with self.io("read"), self._no_wait() as flags:
            while True:
                header = self._rx_header
                want = p.FRAME_PREFIX_BYTES + (header.meta_len if header is not None else 0)
                if len(self._rx) == want and header is not None:
                    break
                try:
                    piece = self.sock.recv(want - len(self._rx), flags)
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    return None
                if not piece:
                    raise PeerClosed(len(self._rx), want)
                self._rx += piece
                if header is None and len(self._rx) == p.FRAME_PREFIX_BYTES:
                    self._rx_header = self.codec.parse_header(self._rx)
                    if self._rx_header.payload_len:
                        raise RemoteProtocolError(f"{self.name}: a reply with a payload where a status was expected")
        frame, self._rx, self._rx_header = self._rx, bytearray(), None
        msg = self.codec.open(header, frame[: p.FRAME_PREFIX_BYTES], frame[p.FRAME_PREFIX_BYTES :])
        if isinstance(msg, p.ErrorReply):
            raise ServerError(f"{self.name}: node error {p.error_name(msg.code)}: {msg.message}", msg.code)
        return msg


class NodeClient:
    """A pool of connections to one node plus its health. Thread-safe."""

    def __init__(
        self,
        address: ServerAddress,
        auth_key: bytes,
        *,
        pool_size: int,
        connect_timeout_s: float,
        io_timeout_s: float,
        down_for_s: float,
        checksummer: Checksummer,
        open_way: OpenWay,
        on_health: Callable[[str, str | None], None] | None = None,
        connect: Connect = tcp_connect,
        local_socket: bool = True,
        shared_memory: bool = False,
    ) -> None:
        """`local_socket`: use the node's same-host socket when it names one that works.
        `shared_memory`: there, copy values from the node's memory when it offers it.
        `open_way`: makes each new connection's way for values (memkv.transport.open_way).
        `on_health(name, failure)`: called with why the node was marked down, and with None when
        it is usable again."""
        self.address = address
        self.name = address.name
        self._auth_key = auth_key
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._down_for_s = down_for_s
        self.checksummer = checksummer
        self._open_way = open_way
        self._idle: list[NodeConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._down_until = 0.0
        self.last_error: str | None = None
        self.failures = 0
        self.busy_timeouts = 0  # requests that timed out on a busy node (not marked down)
        self._busy_logged = -BUSY_LOG_S
        self.limits: p.Limits | None = None
        self.node_id: str | None = None
        self._on_health = on_health
        self._connect = connect
        self._use_local = local_socket
        # (name, node_id) of the node's same-host socket, reachable from here: one object, so that a
        # thread never pairs a name with a node id another thread has not yet set.
        self._local: tuple[str, str] | None = None
        self._local_refused: set[str] = set()  # names that were not (another host, another node)
        self._use_shared = shared_memory
        self._memory: MappedValues | None = None  # mappings of values stored on the node process
        self._closed = False

    # -- health ---------------------------------------------------------------------------------

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def mark_down(self, error: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._down_for_s
            self.failures += 1
            self.last_error = str(error) or type(error).__name__
            idle, self._idle = self._idle, []
        for conn in idle:  # the node failed: its other pooled sockets are suspect too
            conn.close()
        if self._on_health:
            self._on_health(self.name, self.last_error)

    def _busy(self, error: BaseException) -> None:
        """A request to a busy node failed (`node_is_busy`): said at most once per BUSY_LOG_S."""
        now = time.monotonic()
        with self._lock:  # any borrowing thread may get here
            self.busy_timeouts += 1
            count = self.busy_timeouts
            if now - self._busy_logged < BUSY_LOG_S:
                return
            self._busy_logged = now
        log.warning(
            "memkv server %s busy: a request timed out while the node was still taking its bytes (%s); "
            "not marked down (%d such timeouts so far)",
            self.name,
            error,
            count,
        )

    def _mark_up(self) -> None:
        if self._down_until:
            self._down_until = 0.0
            if self._on_health:
                self._on_health(self.name, None)

    # -- connections ----------------------------------------------------------------------------

    def borrow(self, fail_fast: bool = True) -> NodeConnection:
        """Take a connection from the pool (connecting if none is idle). Every borrow must be
        matched by exactly one `give_back`. Raises NodeUnavailable while the node is marked down."""
        if self._closed:
            raise ConnectError("client is closed", self.name)
        if fail_fast and self.is_down:
            raise NodeUnavailable(self.name, self._down_until - time.monotonic())
        if not self._slots.acquire(timeout=self._connect_timeout_s + self._io_timeout_s):
            raise PoolTimeout("all pooled connections are busy", self.name)
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._open()
                conn._way = self._open_way(conn, self._shared_memory_of(conn))
                self.limits, self.node_id = conn.limits, conn.hello.node_id
            return conn
        except BaseException:
            self._slots.release()
            raise

    @property
    def local(self) -> bool:
        """True while new connections go to the node's same-host socket."""
        return self._local is not None

    def _open(self) -> NodeConnection:
        """A new connection: to the node's same-host socket when one is known to work from
        here, else TCP (then switching to the socket the node names, if it can be reached).
        A failed TCP connection marks the node down; a failed same-host socket does not: the
        name is forgotten and this connection goes over TCP, which names the node's current
        socket (the old name may belong to another process by now)."""
        failed = None
        if (known := self._local) is not None:
            try:
                conn = self._try_local(*known)
            except MemKVTimeout as exc:
                conn = None  # a silent peer: a squatter, a stalled node or a busy one; TCP says which
                self._forget_local(known[0])
                log.info(
                    "MemKV: %s: same-host socket %s did not answer in time (%s); using TCP", self.name, known[0], exc
                )
            if conn is not None:
                return conn
            failed = known[0]
        try:
            conn = self._new_connection(self._connect)
        except (TransportError, ProtocolError) as exc:
            self.mark_down(exc)
            raise
        name = conn.hello.local_socket
        # A name that just failed is not tried again on this call (a busy node would cost the
        # caller its deadline twice); the next connection tries it again.
        if self._use_local and name is not None and name not in self._local_refused and name != failed:
            try:
                local = self._try_local(name, conn.hello.node_id)
            except MemKVTimeout:
                local = None  # busy right now: keep the TCP connection, try the socket next time
            if local is not None:
                conn.close()
                return local
        return conn

    def _try_local(self, name: str, node_id: str) -> NodeConnection | None:
        """A connection to the same-host socket `name` that answers as the node `node_id`, or
        None, and then the name is never tried again. Raises MemKVTimeout (the name not
        refused) when the connect and handshake did not finish within `local_handshake_s`."""
        try:
            conn = self._new_connection(
                local_connect(name), local_handshake_s(self._connect_timeout_s, self._io_timeout_s)
            )
        except MemKVTimeout:
            raise
        except (TransportError, ProtocolError, AuthError) as exc:
            # Refused at once from another host or network namespace, or by a node that is
            # shutting down (a restarted node names a new socket); or not a node at all.
            self._refuse_local(name)
            log.info("MemKV: %s: same-host socket %s not usable from here (%s); using TCP", self.name, name, exc)
            return None
        if conn.hello.local_socket != name or conn.hello.node_id != node_id:
            conn.close()  # not the node that named it: never trust the name again
            self._refuse_local(name)
            log.warning("MemKV: %s: same-host socket %s answered as another node; using TCP", self.name, name)
            return None
        if self._local is None:
            log.debug("MemKV: %s: connections go to the same-host socket %s", self.name, name)
        self._local = (name, node_id)
        conn.local_name = name
        return conn

    def _shared_memory_of(self, conn: NodeConnection) -> MappedValues | None:
        """The mappings of the node process a new connection reaches when its values may move
        through that process's memory: a same-host connection whose node offered it, with
        `shared_memory` on here, and memfds of that process not refused here; else None."""
        if conn.local_name is None or not self._use_shared or not conn.hello.shared_memory:
            return None
        return self._memory_for(conn.local_name)

    def _memory_for(self, process: str) -> MappedValues | None:
        """The mappings of one node process, named by its same-host socket (random per process:
        a node restarted on the same port keeps its node_id, not its values); those of the
        process it replaced go once no copy uses them (they keep that memory alive). None for a
        process whose memfds were refused here (MappedValues.refuse)."""
        with self._lock:
            old = self._memory
            if old is not None and old.process == process:
                return None if old.refused else old
            self._memory = MappedValues(process)
            new = self._memory
        if old is not None:
            old.retire()
        return new

    @property
    def shared(self) -> bool:
        """True while this node's values are copied from its shared memory."""
        memory = self._memory
        return (
            self._local is not None and memory is not None and memory.process == self._local[0] and not memory.refused
        )

    def _refuse_local(self, name: str) -> None:
        with self._lock:
            self._local_refused.add(name)
        self._forget_local(name)

    def _forget_local(self, name: str) -> None:
        """New connections go over TCP until one learns the node's socket again (another thread
        may have learnt a newer name meanwhile: that one stays)."""
        with self._lock:
            if self._local is not None and self._local[0] == name:
                self._local = None

    def _new_connection(self, connect: Connect, handshake_s: float | None = None) -> NodeConnection:
        return NodeConnection(
            self.address,
            self._auth_key,
            self._connect_timeout_s,
            self._io_timeout_s,
            connect=connect,
            handshake_s=handshake_s,
        )

    def borrow_idle(self) -> NodeConnection | None:
        """An idle pooled connection if one is there and a slot is free right now, else None:
        never waits and never connects (pipelines connect through `borrow` on another thread).
        Raises NodeUnavailable while the node is marked down. Matched by one `give_back`."""
        if self._closed:
            raise ConnectError("client is closed", self.name)
        if self.is_down:
            raise NodeUnavailable(self.name, self._down_until - time.monotonic())
        if not self._slots.acquire(blocking=False):
            return None
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            self._slots.release()
        return conn

    def give_back(self, conn: NodeConnection, error: BaseException | None = None) -> None:
        """Return a borrowed connection. After an error it is destroyed (its stream position is
        unknown); a transport or remote protocol error also marks the node down, unless the node
        was busy (`node_is_busy`). A LocalProtocolError is the caller's usage error, raised
        before anything was sent: it says nothing about the node."""
        try:
            if error is not None:
                conn.close()
                if node_is_busy(error, self._io_timeout_s):
                    self._busy(error)
                    return
                if isinstance(error, (TransportError, RemoteProtocolError, AuthError)):
                    if conn.local_name is not None:  # the node may be another process now: ask TCP
                        self._forget_local(conn.local_name)
                    self.mark_down(error)
                return
            self._mark_up()
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def connection(self, fail_fast: bool = True) -> Iterator[NodeConnection]:
        """Borrow a connection for the block; see `borrow` and `give_back`."""
        conn = self.borrow(fail_fast)
        try:
            yield conn
        except BaseException as exc:
            self.give_back(conn, exc)
            raise
        self.give_back(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            memory = self._memory
        for conn in idle:
            conn.close()
        if memory is not None:
            memory.retire()  # unmapped once the last copy in progress ends

    # -- operations -----------------------------------------------------------------------------

    def ping(self) -> float:
        """One round trip (connecting first if needed), ignoring the down mark. Seconds."""
        with self.connection(fail_fast=False) as conn:
            t = time.perf_counter()
            conn.request(p.PingRequest())
            return time.perf_counter() - t

    def list_keys(self, prefix: bytes, limit: int) -> p.ListReply:
        """LIST on this node, ignoring the down mark (an operator asked). `limit` is capped at
        the node's `max_list_keys`; the reply's `truncated` then says more keys matched. Raises
        on failure; a reply that breaks the request's terms (more keys than asked, a key
        outside the prefix) is a RemoteProtocolError."""
        with self.connection(fail_fast=False) as conn:
            asked = min(limit, conn.limits.max_list_keys)
            reply = conn.request(p.ListRequest(prefix, asked))
        assert isinstance(reply, p.ListReply)
        return reply

    def statuses(self, msg: p.Request, payload: Sequence[memoryview] = ()) -> bytes:
        with self.connection() as conn:
            return _statuses(conn, msg, payload)

    def put(self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer) -> bytes:
        """PUT `views` under `keys` (one request's worth: `byte_chunks`) the way the connection
        borrowed moves values (`NodeConnection.way`); one status per key."""
        with self.connection() as conn:
            return conn.way.put(keys, views, checksummer)


def _statuses(conn: NodeConnection, msg: p.Request, payload: Sequence[memoryview] = ()) -> bytes:
    reply = conn.request(msg, payload)
    assert isinstance(reply, (p.StatusReply, p.LeaseReply))
    return reply.statuses


__all__ = ["NodeConnection", "NodeClient", "MemKVError"]
