"""One MemKV node as seen by the client: authenticated connections, a pool, and health.

`NodeConnection` is one authenticated socket (handshake + frame codec). `NodeClient` keeps a
LIFO pool of them, bounded by `pool_size`, and a small health state: after a transport or
protocol failure the node is marked down for `down_for_s`; while down, calls fail fast with
NodeUnavailable (the cluster turns that into a miss for reads). After that time the next call
tries again. A connection that failed in any way is closed, never returned to the pool
(the stream position after an error is unknown).

Same-host nodes (docs/protocol.md section 2.6): a node names its abstract Unix socket in
HELLO_OK; once a TCP connection has learnt the name, NodeClient opens its connections there
(same protocol, same handshake; a cheaper kernel path than loopback TCP: docs/performance.md) and
closes the TCP one. A name that cannot be reached from here (another host or
network namespace: refused at once) or that answers as another node is not tried again; a node
that restarted names a new socket, learnt on the next TCP connection. Any process may bind a
name its node gave up, so the socket gets a short deadline (`local_handshake_s`) and any
failure there sends that connection to TCP, which names the node's current socket: a socket
alone never marks the node down.

Threading: NodeClient is thread-safe; a NodeConnection is used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from memkv import protocol as p
from memkv.client.shared import MappedValues, SealError, check_sealed, copy_verified, read_verified, write_value
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
    map_os_error,
)
from memkv.integrity import Checksummer
from memkv.memfd import unmap
from memkv.protocol import ChecksumAlgo
from memkv.sockio import (
    PeerClosed,
    can_recv_xxh3,
    recv_exactly,
    recv_exactly_into,
    recv_exactly_with_fds,
    recv_xxh3_into,
    send_all,
    set_timeouts,
)

# Values are received and hashed in pieces: small ones while few threads of the process receive
# at once, large ones otherwise (`_receive_step`). A small piece is hashed right after its
# receive, while the kernel's copy left it in cache: 256 KiB pieces hash at ~35 GB/s on the
# 2-vCPU VM, a 16 MiB value reread afterwards at 5-10 GB/s: there the reread cost as much CPU as
# half of the client's kernel time of a GET (docs/performance.md, "Data path"). But every piece costs two
# GIL hand-offs: with many receiving threads, and in a busy process (vLLM's engine loop holds the
# GIL), 1-4 MiB pieces cut a 16-thread load on the GPU host from 14 to 12 GB/s, and from 8 to
# 2-5 GB/s beside a busy thread (bench/gpu/xfer.py), whose 300 MiB L3 holds the values anyway.
_VERIFY_CHUNK = 16 << 20  # while more than _SMALL_PIECES_UP_TO threads receive
_VERIFY_PIECE = 256 << 10  # while at most _SMALL_PIECES_UP_TO threads receive
_SMALL_PIECES_UP_TO = 2
# Over TLS a receive takes one 16 KiB record per call (a GIL hand-off each) whatever the piece
# size, so pieces this small cost no extra hand-offs and are hashed while still in L2 cache
# (16 MiB pieces were hashed from DRAM: 10% of a TLS GET on the 2-vCPU VM, docs/performance.md).
# The pieces are cut inside sockio's loop over records (its `on_piece`), not by a loop here.
_TLS_VERIFY_CHUNK = 256 << 10
# The compiled loop (sockio.recv_xxh3_into) hands off the GIL once per value, not per piece, so
# its pieces can stay small whatever the number of receivers: each is hashed from L2.
_COMPILED_PIECE = 256 << 10

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


def handshake_timeout_s(connect_timeout_s: float, io_timeout_s: float) -> float:
    """The bound of a whole handshake, once the TCP connection is up."""
    return max(connect_timeout_s, io_timeout_s, 1.0)


# The bound of a connect plus handshake on a same-host socket. Its name may belong to another
# process by now (the node exited and anyone bound it: abstract names have no owner or
# permissions); one that accepts and stays silent must cost a caller this much once, not an
# io timeout per call. A live but busy node that misses it only sends that connection to TCP.
LOCAL_HANDSHAKE_S = 1.0


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
        # Values exchanged as memfds: set by NodeClient on a same-host connection whose node
        # offered it (HELLO_OK shared_memory); loads and stores then go through them.
        self.memory: MappedValues | None = None
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
        with self._io("handshake"):
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
    def _io(self, op: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:  # includes socket.timeout and ConnectionError
            raise map_os_error(exc, "write" if op == "write" else "read", self.name) from exc

    def _deadline(self) -> float:
        """When a request or reply started now must be complete: io_timeout_s bounds the whole
        frame, not each read, so a peer trickling bytes cannot hold the caller longer."""
        return time.monotonic() + self.io_timeout_s

    def _read_reply(self, codec: p.FrameCodec, prefix: bytes | None = None, deadline: float | None = None) -> p.Message:
        deadline = self._deadline() if deadline is None else deadline
        with self._io("read"):
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
        with self._io("write"):
            send_all(self.sock, [frame, *payload], self._deadline())

    def read_reply(self) -> p.Message:
        return self._read_reply(self.codec)

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
        with self._io("write"), self._no_wait() as flags:
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
        with self._io("read"), self._no_wait() as flags:
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

    def get_into(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """GET values straight into `views` (each exactly the expected length).

        Returns (loaded, checksum_failures). `loaded[i]` is True only for a value received whole
        whose checksum verified. On a checksum failure the item is False, counted in
        `checksum_failures`, and the connection stays usable. Raises on transport/protocol
        errors: every value not yet verified counts as not loaded.
        """
        if self.memory is not None:
            return self._get_shared(self.memory, keys, views, checksummer)
        return self._get_received(keys, views, checksummer)

    def _get_received(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """GET: the values come over the socket."""
        request = p.GetRequest(tuple(keys), tuple(len(v) for v in views))
        with self._io("write"):
            send_all(self.sock, [self.codec.encode(request)], self._deadline())
        deadline = self._deadline()  # for the whole reply, values included
        reply = self.matched(request, self._read_reply(self.codec, deadline=deadline))
        assert isinstance(reply, p.GetReply)
        results = []
        bad_sums = 0
        for item, view in zip(reply.items, views):
            if item.status != p.ItemStatus.OK:
                results.append(False)
                continue
            if item.length != len(view):
                # Full-length-or-miss is the node's promise; a node that breaks it is not trusted.
                raise RemoteProtocolError(f"{self.name}: sent {item.length} bytes for a {len(view)}-byte GET")
            ok = self._recv_verified(view, item.algo, item.checksum, checksummer, deadline)
            bad_sums += not ok
            results.append(ok)
        return results, bad_sums

    def _get_shared(
        self, memory: MappedValues, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """SHM_GET the values of SHM_MIN_VALUE and more: each copied from its sealed memfd (one
        this process still maps, or one the node passes now) and verified here. The others
        (smaller, or NOT_SHARED: in the node's private memory) come by GET (docs/protocol.md
        section 13)."""
        big = [i for i, v in enumerate(views) if len(v) >= p.SHM_MIN_VALUE]
        if not big:
            return self._get_received(keys, views, checksummer)
        if memory.retired:  # the node process it maps is gone (see NodeClient._memory_for)
            self.memory = None
            return self._get_received(keys, views, checksummer)
        results = [False] * len(keys)
        bad_sums = 0
        by_socket = [i for i, v in enumerate(views) if len(v) < p.SHM_MIN_VALUE]
        big_keys = [keys[i] for i in big]
        want = bytes(not mapped for mapped in memory.has(big_keys))
        request = p.ShmGetRequest(tuple(big_keys), tuple(len(views[i]) for i in big), want)
        reply, fds = self._shm_request(request, p.Opcode.SHM_GET)
        try:
            for j, i in enumerate(big):
                item = reply.items[j]
                fd = fds.pop(0) if reply.passed[j] else None
                if item.status not in (p.ItemStatus.OK, p.ItemStatus.NOT_SHARED):
                    memory.forget(keys[i])  # gone from the node: the bytes this process still maps go too
                    continue  # a miss, not a checksum failure (a passed item is OK: _shm_request)
                try:
                    ok = self._copy_shared(memory, keys[i], item, fd, views[i], checksummer)
                finally:
                    if fd is not None:
                        os.close(fd)
                if ok is None:
                    by_socket.append(i)
                else:
                    bad_sums += not ok
                    results[i] = ok
        finally:
            for fd in fds:
                os.close(fd)
        if memory.refused:
            self.memory = None
        if by_socket:
            by_socket.sort()
            got, bad = self._get_received([keys[i] for i in by_socket], [views[i] for i in by_socket], checksummer)
            for i, ok in zip(by_socket, got):
                results[i] = ok
            bad_sums += bad
        return results, bad_sums

    def _copy_shared(
        self,
        memory: MappedValues,
        key: bytes,
        item: p.GetReplyItem,
        fd: int | None,
        view: memoryview,
        checksummer: Checksummer,
    ) -> bool | None:
        """One SHM_GET item (OK or NOT_SHARED) into `view`: whether it verified, or None when it
        must come over the socket (NOT_SHARED, a mapping of another value, a refused memfd)."""
        if item.status == p.ItemStatus.NOT_SHARED:
            return None
        if item.length != len(view):
            raise RemoteProtocolError(f"{self.name}: SHM_GET gave {item.length} bytes for a {len(view)}-byte GET")
        if fd is None:
            found = memory.find(key)
            if found is None:
                return None
            try:
                if found.length != item.length or not hmac.compare_digest(found.checksum, item.checksum):
                    memory.forget(key)  # the node holds another value of this key now
                    return None
                return copy_verified(view, found.addr, item.algo, item.checksum, checksummer)
            finally:
                memory.done(found)
        try:
            check_sealed(fd, item.length)
        except SealError as exc:
            log.warning("MemKV: %s: shared memory off for this node process: %s", self.name, exc.strerror)
            memory.refuse(str(exc.strerror))
            return None
        return read_verified(view, fd, item.algo, item.checksum, checksummer)

    def _shm_request(self, msg: p.ShmGetRequest | p.ShmPutRequest, opcode: p.Opcode) -> tuple[p.ShmGetReply, list[int]]:
        """Send an SHM_GET or SHM_PUT; its reply and the descriptors it passed, exactly one per
        item it flags (the caller closes them; none is left open on an error)."""
        self.send(msg)
        deadline = self._deadline()
        with self._io("read"):
            prefix, fds = recv_exactly_with_fds(self.sock, p.FRAME_PREFIX_BYTES, p.MAX_SHM_FDS, deadline)
            try:
                header = self.codec.parse_header(prefix)
                meta, more = recv_exactly_with_fds(self.sock, header.meta_len, p.MAX_SHM_FDS, deadline)
                fds += more
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        try:
            reply = self.codec.open(header, bytes(prefix), meta)
            if isinstance(reply, p.ErrorReply):
                raise ServerError(f"{self.name}: node error {p.error_name(reply.code)}: {reply.message}", reply.code)
            reply = self.matched(msg, reply)
            assert isinstance(reply, p.ShmGetReply)
            if sum(reply.passed) != len(fds):
                raise RemoteProtocolError(
                    f"{self.name}: {opcode.name} reply flags {sum(reply.passed)} memfd(s), passed {len(fds)}"
                )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return reply, fds

    def put_shared(
        self, memory: MappedValues, keys: Sequence[bytes], values: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[bytes, list[int]]:
        """SHM_PUT `keys` (values of SHM_MIN_VALUE and more), write each value into the memfd the
        node passed for it, hashing it as it is written (`write_value`: one pass over the bytes,
        no writable mapping left after), SHM_COMMIT them with those checksums: (one status per
        key, the indexes answered NOT_SHARED, which the caller PUTs over the socket). This
        process keeps a read-only mapping of each value stored so (`MappedValues`)."""
        if memory.retired:
            self.memory = None
            return bytes([p.ItemStatus.NOT_SHARED]) * len(keys), list(range(len(keys)))
        algo = checksummer.algo
        no_sum = bytes(p.CHECKSUM_BYTES)
        items = [p.PutItem(k, len(v), algo, no_sum) for k, v in zip(keys, values)]
        kept: dict[int, tuple[int, int]] = {}
        try:
            reply, fds = self._shm_request(p.ShmPutRequest(tuple(items)), p.Opcode.SHM_PUT)
            places = [i for i, passed in enumerate(reply.passed) if passed]
            # Once the node has passed them, the next frame must be their SHM_COMMIT: a value not
            # written (a memfd this process refuses) is committed as not written.
            written = bytearray()
            checksums = []
            try:
                for i in places:
                    fd = fds.pop(0)
                    checksum = no_sum
                    if reply.items[i].length != items[i].length:
                        os.close(fd)
                        raise RemoteProtocolError(
                            f"{self.name}: SHM_PUT passed {reply.items[i].length} bytes for {items[i].length}"
                        )
                    if memory.refused:
                        os.close(fd)
                    else:
                        try:
                            checksum, mapping = write_value(fd, values[i], algo, checksummer, keep=True)
                            if mapping is not None:
                                kept[i] = mapping
                        except SealError as exc:
                            log.warning(
                                "MemKV: %s: shared memory off for this node process: %s", self.name, exc.strerror
                            )
                            memory.refuse(str(exc.strerror))
                    written.append(i in kept)
                    checksums.append(checksum)
            finally:
                for fd in fds:
                    os.close(fd)
            statuses = bytearray(item.status for item in reply.items)
            if places:
                done = self.request(p.ShmCommitRequest(bytes(written), tuple(checksums)))
                assert isinstance(done, p.StatusReply)  # one status per flag: NodeConnection.matched
                for i, ok, checksum, status in zip(places, written, checksums, done.statuses):
                    statuses[i] = status if ok else p.ItemStatus.NOT_SHARED
                    if ok and status == p.ItemStatus.OK:
                        addr, size = kept.pop(i)
                        memory.add(keys[i], addr, size, items[i].length, checksum)
            if memory.refused:
                self.memory = None
        finally:
            for addr, size in kept.values():  # not stored: nothing to load from
                unmap(addr, size)
        return bytes(statuses), [i for i, s in enumerate(statuses) if s == p.ItemStatus.NOT_SHARED]

    def _recv_verified(
        self, view: memoryview, algo: int, checksum: bytes, checksummer: Checksummer, deadline: float
    ) -> bool:
        """Receive a value into `view` in pieces, hashing each piece right after it arrived
        (`_receive_step` says how large: in cache, or fewer GIL hand-offs). An xxh3 value on
        plain TCP goes through the compiled loop when it is there: small pieces, no hand-offs."""
        if algo == ChecksumAlgo.XXH3_128 and can_recv_xxh3(self.sock):
            with self._io("read"):
                digest = recv_xxh3_into(self.sock, view, deadline, _COMPILED_PIECE)
            return hmac.compare_digest(Checksummer.padded(digest), checksum)
        try:
            hasher = checksummer.hasher(algo)
        except ValueError:  # unknown algorithm: receive (to keep the stream in step), then fail
            hasher = None
        with _RECEIVERS.receiving() as receivers, self._io("read"):
            step = _receive_step(isinstance(self.sock, ssl.SSLSocket), receivers)
            recv_exactly_into(self.sock, view, deadline, hasher.update if hasher is not None else None, step)
        return hasher is not None and hmac.compare_digest(checksummer.finish(hasher), checksum)

    def get_values(self, keys: Sequence[bytes], checksummer: Checksummer) -> tuple[list[bytes | None], int]:
        """GET values of unknown length into fresh buffers (convenience path, not the data path).
        Returns (values, checksum_failures): a value whose checksum failed is None, as a miss,
        and counted; the connection stays usable, as after `get_into`."""
        request = p.GetRequest(tuple(keys), tuple(p.ANY_LENGTH for _ in keys))
        with self._io("write"):
            send_all(self.sock, [self.codec.encode(request)], self._deadline())
        deadline = self._deadline()
        reply = self.matched(request, self._read_reply(self.codec, deadline=deadline))
        assert isinstance(reply, p.GetReply)
        out: list[bytes | None] = []
        bad_sums = 0
        for item in reply.items:
            if item.status != p.ItemStatus.OK:
                out.append(None)
                continue
            with self._io("read"):
                buf = recv_exactly(self.sock, item.length, deadline)
            good = checksummer.verify(buf, item.algo, item.checksum)
            bad_sums += not good
            out.append(bytes(buf) if good else None)
        return out, bad_sums


class _Receivers:
    """How many threads of this process are receiving a value right now (all clients together)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def receiving(self) -> Iterator[int]:
        """The block counts as one receiver; yields the count including it."""
        with self._lock:
            self.count += 1
            now = self.count
        try:
            yield now
        finally:
            with self._lock:
                self.count -= 1


_RECEIVERS = _Receivers()


def _receive_step(tls: bool, receivers: int) -> int:
    """The piece size a value is received and hashed in, with `receivers` threads receiving."""
    if tls:
        return _TLS_VERIFY_CHUNK
    return _VERIFY_PIECE if receivers <= _SMALL_PIECES_UP_TO else _VERIFY_CHUNK


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
        on_health: Callable[[str, bool], None] | None = None,
        connect: Connect = tcp_connect,
        local_socket: bool = True,
        shared_memory: bool = False,
    ) -> None:
        """`local_socket`: use the node's same-host socket when it names one that works.
        `shared_memory`: there, copy values from the node's memory when it offers it."""
        self.address = address
        self.name = address.name
        self._auth_key = auth_key
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._down_for_s = down_for_s
        self.checksummer = checksummer
        self._idle: list[NodeConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._down_until = 0.0
        self.last_error: str | None = None
        self.failures = 0
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
            self.last_error = str(error)
            idle, self._idle = self._idle, []
        for conn in idle:  # the node failed: its other pooled sockets are suspect too
            conn.close()
        if self._on_health:
            self._on_health(self.name, False)

    def _mark_up(self) -> None:
        if self._down_until:
            self._down_until = 0.0
            if self._on_health:
                self._on_health(self.name, True)

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
        if self._use_shared and conn.hello.shared_memory:
            conn.memory = self._memory_for(name)
        return conn

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
        unknown); a transport or remote protocol error also marks the node down. A
        LocalProtocolError is the caller's usage error, raised before anything was sent: it
        says nothing about the node."""
        try:
            if error is not None:
                conn.close()
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
        """PUT `views` under `keys` (one request's worth: `byte_chunks`); one status per key. On
        a connection that shares the node's memory, values of SHM_MIN_VALUE and more are written
        into memfds (SHM_PUT, `NodeConnection.put_shared`, hashed as they are copied) and the rest go
        over the socket (hashed first)."""
        conn = self.borrow()
        statuses = bytearray(len(keys))
        by_socket = list(range(len(keys)))
        try:
            memory = conn.memory
            big = [i for i, v in enumerate(views) if len(v) >= p.SHM_MIN_VALUE]
            if memory is not None and big:
                shared, not_shared = conn.put_shared(
                    memory, [keys[i] for i in big], [views[i] for i in big], checksummer
                )
                for i, status in zip(big, shared):
                    statuses[i] = status
                small = [i for i, v in enumerate(views) if len(v) < p.SHM_MIN_VALUE]
                by_socket = sorted(small + [big[j] for j in not_shared])
            if by_socket:
                algo = checksummer.algo
                items = tuple(p.PutItem(keys[i], len(views[i]), algo, checksummer.compute(views[i])) for i in by_socket)
                sent = _statuses(conn, p.PutRequest(items), [views[i] for i in by_socket])
                for i, status in zip(by_socket, sent):
                    statuses[i] = status
        except BaseException as exc:
            self.give_back(conn, exc)
            raise
        self.give_back(conn)
        return bytes(statuses)


def _statuses(conn: NodeConnection, msg: p.Request, payload: Sequence[memoryview] = ()) -> bytes:
    reply = conn.request(msg, payload)
    assert isinstance(reply, (p.StatusReply, p.LeaseReply))
    return reply.statuses


__all__ = ["NodeConnection", "NodeClient", "MemKVError"]
