"""The MemKV node: accept loop and one blocking thread per connection.

Why threads: on loopback and real NICs a blocking socket per connection moving values with
`recv_into`/`sendall` on memoryviews runs at the kernel's copy speed and releases the GIL for
each syscall; asyncio streams lose 60-70% of that (docs/archive/performance-log.md). Per-request Python
work is O(keys) metadata under the store lock; value bytes go socket <-> store buffer directly.

Connection lifecycle: handshake (bounded by io_timeout_s) -> frames until the client closes,
idles past idle_timeout_s, or breaks the protocol. Any protocol or authentication error is
answered with an ERROR frame (or AuthReject during the handshake), counted in metrics, and
the connection is closed: after a bad frame the stream position cannot be trusted. Nothing a
client sends can stop the node: every handler catches its own exceptions.

Resource exhaustion never ends the node. At start the soft RLIMIT_NOFILE is raised to the hard
limit, and `--max-connections` is capped (with a WARNING naming the numbers) so that the data
connections, the admin port's share and the process's own descriptors fit under it. Should
`accept()` still fail for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), the
loop sheds the newest connection (accepted on a spare descriptor kept for that, then closed),
counts it in `memkv_node_connections_refused_total{reason}`, backs off briefly and keeps
accepting.

TLS (memkv/tls.py, docs/operations.md "Encryption in transit"): with --tls-cert/--tls-key the
data port speaks TLS only; with --tls-listen a second listener speaks TLS and the data port
stays plain. Each connection's TLS handshake runs on its own thread, bounded by io_timeout_s,
before the MemKV handshake, which (with every frame MAC) stays on inside TLS. A plain MemKV
client on a TLS port is answered with a plain ServerHello refusing it (TLS_REQUIRED), so it can
say what is wrong; a TLS ClientHello on a plain port is counted as `tls_on_plain_port`.

Same-host clients (docs/protocol.md section 2.6): unless TLS owns the data port or
`local_socket` is off, the node also listens on an abstract AF_UNIX socket with a random name
and names it in HELLO_OK on plain connections; a client on the same host (and network
namespace) reconnects there. It speaks the very same protocol, handshake and MACs included:
only the kernel path differs (plain sockets: 2.4x the speed of loopback TCP for half the CPU
per byte on the 2-vCPU VM, 1.5x on the 16-vCPU GPU host; bench/unix_vs_tcp.py). An abstract
name is reachable from the node's network namespace only, as loopback TCP is, and the key is
still required.

Threading: `serve_forever` runs the accept loop in the calling thread; each connection gets a
daemon thread. `shutdown()` may be called from any thread (e.g. a SIGTERM handler) and is
idempotent; it closes the listener and every client socket, so clients see a closed
connection (a miss), never a hang.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import secrets
import select
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from memkv import protocol as p
from memkv.config import ServerConfig
from memkv.errors import AuthError, LocalProtocolError, RemoteProtocolError
from memkv.server.metrics import NodeMetrics
from memkv.server.rdma import RdmaResponder, RequestContext
from memkv.server.shm import SealedBuffer, SharedValues, StillMapped, client_stores_on, spares_on
from memkv.server.store import Leased, NoSpace, PutTicket, Store
from memkv.sockio import PeerClosed, discard, recv_exactly, recv_exactly_into, send_all, set_recv_timeout, set_timeouts
from memkv.tls import TLS_HANDSHAKE_BYTE, ServerTls

log = logging.getLogger("memkv.node")

# Descriptors the process needs besides its connections: listeners, stdio, the spare descriptor,
# /proc and log files, and what NIXL opens when a client attaches over RDMA.
PROCESS_FDS = 64
# The admin port (memkv/server/admin.py) serves at most this many connections at once; it may
# hold as many again briefly while idle ones it shed are closing.
ADMIN_MAX_CONNECTIONS = 32
ADMIN_FDS = 2 * ADMIN_MAX_CONNECTIONS
# How long the accept loop pauses after accept() failed for want of descriptors or memory: long
# enough not to spin on a listener that stays readable, short enough to resume serving at once.
ACCEPT_BACKOFF_S = 0.05
# A PUT item's first bytes (all of a smaller value) must arrive before room is made for it; they
# are copied once from the connection's scratch buffer (64 KiB per connection that writes).
HEAD_BYTES = 64 << 10
# How long a PUT item may wait for the in-flight bound (Store.max_inflight_bytes) to make room
# before it is answered NO_SPACE: honest writers finish within milliseconds; stalled ones hold
# their reservation until --io-timeout.
INFLIGHT_WAIT_S = 1.0
# accept() errnos that mean "no resources right now", never "the listener is broken".
EXHAUSTED_ERRNOS = {
    errno.EMFILE: "fd_limit",
    errno.ENFILE: "fd_limit_system",
    errno.ENOBUFS: "no_memory",
    errno.ENOMEM: "no_memory",
}


def fit_connections_to_fd_limit(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, then return `max_connections` capped so
    that it, the admin port's share and the process's own descriptors fit under the limit
    (logging a WARNING with the numbers when it has to cap)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open: keep the soft limit
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
    allowed = soft - PROCESS_FDS - ADMIN_FDS
    if max_connections <= allowed:
        return max_connections
    capped = max(1, allowed)
    log.warning(
        "RLIMIT_NOFILE is %d (hard %d): --max-connections %d capped to %d (%d descriptors kept for the process, "
        "%d for the admin port); raise the limit (ulimit -n, systemd LimitNOFILE=) to allow more",
        soft,
        hard,
        max_connections,
        capped,
        PROCESS_FDS,
        ADMIN_FDS,
    )
    return capped


MIN_SHARED_VALUES = 1024  # fewer memfd values than this: a WARNING at start
PEERCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13: the peer's supplementary groups
MAX_PEER_GROUPS = 256  # Python reads at most 1024 bytes of a socket option


class _CleanClose(Exception):
    """The client closed the connection between frames."""


class Node:
    def __init__(self, config: ServerConfig, auth_key: bytes) -> None:
        self.config = config
        self._auth_key = auth_key
        # PUT buffers reserved but not yet filled, all connections together (each connection has
        # at most one: its items are received one after another). Bounds what writers that
        # stall mid-value can take from the cache (docs/operations.md, "Resource bounds").
        inflight = max(2 * config.max_value_bytes, config.capacity_bytes // 4)
        # Values same-host clients store and load as sealed memfds (memkv/server/shm.py): only
        # where there is a same-host socket to hand descriptors over (Linux, no TLS on the data port).
        self.shared: SharedValues | None = None
        if config.shared_memory and config.local_socket and sys.platform.startswith("linux"):
            if not (config.tls_cert is not None and config.tls_listen is None):
                self.shared = SharedValues()
        # Where their stores go (--shared-memory-stores): into fresh memfds the clients write
        # (SHM_PUT), or over the socket into memfds the node writes and reuses.
        self.client_stores = self.shared is not None and client_stores_on(config.shared_memory_stores)
        self.store = Store(
            config.capacity_bytes,
            config.lanes,
            max_inflight_bytes=min(inflight, config.capacity_bytes),
            max_lease_s=config.max_lease_s,
            max_leases=config.max_leases,
            max_lease_bytes=config.max_lease_bytes,
            max_lease_share=config.max_lease_share,
            shared=self.shared,
        )
        self.metrics = NodeMetrics(self.store)
        self.rdma = RdmaResponder(
            self.store, config.transport, config.rdma_devices, on_register=self.metrics.count_registration
        )
        if config.transport == "rdma":
            # NIXL up before the first PUT, so every buffer is registered when it is made, not on
            # its first read; "auto" loads NIXL on the first attach (a TCP-only fleet never does).
            self.rdma.start()
        self.limits = p.Limits(max_value_bytes=config.max_value_bytes)
        self.tls: ServerTls | None = None
        if config.tls_cert is not None and config.tls_key is not None:
            self.tls = ServerTls(config.tls_cert, config.tls_key, config.tls_ca)
        self._listener = _listen(config.host, config.port)
        self.address = self._listener.getsockname()[:2]
        # The data port is TLS unless a separate TLS port takes that role (then both serve).
        self._listener_tls = self.tls is not None and config.tls_listen is None
        self._tls_listener: socket.socket | None = None
        self.tls_address: tuple[str, int] | None = self.address if self._listener_tls else None
        if config.tls_listen is not None:
            try:
                self._tls_listener = _listen(*config.tls_listen)
            except BaseException:
                self._listener.close()
                raise
            self.tls_address = self._tls_listener.getsockname()[:2]
        self.node_id = config.node_id or f"{socket.gethostname()}:{self.address[1]}"
        self._local_listener: socket.socket | None = None
        self.local_socket: str | None = None  # "@name" as HELLO_OK advertises it
        if config.local_socket and not self._listener_tls:
            self._local_listener, self.local_socket = _listen_local(self.address[1])
        if self.local_socket is None:
            self.shared = None  # new buffers stay private; HELLO_OK offers no shared memory
            self.store.shared = None
            self.client_stores = False
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.max_connections = fit_connections_to_fd_limit(config.max_connections)
        if self.shared is not None:  # its memfds need descriptors too, beside the connections'
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self.shared.fit_fd_limit(soft, self.max_connections)
            if self.shared.max_values < MIN_SHARED_VALUES:
                log.warning(
                    "RLIMIT_NOFILE is %d: room for only %d values in shared memory beside %d connections "
                    "(later SHM_PUTs go over the socket); raise the limit (ulimit -n, systemd LimitNOFILE=) "
                    "or lower --max-connections",
                    soft,
                    self.shared.max_values,
                    self.max_connections,
                )
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY)  # given up to shed on EMFILE
        self.started_at = time.time()

    # -- lifecycle ------------------------------------------------------------------------------

    def trusts(self, sock: socket.socket) -> bool:
        """Whether the peer of this same-host connection may exchange values as memfds: a process
        of the node's own uid, or (`shared_memory_group`) one whose primary or supplementary
        groups include that group, as the kernel saw them at connect time (SO_PEERCRED,
        SO_PEERGROUPS). Others are served over the socket. Node-written memfds only ever go to
        the node's own uid: a peer that keeps the descriptor of one the node has dropped keeps
        its pages, charged to the node (docs/protocol.md section 13, "Trust")."""
        try:
            _, uid, gid = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        except OSError:
            return False
        if uid == os.geteuid():
            return True
        if not self.client_stores:
            return False
        group = self.config.shared_memory_group
        if group is None:
            return False
        if gid == group:
            return True
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
        except OSError:  # more groups than asked for (ERANGE), or a kernel before 4.13
            return False
        return group in struct.unpack(f"={len(raw) // 4}I", raw)

    @property
    def ready(self) -> bool:
        return not self._stopping.is_set()

    def serve_forever(self) -> None:
        side_loops: list[threading.Thread] = []
        if self.shared is not None and self.client_stores and spares_on(self.config.shared_memory_spares):
            # Spares (memkv/server/shm.py): memfds faulted in while no store waits for them.
            threading.Thread(target=self._refill_spares, name="memkv-spares", daemon=True).start()
        for listener, tls, name in ((self._tls_listener, True, "tls"), (self._local_listener, False, "local")):
            if listener is not None:
                loop = threading.Thread(
                    target=self._accept_loop, args=(listener, tls), name=f"memkv-accept-{name}", daemon=True
                )
                loop.start()
                side_loops.append(loop)
        try:
            self._accept_loop(self._listener, self._listener_tls)
        finally:
            for loop in side_loops:
                loop.join(timeout=1.0)
            if self._spare_fd is not None:
                os.close(self._spare_fd)
                self._spare_fd = None
            self._stopped.set()

    def _accept_loop(self, listener: socket.socket, tls: bool) -> None:
        listener.settimeout(0.25)  # wake up to notice shutdown()
        try:
            while not self._stopping.is_set():
                try:
                    sock, peer = listener.accept()
                    if listener.family == socket.AF_UNIX:
                        peer = LOCAL_PEER  # an unbound AF_UNIX client has no address
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._stopping.is_set():
                        break
                    if exc.errno not in EXHAUSTED_ERRNOS:
                        raise
                    self._shed_newest(EXHAUSTED_ERRNOS[exc.errno], listener, tls)
                    self._stopping.wait(ACCEPT_BACKOFF_S)  # descriptors free up as connections end
                    continue
                self._start_connection(sock, peer, tls)
        finally:
            listener.close()

    def _shed_newest(self, reason: str, listener: socket.socket, tls: bool = False) -> None:
        """accept() failed for want of resources: count it, and take the newest connection off
        the backlog on the spare descriptor and close it, so that the peer learns at once
        instead of waiting in the backlog for a slot that may not come."""
        self.metrics.refused_connections.labels(reason).inc()
        if self._spare_fd is None:
            return
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            listener.setblocking(False)
            try:
                sock, _ = listener.accept()
            finally:
                listener.settimeout(0.25)
            try:
                sock.setblocking(False)
                if not tls:  # a TLS client could not read a plain refusal: it sees the close
                    sock.send(p.ServerHandshake.refusal(p.ErrorCode.SERVER_BUSY))  # "too many connections"
            finally:
                sock.close()
        except OSError:
            pass  # nothing waiting, or still out of resources: the count stands
        finally:
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._spare_fd = None  # taken by another thread: retried on the next shed

    def _refill_spares(self) -> None:
        while not self._stopping.is_set():
            if not self.store.refill_spare():
                self.store.wait_for_spare_demand(1.0)

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

    def _start_connection(self, sock: socket.socket, peer: tuple[str, int], tls: bool = False) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(sock, "max_connections", tls)
            return
        with self._conns_lock:
            self._conns.add(sock)
        try:
            threading.Thread(
                target=self._run_connection, args=(sock, peer, tls), name=f"memkv-conn-{peer[1]}", daemon=True
            ).start()
        except RuntimeError:  # "can't start new thread": out of memory or of the task limit
            with self._conns_lock:
                self._conns.discard(sock)
            self._slots.release()
            self._refuse(sock, "no_thread", tls)
            return
        self.metrics.connections_total.inc()
        if sock.family == socket.AF_UNIX:
            self.metrics.local_connections_total.inc()

    def _refuse(self, sock: socket.socket, reason: str, tls: bool = False) -> None:
        """A refusal ServerHello (SERVER_BUSY) sent without waiting, then close; counted. A TLS
        port sends nothing (its client could not read a plain refusal): the close says it."""
        self.metrics.refused_connections.labels(reason).inc()
        try:
            sock.setblocking(False)  # the accept loop never waits on a refused peer
            if not tls:
                sock.send(p.ServerHandshake.refusal(p.ErrorCode.SERVER_BUSY))
        except OSError:
            pass
        sock.close()

    def _run_connection(self, sock: socket.socket, peer: tuple[str, int], tls: bool = False) -> None:
        self.metrics.connections.inc()
        try:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(sock, self.config.io_timeout_s)
            if tls:
                wrapped = self._tls_accept(sock)
                if wrapped is None:
                    return
                sock = wrapped
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

    def _tls_accept(self, sock: socket.socket) -> ssl.SSLSocket | None:
        """The TLS side of an accepted connection, or None once it was refused. A first byte
        that cannot open TLS (a plain MemKV hello) is answered with a plain refusal naming
        TLS_REQUIRED; otherwise the TLS handshake runs, bounded by io_timeout_s. The TLS socket
        replaces the TCP one in `_conns`, so that shutdown() reaches it."""
        assert self.tls is not None
        deadline = time.monotonic() + self.config.io_timeout_s
        try:
            first = sock.recv(1, socket.MSG_PEEK)  # bounded by SO_RCVTIMEO (io_timeout_s)
        except OSError:
            self.metrics.auth_failures.labels("incomplete").inc()
            return None
        if not first:
            return None
        if first[0] != TLS_HANDSHAKE_BYTE:
            self.metrics.auth_failures.labels("plain_on_tls_port").inc()
            try:
                sock.sendall(p.ServerHandshake.refusal(p.ErrorCode.TLS_REQUIRED))
            except OSError:
                pass
            return None
        try:
            tls = self.tls.wrap(sock, deadline)
        except OSError as exc:  # ssl.SSLError and TimeoutError included
            self.metrics.auth_failures.labels("tls_handshake").inc()
            log.info("TLS handshake failed: %s", getattr(exc, "reason", None) or exc)
            return None
        set_timeouts(tls, self.config.io_timeout_s)
        with self._conns_lock:
            self._conns.discard(sock)
            self._conns.add(tls)
        return tls


def _listen(host: str, port: int) -> socket.socket:
    return socket.create_server(
        (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False, backlog=256
    )


# How a connection that came in on the same-host socket appears in logs and thread names.
LOCAL_PEER = ("local", 0)


def _listen_local(port: int) -> tuple[socket.socket | None, str | None]:
    """The same-host listener: an abstract AF_UNIX socket (Linux only; no file to clean up, gone
    with the process) under a random name no other process can have taken. The name is no secret
    (/proc/net/unix lists it) and anyone may bind it once we exit: clients trust it only after the
    handshake (docs/protocol.md section 2.6). Without it the node serves TCP alone, which is
    correct, only slower for same-host clients."""
    if not sys.platform.startswith("linux"):
        return None, None
    name = f"memkv-{port}-{secrets.token_hex(12)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
        listener.listen(256)
    except OSError as exc:
        listener.close()
        log.warning("no same-host socket (%s): same-host clients use TCP", exc)
        return None, None
    return listener, "@" + name


class Connection:
    """One client connection: handshake, then a loop of request -> reply."""

    def __init__(self, node: Node, sock: socket.socket, peer: tuple[str, int]) -> None:
        self.node = node
        self.sock = sock
        self.peer = peer
        self.metrics = node.metrics
        self.codec: p.FrameCodec | None = None
        self._scratch: memoryview | None = None
        self._deadline = 0.0  # when the frame being received must be complete (monotonic)
        self.shared_memory = False  # offered in HELLO_OK (the same-host socket, a trusted peer)
        self.memfd_puts = False  # its PUTs go into node-written memfds (shared memory, the node writing)
        self._shm_writes: list[PutTicket] = []  # memfds of the last SHM_PUT the client may be writing
        self._shm_writes_due = 0.0  # when their SHM_COMMIT must have arrived (monotonic)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._drop_shm_writes()  # what the client wrote there is its own memory now

    def _run(self) -> None:
        if not self._handshake():
            return
        while not self.node._stopping.is_set():
            try:
                self._serve_one()
            except _CleanClose:
                return
            except TimeoutError:
                self.metrics.errors.labels("timeout").inc()
                return
            except OSError:
                self.metrics.errors.labels("io").inc()
                return
            except AuthError as exc:  # a frame after the handshake: its MAC or its sequence number
                reason = "bad_sequence" if exc.reason == "bad_sequence" else "bad_mac"
                self.metrics.auth_failures.labels(reason).inc()
                self._send_error(
                    p.ErrorCode.BAD_SEQUENCE if reason == "bad_sequence" else p.ErrorCode.BAD_MAC, str(exc)
                )
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
                if hello[:1] == bytes([TLS_HANDSHAKE_BYTE]) and not isinstance(self.sock, ssl.SSLSocket):
                    reason = "tls_on_plain_port"  # a TLS client: it cannot read the refusal below
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
            # The same-host socket is named to plain connections only: a TLS client asked for TLS.
            local = None if isinstance(self.sock, ssl.SSLSocket) else self.node.local_socket
            self.shared_memory = self.node.shared is not None and self.sock.family == socket.AF_UNIX
            self.shared_memory = self.shared_memory and self.node.trusts(self.sock)
            shm_put = self.shared_memory and self.node.client_stores
            # Its stores over this socket go into memfds the node writes (--shared-memory-stores
            # node); a value from another host stays in private memory.
            self.memfd_puts = self.shared_memory and not shm_put
            hello_ok = p.HelloOk(self.node.node_id, self.node.limits, local, self.shared_memory, shm_put)
            send_all(self.sock, [self.codec.encode(hello_ok)], deadline)
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
        if self._shm_writes:
            # The client is writing the values of its SHM_PUT: their SHM_COMMIT must come within
            # io_timeout_s of the reply, as a PUT's values must arrive, or the reservations are
            # dropped (their memfds closed) and the connection ends.
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if not poller.poll(max(0, int((self._shm_writes_due - time.monotonic()) * 1000))):
                raise TimeoutError("SHM_PUT not committed within io_timeout_s")
        set_recv_timeout(self.sock, cfg.idle_timeout_s)
        try:
            n = self.sock.recv_into(view)
        except BlockingIOError:  # SO_RCVTIMEO expired: idle past idle_timeout_s
            raise TimeoutError("idle timeout") from None
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
        if self._shm_writes and not isinstance(msg, p.ShmCommitRequest):
            raise RemoteProtocolError(
                f"{type(msg).__name__} after an SHM_PUT: the next frame must be its SHM_COMMIT", p.ErrorCode.MALFORMED
            )
        found = _HANDLERS.get(header.opcode)
        if found is None:
            raise RemoteProtocolError(f"opcode 0x{header.opcode:02x} is not a request", p.ErrorCode.UNKNOWN_OPCODE)
        name, handle = found
        started = time.perf_counter()
        # Counted before the reply goes out: a client that got its answer then reads the
        # metrics must see its request (counting after the send raced such a reader).
        self.metrics.requests.labels(name).inc()
        seconds = self.metrics.request_seconds.labels(name)  # the series exists from now on too
        handle(self, msg)
        seconds.observe(time.perf_counter() - started)

    # -- one handler per request (_HANDLERS) ------------------------------------------------------

    def _ping(self, msg: p.PingRequest) -> None:
        self._reply(p.PingReply())

    def _exists(self, msg: p.ExistsRequest) -> None:
        statuses = self.node.store.exists(msg.keys)
        self._count_keys("exists", statuses)
        self._reply(p.StatusReply(p.Opcode.EXISTS, statuses))

    def _delete(self, msg: p.DeleteRequest) -> None:
        statuses = self.node.store.delete(msg.keys)
        self._count_keys("delete", statuses)
        self._reply(p.StatusReply(p.Opcode.DELETE, statuses))

    def _list(self, msg: p.ListRequest) -> None:
        found, truncated = self.node.store.list_keys(msg.prefix, msg.limit)
        if found:
            self.metrics.keys.labels("list", "ok").inc(len(found))
        self._reply(p.ListReply(tuple(k for k, _ in found), tuple(n for _, n in found), truncated))

    def _lease(self, msg: p.LeaseRequest) -> None:
        statuses, lengths, ttl_s = self.node.store.lease(msg.keys, msg.token, msg.ttl_ms / 1000.0)
        self._count_keys("lease", statuses)
        self._reply(p.LeaseReply(statuses, tuple(lengths), max(1, int(ttl_s * 1000))))

    def _release(self, msg: p.ReleaseRequest) -> None:
        statuses = self.node.store.end_leases(msg.keys, msg.token)
        self._count_keys("release", statuses)
        self._reply(p.StatusReply(p.Opcode.RELEASE, statuses))

    def _rdma(self, msg: p.RdmaAttachRequest | p.RdmaGetRequest) -> None:  # memkv/server/rdma.py
        ctx = RequestContext(self.sock, self.peer, self.node.config.io_timeout_s, self._count_rdma_get, self._hung_up)
        self._reply(self.node.rdma.handle(ctx, msg))

    def _put(self, msg: p.PutRequest) -> None:
        """Receive the items one after another. Room for an item (which may evict committed
        values) is reserved only once its first bytes have arrived, read into the connection's
        scratch buffer and then copied to the head of the reserved buffer: a writer that declares
        a value and sends nothing takes nothing from the cache."""
        store = self.node.store
        statuses = bytearray()
        if self._scratch is None:
            self._scratch = memoryview(bytearray(HEAD_BYTES))
        for item in msg.items:
            head = self._scratch[: min(item.length, HEAD_BYTES)]
            recv_exactly_into(self.sock, head, self._deadline)
            try:
                ticket = store.begin_put(
                    item.key,
                    item.length,
                    item.algo,
                    item.checksum,
                    wait_s=max(0.0, min(INFLIGHT_WAIT_S, self._deadline - time.monotonic())),
                    memfd=self.memfd_puts,
                )
            except NoSpace as exc:
                self.metrics.puts_refused.labels(exc.reason).inc()
                discard(self.sock, item.length - len(head), self._scratch, self._deadline)
                statuses.append(p.ItemStatus.NO_SPACE)
                continue
            except Leased:  # a leased value is never replaced (store.py, "Leases")
                self.metrics.puts_refused.labels("leased").inc()
                discard(self.sock, item.length - len(head), self._scratch, self._deadline)
                statuses.append(p.ItemStatus.LEASED)
                continue
            try:
                ticket.target[: len(head)] = head
                recv_exactly_into(self.sock, ticket.target[len(head) :], self._deadline)
            except BaseException:
                store.abort(ticket)  # a half-received value never becomes visible
                raise
            if not store.commit(ticket):  # leased while it was being received
                self.metrics.puts_refused.labels("leased").inc()
                statuses.append(p.ItemStatus.LEASED)
                continue
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
            send_all(
                self.sock,
                [self.codec.encode(p.GetReply(tuple(items)), validate=False), *values],
                time.monotonic() + self.node.config.io_timeout_s,
            )
            self.metrics.bytes_out.inc(sum(len(v) for v in values))
        finally:
            store.release(pinned)

    # -- shared memory (docs/protocol.md section 13) ----------------------------------------------

    def _shared(self, op: str) -> SharedValues:
        shared = self.node.shared
        if shared is None or not self.shared_memory:
            raise RemoteProtocolError(
                f"{op}: this connection was not offered shared memory (HELLO_OK): only the same-host socket "
                "of a node that shares memory offers it, to a peer of the node's uid or its shared-memory group",
                p.ErrorCode.MALFORMED,
            )
        return shared

    def _shm_get(self, msg: p.ShmGetRequest) -> None:
        """Each value's memfd (where the client asked for it) and checksum: a committed one or a
        node-written one. Nothing stays pinned once the reply is sent: a committed memfd never
        changes (the client's mapping keeps the bytes it copies), and a node-written one that
        holds another value by then fails the client's check (it GETs the value instead). A value
        in private memory answers NOT_SHARED: GET it."""
        self._shared("SHM_GET")
        store = self.node.store
        found = store.acquire(msg.keys, msg.expected_lengths, p.ANY_LENGTH)
        pinned = [e for e in found if not isinstance(e, int)]
        try:
            items, passed, fds = [], bytearray(), list[int]()
            no_sum = bytes(p.CHECKSUM_BYTES)
            sent = 0
            for e, wanted in zip(found, msg.want):
                if isinstance(e, int):
                    items.append(p.GetReplyItem(e, 0, 0, no_sum))
                    passed.append(0)
                elif e.buf.fd < 0 or (wanted and len(fds) >= p.MAX_SHM_FDS):
                    items.append(p.GetReplyItem(p.ItemStatus.NOT_SHARED, 0, 0, no_sum))
                    passed.append(0)
                else:
                    items.append(p.GetReplyItem(p.ItemStatus.OK, e.length, e.algo, e.checksum))
                    passed.append(wanted)
                    if wanted:
                        fds.append(e.buf.fd)
                    sent += e.length
            self._reply_with_fds(p.ShmGetReply(tuple(items), bytes(passed), p.Opcode.SHM_GET), fds)
        finally:
            store.release(pinned)  # the descriptors are the client's now
        statuses = bytes(it.status for it in items)
        self._count_keys("get", statuses.replace(bytes([p.ItemStatus.NOT_SHARED]), b""))
        self.metrics.bytes_out.inc(sent)

    def _hung_up(self) -> bool:
        """Whether the client has closed its end (FIN or reset received); never blocks."""
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def _shm_put(self, msg: p.ShmPutRequest) -> None:
        """Reserve a new memfd per item (as a PUT reserves a buffer, evicting if need be) and pass
        it; the client writes the values itself and commits them with its next frame. An item
        that cannot have one (below SHM_MIN_VALUE, a memfd bound or the in-flight bound reached)
        answers NOT_SHARED: the client PUTs it over the socket; every item does where the node
        writes its memfds itself (--shared-memory-stores node: HELLO_OK's `shm_put` is false)."""
        self._shared("SHM_PUT")
        for item in msg.items:
            if item.algo not in {a.value for a in p.ChecksumAlgo}:
                known = ", ".join(f"{a.value} ({a.name.lower()})" for a in p.ChecksumAlgo)
                raise RemoteProtocolError(
                    f"SHM_PUT: checksum algorithm {item.algo} is not one this node knows ({known})",
                    p.ErrorCode.MALFORMED,
                )
        store = self.node.store
        items, passed = [], bytearray()
        no_sum = bytes(p.CHECKSUM_BYTES)
        deadline = time.monotonic() + min(INFLIGHT_WAIT_S, self.node.config.io_timeout_s)
        try:
            for item in msg.items:
                status = p.ItemStatus.NOT_SHARED
                ticket = None
                fits = item.length >= p.SHM_MIN_VALUE and len(self._shm_writes) < p.MAX_SHM_FDS
                if fits and self.node.client_stores:
                    try:
                        # Only the first item waits for the in-flight bound: later ones would wait
                        # for this very request's reservations.
                        wait_s = max(0.0, deadline - time.monotonic()) if not self._shm_writes else 0.0
                        ticket = store.begin_shared_put(item.key, item.length, item.algo, item.checksum, wait_s)
                    except NoSpace as exc:
                        if exc.reason != "inflight_limit":
                            self.metrics.puts_refused.labels(exc.reason).inc()
                            status = p.ItemStatus.NO_SPACE
                    except Leased:
                        self.metrics.puts_refused.labels("leased").inc()
                        status = p.ItemStatus.LEASED
                if ticket is None:
                    items.append(p.GetReplyItem(status, 0, 0, no_sum))
                    passed.append(0)
                    continue
                self._shm_writes.append(ticket)
                items.append(p.GetReplyItem(p.ItemStatus.OK, item.length, item.algo, item.checksum))
                passed.append(1)
            fds = [ticket.buf.fd for ticket in self._shm_writes if isinstance(ticket.buf, SealedBuffer)]
            self._shm_writes_due = time.monotonic() + self.node.config.io_timeout_s
            self._reply_with_fds(p.ShmGetReply(tuple(items), bytes(passed), p.Opcode.SHM_PUT), fds)
        except BaseException:
            self._drop_shm_writes()
            raise

    def _shm_commit(self, msg: p.ShmCommitRequest) -> None:
        """Seal the memfds the client wrote (flag 1) against writing and store their values under
        the checksums it computed as it wrote them; drop the ones it did not write (0). A memfd
        some process still maps writable cannot be sealed: STILL_MAPPED, not stored."""
        shared = self._shared("SHM_COMMIT")
        writes, self._shm_writes = self._shm_writes, []
        if len(msg.written) != len(writes):
            self._shm_writes = writes  # dropped as the connection ends
            raise RemoteProtocolError(
                f"SHM_COMMIT of {len(msg.written)} flags for the {len(writes)} memfds the SHM_PUT before it passed",
                p.ErrorCode.MALFORMED,
            )
        store = self.node.store
        statuses = bytearray()
        for ticket, written, checksum in zip(writes, msg.written, msg.checksums):
            if not written:
                store.abort(ticket)
                statuses.append(p.ItemStatus.MISS)
                continue
            assert isinstance(ticket.buf, SealedBuffer)
            try:
                ticket.buf.seal()
            except StillMapped as exc:
                store.abort(ticket)
                shared.refused_commit()
                log.warning("%s: SHM_COMMIT of %r refused: %s", self.peer, ticket.key[:64], exc.strerror)
                statuses.append(p.ItemStatus.STILL_MAPPED)
                continue
            ticket.checksum = checksum  # every reader verifies it against the bytes it copies
            if not store.commit(ticket):  # leased while it was being written
                self.metrics.puts_refused.labels("leased").inc()
                statuses.append(p.ItemStatus.LEASED)
            else:
                statuses.append(p.ItemStatus.OK)
                self.metrics.bytes_in.inc(ticket.length)
        self._count_keys("put", statuses)
        self._reply(p.StatusReply(p.Opcode.SHM_COMMIT, bytes(statuses)))

    def _drop_shm_writes(self) -> None:
        if self._shm_writes:
            writes, self._shm_writes = self._shm_writes, []
            for ticket in writes:
                self.node.store.abort(ticket)
            if self.node.shared is not None:
                self.node.shared.reclaimed_reservations(len(writes))
            log.warning(
                "%s: %d SHM_PUT reservation(s) never committed: dropped (their memfds closed)", self.peer, len(writes)
            )

    def _reply_with_fds(self, msg: p.Message, fds: list[int]) -> None:
        """A reply whose descriptors ride on its first bytes (SCM_RIGHTS)."""
        assert self.codec is not None
        frame = self.codec.encode(msg, validate=False)
        deadline = time.monotonic() + self.node.config.io_timeout_s
        sent = socket.send_fds(self.sock, [frame], fds) if fds else 0  # blocking: SO_SNDTIMEO bounds it
        send_all(self.sock, [memoryview(frame)[sent:]], deadline)

    def _count_rdma_get(self, statuses: bytes, bytes_out: int) -> None:
        self._count_keys("get", statuses)
        if bytes_out:
            self.metrics.bytes_out.inc(bytes_out)

    def _count_keys(self, op: str, statuses: bytes | bytearray) -> None:
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


# Opcode -> (the request's name in metrics and logs, its handler). The codec has already checked
# that the frame is this request; a request opcode missing here is refused (UNKNOWN_OPCODE).
_HANDLERS: dict[int, tuple[str, Callable[[Connection, Any], None]]] = {
    p.Opcode.PING: ("ping", Connection._ping),
    p.Opcode.PUT: ("put", Connection._put),
    p.Opcode.GET: ("get", Connection._get),
    p.Opcode.EXISTS: ("exists", Connection._exists),
    p.Opcode.DELETE: ("delete", Connection._delete),
    p.Opcode.LIST: ("list", Connection._list),
    p.Opcode.LEASE: ("lease", Connection._lease),
    p.Opcode.RELEASE: ("release", Connection._release),
    p.Opcode.RDMA_ATTACH: ("rdma_attach", Connection._rdma),  # RDMA control messages: memkv/server/rdma.py
    p.Opcode.RDMA_GET: ("rdma_get", Connection._rdma),
    p.Opcode.SHM_GET: ("shm_get", Connection._shm_get),  # shared memory: memkv/server/shm.py
    p.Opcode.SHM_PUT: ("shm_put", Connection._shm_put),  # a client writing values into memfds itself
    p.Opcode.SHM_COMMIT: ("shm_commit", Connection._shm_commit),
}
