"""A fault-injecting TCP proxy for MemKV traffic on 127.0.0.1.

`FaultProxy` listens on 127.0.0.1:0 and relays every accepted connection to one upstream node.
It knows the framing of docs/protocol.md (the handshake's fixed sizes, then frames of a 60-byte
prefix, `meta_len` bytes of meta and `payload_len` bytes of values), so a fault lands at an
exact byte of an exact frame: the 3rd byte of a PUT's second value, the middle of a GET reply's
payload, a MAC byte. For each frame a `plan(frame) -> Fault | None` decides, once the frame's
prefix has arrived and before any byte of it is forwarded. The faults:

    flip(at)                 XOR one byte (a value byte: the checksum must catch it; a header,
                             MAC or meta byte: the MAC must)
    truncate(at)             forward `at` bytes of the frame, then FIN both sides
    reset(at)                forward `at` bytes, then RST both sides (SO_LINGER 0)
    stall(at, hold_s)        forward `at` bytes, hold the rest for `hold_s`, then deliver it late
                             (release=True) or close (release=False)
    slow(at, rate_bps)       forward the rest of the frame at `rate_bps` (a slow reader as the
                             sender sees it, a trickle as the receiver sees it)
    call(at, fn)             forward `at` bytes, run `fn()` (e.g. SIGKILL the node), go on

Over TLS (`tls=True`, for a TLS-only node): the proxy terminates the client's TLS with the test
CA's node certificate (tests/tlscerts.py; the client trusts it as it trusts the node) and
opens its own TLS connection to the node, verifying the node's certificate. Faults then act on
the plaintext MemKV frames exactly as above, and the bytes are encrypted again: a flipped byte
reaches the peer as a well-formed TLS record, which only MemKV's checksum or MAC can catch; a
truncate or reset ends the TCP connection under TLS, with no close_notify (tests/faults/wire.py).

`partition()` / `heal()` stop and restart every byte in both directions on every connection,
new ones included, while keeping the sockets open: a black hole, not a refusal.

Every applied fault is recorded (`applied`), with the PUT keys whose value bytes it touched, and
its `done` event is set once it has finished acting (a stalled frame's late bytes were sent).

Threading: one accept thread, one thread per connection that opens the link (the upstream
connection and, over TLS, both handshakes), and two pump threads per link (daemon threads).
Sockets are blocking; pumps wake every `_TICK_S` to notice `close()`, which shuts every socket down and joins
every thread with a deadline. Nothing waits unbounded: holds and trickles wait on events with
timeouts, and a stall never holds longer than its `hold_s`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from memkv import protocol as p
from tests.faults.wire import PlainEnd, TlsEnd

C2S, S2C = "c2s", "s2c"
HANDSHAKE_BYTES = {C2S: p.CLIENT_HELLO.size + p.CLIENT_AUTH.size, S2C: p.SERVER_HELLO.size}
_TICK_S = 0.1
_CHUNK = 256 << 10
_LINGER_RST = struct.pack("ii", 1, 0)
_TLS_HANDSHAKE_S = 5.0


@dataclasses.dataclass(frozen=True)
class FrameInfo:
    """A frame seen by the proxy: known once its 60-byte prefix has arrived."""

    conn: int  # connection number, in accept order from 0
    direction: str  # C2S or S2C
    index: int  # frame number in this direction from 0 (S2C frame 0 is HELLO_OK)
    opcode: int
    meta_len: int
    payload_len: int

    @property
    def payload_start(self) -> int:
        return p.FRAME_PREFIX_BYTES + self.meta_len

    @property
    def size(self) -> int:
        return self.payload_start + self.payload_len


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # flip | truncate | reset | stall | slow | call
    at: int  # byte offset in the frame where the fault acts
    hold_s: float = 0.0
    release: bool = True
    rate_bps: int = 0
    action: Callable[[], None] | None = None
    xor: int = 0x01

    @classmethod
    def flip(cls, at: int, xor: int = 0x01) -> Fault:
        return cls("flip", at, xor=xor)

    @classmethod
    def truncate(cls, at: int) -> Fault:
        return cls("truncate", at)

    @classmethod
    def reset(cls, at: int) -> Fault:
        return cls("reset", at)

    @classmethod
    def stall(cls, at: int, hold_s: float, release: bool = True) -> Fault:
        return cls("stall", at, hold_s=hold_s, release=release)

    @classmethod
    def slow(cls, at: int, rate_bps: int) -> Fault:
        return cls("slow", at, rate_bps=rate_bps)

    @classmethod
    def call(cls, at: int, action: Callable[[], None]) -> Fault:
        return cls("call", at, action=action)


Plan = Callable[[FrameInfo], "Fault | None"]


@dataclasses.dataclass
class Applied:
    fault: Fault
    frame: FrameInfo
    started: float
    keys: tuple[bytes, ...] = ()  # PUT keys whose value bytes the fault touched (C2S PUT only)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Closed(Exception):
    """This link is finished (a fault closed it, or a peer went away)."""


End = PlainEnd | TlsEnd


class _Link:
    def __init__(self, number: int, client: End, upstream: End) -> None:
        self.number = number
        self.ends = {C2S: (client, upstream), S2C: (upstream, client)}
        self.client, self.upstream = client.raw, upstream.raw
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self._exited = 0

    def kill(self, rst: bool, force: bool = False) -> None:
        """End both directions: FIN both peers, or RST them (at close, when both pumps exit).
        `force` shuts the sockets down even if the link already ended (wakes a blocked send)."""
        with self._lock:
            if self.dead.is_set() and not force:
                return
            self.dead.set()
        for s in (self.client, self.upstream):
            try:
                if rst:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                    s.shutdown(socket.SHUT_RD)  # wakes the other pump without sending a FIN
                else:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def pump_exited(self) -> None:
        with self._lock:
            self._exited += 1
            last = self._exited == 2
        if last:
            for s in (self.client, self.upstream):
                try:
                    s.close()
                except OSError:
                    pass


class _Cursor:
    """Where a direction's byte stream is: handshake bytes left, the current frame and offset."""

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.handshake_left = HANDSHAKE_BYTES[direction]
        self.prefix = bytearray()
        self.frame: FrameInfo | None = None
        self.off = 0
        self.index = 0
        self.fault: Fault | None = None
        self.record: Applied | None = None
        self.slow_rate = 0
        self.meta = bytearray()  # C2S PUT frames' (the keys a fault touched), S2C HELLO_OK's (_check_no_bypass)


class FlipNextPut:
    """A fault plan: once armed (`arm`), flip one byte of the next PUT frame the client sends,
    `offset` bytes into its payload (a byte of its first value), then pass everything through."""

    def __init__(self, offset: int, xor: int = 0x20) -> None:
        self.offset, self.xor = offset, xor
        self._armed = threading.Event()

    def arm(self) -> None:
        self._armed.set()

    def __call__(self, frame: FrameInfo) -> Fault | None:
        if frame.direction == C2S and frame.opcode == p.Opcode.PUT and self._armed.is_set():
            self._armed.clear()
            return Fault.flip(frame.payload_start + self.offset, xor=self.xor)
        return None


class FaultProxy:
    """See the module docstring. Use as a context manager or call close()."""

    def __init__(
        self, upstream: tuple[str, int], plan: Plan | None = None, *, name: str = "proxy", tls: bool = False
    ) -> None:
        """`tls`: the node is TLS-only; the proxy speaks TLS on both sides (module docstring)."""
        self.upstream = upstream
        self._tls = _tls_contexts() if tls else None
        self.plan: Plan = plan or (lambda frame: None)
        self.name = name
        self.applied: list[Applied] = []
        self.bypass: list[str] = []  # same-host socket names that upstream advertised (_check_no_bypass)
        self.connections = 0
        self.bytes = {C2S: 0, S2C: 0}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._healed = threading.Event()
        self._healed.set()
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_TICK_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._start(self._accept_loop, f"{name}-accept")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- controls ---------------------------------------------------------------------------------

    def partition(self) -> None:
        """Stop forwarding anything, on every connection, keeping the sockets open."""
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    def reset_all(self) -> None:
        """RST every open connection (what a node restart does to its clients' sockets)."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.kill(rst=True)

    def open_links(self) -> int:
        with self._lock:
            return sum(not link.dead.is_set() for link in self._links)

    def counts(self) -> dict[str, int]:
        """Applied faults by kind."""
        with self._lock:
            out: dict[str, int] = {}
            for a in self.applied:
                out[a.fault.kind] = out.get(a.fault.kind, 0) + 1
            return out

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._healed.set()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.kill(rst=False, force=True)
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        if self.bypass:
            raise AssertionError(
                f"{self.name}: the node behind the proxy names a same-host socket ({self.bypass[0]}): its clients "
                "would connect past the proxy; start it with --no-local-socket"
            )

    # -- internals --------------------------------------------------------------------------------

    def _start(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                number = self.connections
                self.connections += 1
            self._start(self._open, f"{self.name}-{number}-open", number, client)

    def _open(self, number: int, client: socket.socket) -> None:
        """Connect to the node (and over TLS, shake hands on both sides), then start the pumps.
        If that fails, the client sees a reset, as it would from a node that is gone."""
        upstream = None
        try:
            upstream = socket.create_connection(self.upstream, timeout=2.0)
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ends: tuple[End, End]
            if self._tls is None:
                ends = PlainEnd(client), PlainEnd(upstream)
            else:
                to_client, to_node = self._tls
                deadline = time.monotonic() + _TLS_HANDSHAKE_S
                ends = TlsEnd(client, to_client, server_side=True), TlsEnd(upstream, to_node, False, self.upstream[0])
                ends[1].handshake(deadline)
                ends[0].handshake(deadline)
        except (OSError, ssl.SSLError):
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                        s.close()
                    except OSError:
                        pass
            return
        with self._lock:
            link = _Link(number, *ends)
            self._links.append(link)
        if self._closing.is_set():
            link.kill(rst=False, force=True)
        self._start(self._pump, f"{self.name}-{number}-c2s", link, C2S)
        self._start(self._pump, f"{self.name}-{number}-s2c", link, S2C)

    def _pump(self, link: _Link, direction: str) -> None:
        src, dst = link.ends[direction]
        cur = _Cursor(direction)
        try:
            while not link.dead.is_set() and not self._closing.is_set():
                data = src.recv(_CHUNK, _TICK_S)
                if data is None:
                    continue
                if not data:
                    if not link.dead.is_set():
                        try:
                            dst.raw.shutdown(socket.SHUT_WR)  # pass the FIN on
                        except OSError:
                            pass
                    return
                self._forward(link, cur, data, dst)
        except _Closed:
            pass
        except Exception:  # a proxy bug: end the link rather than leave it half open
            link.kill(rst=False)
            raise
        finally:
            if cur.record is not None:
                cur.record.done.set()
            if direction == C2S:  # a client that went away ends the link
                link.kill(rst=False)
            link.pump_exited()

    def _forward(self, link: _Link, cur: _Cursor, data: bytes, dst: End) -> None:
        i, n = 0, len(data)
        while i < n:
            if cur.handshake_left:
                k = min(cur.handshake_left, n - i)
                self._send(link, dst, data[i : i + k], cur)
                cur.handshake_left -= k
                i += k
                continue
            if cur.frame is None:
                need = p.FRAME_PREFIX_BYTES - len(cur.prefix)
                cur.prefix += data[i : i + need]
                i += min(need, n - i)
                if len(cur.prefix) < p.FRAME_PREFIX_BYTES:
                    return
                _, _, opcode, _, _, _, meta_len, payload_len = p.FRAME_HEADER.unpack_from(cur.prefix)
                cur.frame = FrameInfo(link.number, cur.direction, cur.index, opcode, meta_len, payload_len)
                cur.off = 0
                cur.slow_rate = 0
                cur.meta.clear()
                cur.fault = self.plan(cur.frame)
                prefix, cur.prefix = bytes(cur.prefix), bytearray()
                self._emit(link, cur, prefix, dst)
                continue
            k = min(n - i, cur.frame.size - cur.off)
            self._emit(link, cur, data[i : i + k], dst)
            i += k

    def _emit(self, link: _Link, cur: _Cursor, chunk: bytes, dst: End) -> None:
        """Forward `chunk` (bytes of the current frame from cur.off on), applying its fault."""
        frame = cur.frame
        assert frame is not None
        collect = frame.opcode == p.Opcode.PUT if cur.direction == C2S else frame.opcode == p.Opcode.HELLO_OK
        if collect and cur.off < frame.payload_start:
            lo, hi = max(cur.off, p.FRAME_PREFIX_BYTES), min(cur.off + len(chunk), frame.payload_start)
            if hi > lo:
                cur.meta += chunk[lo - cur.off : hi - cur.off]
        fault = cur.fault
        start = cur.off
        cur.off += len(chunk)
        if fault is not None and start <= fault.at < cur.off:
            cur.fault = None
            k = fault.at - start
            self._apply(link, cur, fault, chunk[:k], chunk[k:], dst)
        elif cur.slow_rate:
            self._trickle(link, dst, chunk, cur.slow_rate, cur)
        else:
            self._send(link, dst, chunk, cur)
        if cur.off >= frame.size:
            if cur.direction == S2C and frame.opcode == p.Opcode.HELLO_OK:
                self._check_no_bypass(link, bytes(cur.meta))
            cur.frame = None
            cur.index += 1
            cur.slow_rate = 0
            if cur.record is not None:
                cur.record.done.set()
                cur.record = None

    def _check_no_bypass(self, link: _Link, hello_ok_meta: bytes) -> None:
        """A node that names a same-host socket in HELLO_OK would draw the client's later
        connections past the proxy, and its faults would silently never happen: end the link and
        fail the test at close() instead (start such nodes with --no-local-socket)."""
        name = json.loads(hello_ok_meta).get("local_socket")
        if name is not None:
            self.bypass.append(name)
            link.kill(rst=False)

    def _apply(self, link: _Link, cur: _Cursor, fault: Fault, before: bytes, rest: bytes, dst: End) -> None:
        frame = cur.frame
        assert frame is not None
        record = Applied(fault, frame, time.monotonic(), keys=self._touched_keys(cur, fault))
        with self._lock:
            self.applied.append(record)
        if cur.record is not None:
            cur.record.done.set()
        cur.record = record
        self._send(link, dst, before, cur)
        if fault.kind == "flip":
            self._send(link, dst, bytes([rest[0] ^ fault.xor]) + rest[1:], cur)
        elif fault.kind in ("truncate", "reset"):
            record.done.set()
            link.kill(rst=fault.kind == "reset")
            raise _Closed()
        elif fault.kind == "stall":
            self._closing.wait(fault.hold_s)
            if not fault.release:
                record.done.set()
                link.kill(rst=False)
                raise _Closed()
            self._send(link, dst, rest, cur)  # late: the receiver may have given up and closed
        elif fault.kind == "slow":
            cur.slow_rate = fault.rate_bps
            self._trickle(link, dst, rest, fault.rate_bps, cur)
        elif fault.kind == "call":
            assert fault.action is not None
            fault.action()
            self._send(link, dst, rest, cur)
        else:
            raise ValueError(f"unknown fault {fault.kind}")

    def _touched_keys(self, cur: _Cursor, fault: Fault) -> tuple[bytes, ...]:
        """The PUT keys whose value bytes start at or after the fault (C2S PUT frames only)."""
        frame = cur.frame
        assert frame is not None
        if cur.direction != C2S or frame.opcode != p.Opcode.PUT or fault.at < frame.payload_start:
            return ()
        meta = bytes(cur.meta)
        (count,) = struct.unpack_from(">I", meta, 0)
        key_lens = struct.unpack_from(f">{count}H", meta, 4)
        off = 4 + 2 * count
        keys = []
        for ln in key_lens:
            keys.append(meta[off : off + ln])
            off += ln
        lengths = struct.unpack_from(f">{count}I", meta, off)
        pos = fault.at - frame.payload_start
        ends = list(itertools.accumulate(lengths))
        first = next(i for i, end in enumerate(ends) if pos < end)
        if fault.kind == "flip":
            return (keys[first],)
        return tuple(keys[first:])

    def _send(self, link: _Link, dst: End, data: bytes, cur: _Cursor) -> None:
        if not data:
            return
        while not self._healed.is_set():  # partitioned: hold every byte, keep the socket open
            if link.dead.is_set() or self._closing.is_set():
                raise _Closed()
            self._healed.wait(_TICK_S)
        try:
            dst.sendall(data)
        except (OSError, ssl.SSLError):
            link.kill(rst=False)
            raise _Closed() from None
        with self._lock:
            self.bytes[cur.direction] += len(data)

    def _trickle(self, link: _Link, dst: End, data: bytes, rate_bps: int, cur: _Cursor) -> None:
        piece = max(1, rate_bps // 20)
        for i in range(0, len(data), piece):
            if link.dead.is_set() or self._closing.is_set():
                raise _Closed()
            self._send(link, dst, data[i : i + piece], cur)
            if self._closing.wait(piece / rate_bps):
                raise _Closed()


def _tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(toward the client, toward the node): the test CA's node certificate, and a context
    that trusts the test CA (the same settings a client of a TLS node has)."""
    from memkv.config import ClientTls
    from memkv.tls import client_context, server_context
    from tests.tlscerts import session_pki

    pki = session_pki()
    return server_context(pki.server.cert, pki.server.key, None), client_context(ClientTls(ca=pki.ca))


class RandomFaults:
    """A seeded plan: each frame that carries values (a PUT request, a GET reply with values) is
    hit with probability `rate` by a fault drawn from `weights`, at a random byte of its payload;
    any other frame, with probability `header_rate`, gets a flipped header, MAC or meta byte.

    `io_timeout_s` is the client's: stalls hold past it, trickles would take longer than it.
    """

    KINDS = ("flip", "truncate", "reset", "stall", "slow")

    def __init__(
        self,
        seed: int,
        rate: float,
        io_timeout_s: float,
        *,
        weights: dict[str, float] | None = None,
        header_rate: float = 0.0,
        directions: tuple[str, ...] = (C2S, S2C),
    ) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.rate = rate
        self.header_rate = header_rate
        self.io_timeout_s = io_timeout_s
        self.weights = weights or {k: 1.0 for k in self.KINDS}
        self.directions = directions
        self.enabled = True

    def __call__(self, frame: FrameInfo) -> Fault | None:
        if not self.enabled or frame.direction not in self.directions:
            return None
        with self._lock:
            rng = self._rng
            if frame.payload_len:
                if rng.random() >= self.rate:
                    return None
                kind = rng.choices(list(self.weights), list(self.weights.values()))[0]
                at = frame.payload_start + rng.randrange(frame.payload_len)
                return self._make(kind, at, frame)
            if frame.direction == S2C and frame.index == 0:
                return None  # HELLO_OK: a broken handshake is tested elsewhere
            if self.header_rate and rng.random() < self.header_rate:
                return Fault.flip(rng.randrange(frame.payload_start), xor=1 << rng.randrange(8))

    def _make(self, kind: str, at: int, frame: FrameInfo) -> Fault:
        if kind == "flip":
            return Fault.flip(at, xor=1 << self._rng.randrange(8))
        if kind == "truncate":
            return Fault.truncate(at)
        if kind == "reset":
            return Fault.reset(at)
        if kind == "stall":
            return Fault.stall(at, hold_s=self.io_timeout_s * 1.5, release=True)
        if kind == "slow":
            left = frame.size - at
            # Slow enough that the rest of the frame would take 4 client timeouts.
            return Fault.slow(at, rate_bps=max(64, int(left / (4 * self.io_timeout_s))))
        raise ValueError(kind)
