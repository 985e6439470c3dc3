"""A scriptable MemKV node on 127.0.0.1 for client-side fault tests.

`FakeNode(key_hex, handler)` accepts connections, runs the real server handshake from
`memkv.protocol` (so a real `memkv.Client` connects to it), then calls
`handler(conn: FakeConnection)` on the connection's own thread. A handler reads requests with
`conn.read_request()` and answers however the test wants: late, in pieces, slowly, never.
`conn.get_reply_bytes(values)` builds a well-formed GET reply (statuses, lengths, checksums) so
a test can cut it wherever it likes. `hello_delay_s` holds each ServerHello back (a node too busy
to answer a new connection at once).

Threading: one accept thread and one thread per connection, all daemon threads; `close()` shuts
every socket down and joins every thread with a deadline. Each socket read has a timeout.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from memkv import protocol as p
from memkv.integrity import Checksummer
from memkv.sockio import recv_exactly

_TICK_S = 0.1


class FakeConnection:
    def __init__(
        self, sock: socket.socket, codec: p.FrameCodec, checksummer: Checksummer, stop: threading.Event
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.checksummer = checksummer
        self.stop = stop

    def read_request(self, timeout_s: float = 10.0) -> tuple[p.Message, bytes]:
        """One request frame and its payload bytes."""
        self.sock.settimeout(timeout_s)
        prefix = bytes(recv_exactly(self.sock, p.FRAME_PREFIX_BYTES))
        header = self.codec.parse_header(prefix)
        meta = bytes(recv_exactly(self.sock, header.meta_len))
        msg = self.codec.open(header, prefix, meta)
        payload = bytes(recv_exactly(self.sock, header.payload_len))
        return msg, payload

    def reply(self, msg: p.Message, payload: bytes = b"") -> None:
        self.sock.sendall(self.codec.encode(msg, validate=False) + payload)

    def get_reply_bytes(self, values: Sequence[bytes | None]) -> bytes:
        """A whole GET reply frame: OK with the value and its checksum, or MISS for None."""
        items = []
        for v in values:
            if v is None:
                items.append(p.GetReplyItem(p.ItemStatus.MISS, 0, 0, bytes(p.CHECKSUM_BYTES)))
            else:
                items.append(
                    p.GetReplyItem(p.ItemStatus.OK, len(v), self.checksummer.algo, self.checksummer.compute(v))
                )
        frame = self.codec.encode(p.GetReply(tuple(items)), validate=False)
        return frame + b"".join(v for v in values if v is not None)

    def pause(self, seconds: float) -> bool:
        """Wait `seconds` (bounded); True if the fake node is closing meanwhile."""
        return self.stop.wait(seconds)


class FakeNode:
    def __init__(
        self,
        key_hex: str,
        handler: Callable[[FakeConnection], None],
        *,
        node_id: str = "fake",
        limits: p.Limits | None = None,
        hello_delay_s: float = 0.0,
        local_socket: str | None = None,
    ) -> None:
        self.key = bytes.fromhex(key_hex)
        self.local_socket = local_socket  # the same-host socket name its HELLO_OK advertises
        self.hello_delay_s = hello_delay_s  # a busy node: its ServerHello leaves this late
        self.handler = handler
        self.node_id = node_id
        self.limits = limits or p.Limits()
        self.checksummer = Checksummer(self.key)
        self.errors: list[BaseException] = []
        self.connections = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_TICK_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._spawn(self._accept_loop)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> FakeNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="fake-node")
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._socks.append(sock)
                self.connections += 1
            self._spawn(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(5.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs = p.ServerHandshake(self.key, os.urandom(p.NONCE_BYTES))
            hello = hs.receive_hello(bytes(recv_exactly(sock, p.CLIENT_HELLO.size)))
            if self._stop.wait(self.hello_delay_s):
                return
            sock.sendall(hello)
            hs.receive_auth(bytes(recv_exactly(sock, p.CLIENT_AUTH.size)))
            codec = hs.codec(self.limits)
            sock.sendall(codec.encode(p.HelloOk(self.node_id, self.limits, self.local_socket)))
            self.handler(FakeConnection(sock, codec, self.checksummer, self._stop))
        except (OSError, ConnectionError):
            pass  # the client went away: normal in these tests
        except BaseException as exc:  # a handler bug: surfaced by the test through `errors`
            self.errors.append(exc)
        finally:
            try:
                sock.close()
            except OSError:
                pass
