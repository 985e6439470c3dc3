"""An in-memory MemKV cluster behind the client's socket seam (`Client(config, connect=...)`).

`FakeNetwork(key)` holds `FakeNode`s by address; `network.connect` is a `memkv.client.node.Connect`:
it answers a connect to a node with one end of a `socket.socketpair()` and serves the other end
on a daemon thread with the real server side of the protocol (`ServerHandshake`, `FrameCodec`)
over a dict of values. Everything above the socket (handshake, codec, pools, health, placement,
fan-out, pipelines, transports) runs unchanged; no process is started and no port is bound.

Per node the test can:
* `refuse = True`: connects fail as if nothing listened (ECONNREFUSED);
* `reset_on = {"get"}`: a request of that op closes the connection instead of an answer (a
  node killed mid-request), after reading it;
* `corrupt = True`: GET replies carry values with one flipped byte (the checksum is the stored one);
* `limits`: what the node announces in HELLO_OK (max_batch, ...).
Each node records the requests it received (`requests`, as (op, keys)) and its connects.

Threading: one daemon thread per connection; each blocks in recv with a timeout and ends when
the client closes its end (recv returns b"") or `FakeNetwork.close()` shuts every socket down.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterator

from memkv import protocol as p
from memkv.config import ServerAddress

_SERVE_TIMEOUT_S = 10.0  # a connection the client forgot ends on its own


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None when the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        piece = sock.recv(n - len(buf))
        if not piece:
            return None
        buf += piece
    return bytes(buf)


_OPS = {
    p.PingRequest: "ping",
    p.PutRequest: "put",
    p.GetRequest: "get",
    p.ExistsRequest: "exists",
    p.DeleteRequest: "delete",
    p.ListRequest: "list",
    p.RdmaAttachRequest: "rdma_attach",
    p.RdmaGetRequest: "rdma_get",
}


class FakeNode:
    def __init__(self, address: ServerAddress, auth_key: bytes, limits: p.Limits | None = None) -> None:
        self.address = address
        self.auth_key = auth_key
        self.limits = limits or p.Limits()
        self.refuse = False
        self.reset_on: set[str] = set()
        self.corrupt = False
        self.values: dict[bytes, tuple[bytes, int, bytes]] = {}  # key -> (value, algo, checksum)
        self.requests: list[tuple[str, tuple[bytes, ...]]] = []
        self.connects = 0
        self._lock = threading.Lock()

    def ops(self, op: str) -> list[tuple[bytes, ...]]:
        """The key tuples of every `op` request this node received, in order."""
        with self._lock:
            return [keys for o, keys in self.requests if o == op]

    # -- one connection (its own thread) --------------------------------------------------------

    def serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(_SERVE_TIMEOUT_S)
            codec = self._handshake(sock)
            if codec is None:
                return
            while self._serve_one(sock, codec):
                pass
        except OSError:
            pass  # the client closed or reset its end
        finally:
            sock.close()

    def _handshake(self, sock: socket.socket) -> p.FrameCodec | None:
        hs = p.ServerHandshake(self.auth_key, os.urandom(p.NONCE_BYTES))
        hello = _recv(sock, p.CLIENT_HELLO.size)
        if hello is None:
            return None
        sock.sendall(hs.receive_hello(hello))
        auth = _recv(sock, p.CLIENT_AUTH.size)
        if auth is None:
            return None
        hs.receive_auth(auth)
        codec = hs.codec(self.limits)
        sock.sendall(codec.encode(p.HelloOk(f"fake-{self.address}", self.limits)))
        return codec

    def _serve_one(self, sock: socket.socket, codec: p.FrameCodec) -> bool:
        prefix = _recv(sock, p.FRAME_PREFIX_BYTES)
        if prefix is None:
            return False
        header = codec.parse_header(prefix)
        meta = _recv(sock, header.meta_len)
        payload = _recv(sock, header.payload_len) if header.payload_len else b""
        if meta is None or payload is None:
            return False
        msg = codec.open(header, prefix, meta)
        op = _OPS[type(msg)]
        keys = tuple(it.key for it in msg.items) if isinstance(msg, p.PutRequest) else getattr(msg, "keys", ())
        with self._lock:
            self.requests.append((op, keys))
        if op in self.reset_on:
            sock.shutdown(socket.SHUT_RDWR)
            return False
        reply, values = self._answer(msg, payload)
        sock.sendall(codec.encode(reply, validate=False) + b"".join(values))
        return True

    def _answer(self, msg: p.Message, payload: bytes) -> tuple[p.Message, list[bytes]]:
        ok, miss = p.ItemStatus.OK, p.ItemStatus.MISS
        with self._lock:
            if isinstance(msg, p.PingRequest):
                return p.PingReply(), []
            if isinstance(msg, p.PutRequest):
                off = 0
                for it in msg.items:
                    self.values[it.key] = (payload[off : off + it.length], it.algo, it.checksum)
                    off += it.length
                return p.StatusReply(p.Opcode.PUT, bytes([ok] * len(msg.items))), []
            if isinstance(msg, p.ExistsRequest):
                return p.StatusReply(p.Opcode.EXISTS, bytes(ok if k in self.values else miss for k in msg.keys)), []
            if isinstance(msg, p.DeleteRequest):
                gone = [self.values.pop(k, None) is not None for k in msg.keys]
                return p.StatusReply(p.Opcode.DELETE, bytes(ok if g else miss for g in gone)), []
            if isinstance(msg, p.GetRequest):
                items, values = [], []
                for k, want in zip(msg.keys, msg.expected_lengths):
                    stored = self.values.get(k)
                    if stored is None or (want != p.ANY_LENGTH and want != len(stored[0])):
                        items.append(p.GetReplyItem(miss, 0, 0, bytes(p.CHECKSUM_BYTES)))
                        continue
                    value, algo, checksum = stored
                    if self.corrupt and value:
                        value = bytes([value[0] ^ 0xFF]) + value[1:]
                    items.append(p.GetReplyItem(ok, len(value), algo, checksum))
                    values.append(value)
                return p.GetReply(tuple(items)), values
            if isinstance(msg, p.ListRequest):
                found = sorted(k for k in self.values if k.startswith(msg.prefix))[: msg.limit]
                return p.ListReply(tuple(found), tuple(len(self.values[k][0]) for k in found), False), []
        return p.ErrorReply(p.ErrorCode.UNKNOWN_OPCODE, f"the fake node does not serve {type(msg).__name__}"), []


class FakeNetwork:
    """Fake nodes by address, and the `connect` seam that reaches them."""

    def __init__(self, auth_key: bytes) -> None:
        self.auth_key = auth_key
        self.nodes: dict[str, FakeNode] = {}
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def add(self, host: str, port: int, limits: p.Limits | None = None) -> FakeNode:
        node = FakeNode(ServerAddress(host, port), self.auth_key, limits)
        self.nodes[node.address.name] = node
        return node

    def __iter__(self) -> Iterator[FakeNode]:
        return iter(self.nodes.values())

    def connect(self, address: ServerAddress, timeout_s: float) -> socket.socket:
        node = self.nodes.get(address.name)
        if node is None or node.refuse:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        with node._lock:
            node.connects += 1
        ours, theirs = socket.socketpair()
        thread = threading.Thread(target=node.serve, args=(theirs,), name=f"fake-{address}", daemon=True)
        with self._lock:
            self._socks += [ours, theirs]
            self._threads.append(thread)
        thread.start()
        return ours

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout_s)
