"""The socket way: values streamed over one authenticated connection (TCP, the same-host Unix
socket, TLS), right after the reply's meta.

`SocketStream` moves the values of one `NodeConnection`: a GET's values are received straight
into the caller's buffers and hashed piece by piece while they are in cache; a PUT sends them
after its meta, each hashed first. It is every connection's way unless the node's shared
memory is used (memkv/transport/shm.py, which builds on this one for the values it leaves to
the socket). Chosen once per connection (`memkv.transport.open_way`).
"""

from __future__ import annotations

import contextlib
import hmac
import ssl
import threading
from collections.abc import Iterator, Sequence

from memkv import protocol as p
from memkv.client.node import NodeConnection
from memkv.errors import RemoteProtocolError
from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo
from memkv.sockio import can_recv_xxh3, recv_exactly, recv_exactly_into, recv_xxh3_into

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
# (16 MiB pieces were hashed from DRAM: 10% of a TLS GET on the 2-vCPU VM, docs/archive/performance-log.md).
# The pieces are cut inside sockio's loop over records (its `on_piece`), not by a loop here.
_TLS_VERIFY_CHUNK = 256 << 10
# The compiled loop (sockio.recv_xxh3_into) hands off the GIL once per value, not per piece, so
# its pieces can stay small whatever the number of receivers: each is hashed from L2.
_COMPILED_PIECE = 256 << 10


class SocketStream:
    """The values of one connection, over its socket. Used by one thread at a time, as the
    connection is. Raises MemKVError subclasses only."""

    name = "socket"

    def __init__(self, conn: NodeConnection) -> None:
        self.conn = conn

    def get_into(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """GET values straight into `views` (each exactly the expected length).

        Returns (loaded, checksum_failures). `loaded[i]` is True only for a value received whole
        whose checksum verified. On a checksum failure the item is False, counted in
        `checksum_failures`, and the connection stays usable. Raises on transport/protocol
        errors: every value not yet verified counts as not loaded.
        """
        conn = self.conn
        request = p.GetRequest(tuple(keys), tuple(len(v) for v in views))
        conn.send(request)
        deadline = conn.deadline()  # for the whole reply, values included
        reply = conn.matched(request, conn.read_reply(deadline))
        assert isinstance(reply, p.GetReply)
        results = []
        bad_sums = 0
        for item, view in zip(reply.items, views):
            if item.status != p.ItemStatus.OK:
                results.append(False)
                continue
            if item.length != len(view):
                # Full-length-or-miss is the node's promise; a node that breaks it is not trusted.
                raise RemoteProtocolError(f"{conn.name}: sent {item.length} bytes for a {len(view)}-byte GET")
            ok = self._recv_verified(view, item.algo, item.checksum, checksummer, deadline)
            bad_sums += not ok
            results.append(ok)
        return results, bad_sums

    def put(self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer) -> bytes:
        """PUT `views` under `keys` (one request's worth: `byte_chunks`), each hashed first: one
        status per key."""
        algo = checksummer.algo
        items = tuple(p.PutItem(k, len(v), algo, checksummer.compute(v)) for k, v in zip(keys, views))
        reply = self.conn.request(p.PutRequest(items), views)
        assert isinstance(reply, (p.StatusReply, p.LeaseReply))
        return reply.statuses

    def get_values(self, keys: Sequence[bytes], checksummer: Checksummer) -> tuple[list[bytes | None], int]:
        """GET values of unknown length into fresh buffers (convenience path, not the data path).
        Returns (values, checksum_failures): a value whose checksum failed is None, as a miss,
        and counted; the connection stays usable, as after `get_into`."""
        conn = self.conn
        request = p.GetRequest(tuple(keys), tuple(p.ANY_LENGTH for _ in keys))
        conn.send(request)
        deadline = conn.deadline()
        reply = conn.matched(request, conn.read_reply(deadline))
        assert isinstance(reply, p.GetReply)
        out: list[bytes | None] = []
        bad_sums = 0
        for item in reply.items:
            if item.status != p.ItemStatus.OK:
                out.append(None)
                continue
            with conn.io("read"):
                buf = recv_exactly(conn.sock, item.length, deadline)
            good = checksummer.verify(buf, item.algo, item.checksum)
            bad_sums += not good
            out.append(bytes(buf) if good else None)
        return out, bad_sums

    def _recv_verified(
        self, view: memoryview, algo: int, checksum: bytes, checksummer: Checksummer, deadline: float
    ) -> bool:
        """Receive a value into `view` in pieces, hashing each piece right after it arrived
        (`_receive_step` says how large: in cache, or fewer GIL hand-offs). An xxh3 value on
        plain TCP goes through the compiled loop when it is there: small pieces, no hand-offs."""
        sock = self.conn.sock
        if algo == ChecksumAlgo.XXH3_128 and can_recv_xxh3(sock):
            with self.conn.io("read"):
                digest = recv_xxh3_into(sock, view, deadline, _COMPILED_PIECE)
            return hmac.compare_digest(Checksummer.padded(digest), checksum)
        try:
            hasher = checksummer.hasher(algo)
        except ValueError:  # unknown algorithm: receive (to keep the stream in step), then fail
            hasher = None
        with _RECEIVERS.receiving() as receivers, self.conn.io("read"):
            step = _receive_step(isinstance(sock, ssl.SSLSocket), receivers)
            recv_exactly_into(sock, view, deadline, hasher.update if hasher is not None else None, step)
        return hasher is not None and hmac.compare_digest(checksummer.finish(hasher), checksum)


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


__all__ = ["SocketStream"]
