"""`StatusPipeline`: EXISTS / DELETE / LEASE / RELEASE to every owning node at once, answers taken
as they arrive (a LEASE reply's lengths are dropped here: OK or not is the answer).

One thread drives all nodes: a submitted batch is split by owner, each node's part is sent on
one of its pooled connections, and `poll()` waits on all those sockets together, reading each
reply the moment its bytes are in. So a node that is stopped or black-holed holds only its own
keys: the other nodes' answers are handed to the caller while it is still silent.

Per node, at most one connection of the pipeline carries requests at a time. Keys submitted
while a node's replies are outstanding wait, merged, and go out when those replies are in (or
have failed), so a silent node costs one connection and one queue, never a growing backlog of
requests in its socket. Sends and receives never wait (`NodeConnection.send_ready` /
`recv_ready`); a node with no idle pooled connection is connected on the client's executor,
so neither a slow connect nor a full pool blocks the other nodes.

Failure semantics, as for the blocking calls: each reply must be whole within `io_timeout_s`
of becoming the next one expected (its request sent, or the reply before it read); a node past
that, or one that breaks the protocol, has its connection closed and is marked down, and its
keys answer False. A connection is given back to the pool only with every reply read, so none
is ever reused half-read.

Contract: every submitted key is answered exactly once through its batch's `on_answer(indices,
hits)`: by its node's reply, with False when its node fails or is marked down, or with False at
`close()`, which abandons what is still outstanding (closing those connections without marking
their nodes down: the caller gave up, the node did not fail). `on_answer` runs on the owner
thread, inside `submit`, `poll` or `close`, and must not raise.

Threading: one owner thread calls submit / poll / close. `wake()` may be called from any
thread: it makes a blocked `poll` return (a pipeline made with `wakeable=True` can always be
woken; others open their wake socket when they first connect on the executor, whose completion
wakes them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import select
import socket
import time
from collections.abc import Callable, Sequence

from memkv import protocol as p
from memkv.client import metrics as m
from memkv.client.node import NodeClient, NodeConnection
from memkv.client.nodeset import NodeSet
from memkv.errors import ConnectError, MemKVError, ReadTimeout, RemoteProtocolError

OnAnswer = Callable[[list[int], list[bool]], None]
_Segment = tuple[OnAnswer, list[int]]  # keys of one submitted batch: its callback and their indices
_OK = int(p.ItemStatus.OK)

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT


class _NodeState:
    """One node's share of a pipeline. `queued`: parts not sent yet, as (on_answer, indices,
    keys); `inflight`: one entry per request sent on `conn` whose reply is outstanding: the
    request and the segments its keys came from, (on_answer, indices) in key order; `deadline`:
    by when the next reply must be whole."""

    __slots__ = ("node", "queued", "conn", "inflight", "deadline", "connecting", "sent_at")

    def __init__(self, node: NodeClient) -> None:
        self.node = node
        self.queued: list[tuple[OnAnswer, list[int], list[bytes]]] = []
        self.conn: NodeConnection | None = None
        self.inflight: collections.deque[tuple[p.Request, list[_Segment]]] = collections.deque()
        self.deadline = 0.0
        self.connecting: concurrent.futures.Future[NodeConnection] | None = None
        self.sent_at = 0.0


class StatusPipeline:
    """Pipelined status requests (`op` "exists" or "delete") over a client's nodes (placement,
    connects on the executor, failure counting: the NodeSet); see the module docstring for the
    contract."""

    def __init__(
        self,
        nodes: NodeSet,
        op: str,
        request: Callable[[tuple[bytes, ...]], p.Request],
        check_keys: Callable[[Sequence[bytes]], list[bytes]] | None = None,
        wakeable: bool = False,
    ) -> None:
        self._states = [_NodeState(n) for n in nodes.nodes]
        self._group = nodes.group
        self._executor = nodes.executor
        self._op = op
        self._request = request
        self._on_failure = nodes.count_failure
        self._io_timeout_s = nodes.io_timeout_s
        self._check_keys = check_keys
        self._poller = select.poll()
        self._by_fd: dict[int, _NodeState] = {}
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._closed = False
        if wakeable:
            self._open_wake()

    # -- owner thread ------------------------------------------------------------------------------

    def submit(self, keys: Sequence[bytes], on_answer: OnAnswer) -> None:
        """Send `keys` to their owners (or queue them behind a node's outstanding replies).
        Never waits on the network. Answers arrive through `on_answer`, indices into `keys`."""
        if self._closed:
            raise RuntimeError("StatusPipeline is closed")
        ks = self._check_keys(keys) if self._check_keys else list(keys)
        if not ks:
            return
        for n, idx in self._group(ks).items():
            st = self._states[n]
            st.queued.append((on_answer, idx, [ks[i] for i in idx]))
            if st.conn is None and st.connecting is None:
                self._start(st)

    @property
    def pending(self) -> bool:
        """True while some submitted key is unanswered."""
        return any(st.queued or st.inflight or st.connecting is not None for st in self._states)

    def poll(self, timeout_s: float | None = None) -> None:
        """Wait until a socket is ready, a connect completes, a reply's deadline passes, `wake()`
        is called or `timeout_s` passes (None: no limit but those), then handle what is ready:
        answers are delivered through the callbacks before this returns."""
        if self._closed:
            raise RuntimeError("StatusPipeline is closed")
        now = time.monotonic()
        wait = timeout_s
        for st in self._states:
            if st.conn is not None and st.inflight:
                left = max(0.0, st.deadline - now)
                wait = left if wait is None else min(wait, left)
        connecting = any(st.connecting is not None for st in self._states)  # each wakes us when done
        events = self._poller.poll(None if wait is None else max(0, int(wait * 1000 + 0.999)))
        for fd, mask in events:
            if self._wake_r is not None and fd == self._wake_r.fileno():
                self._drain_wake()
                continue
            ready = self._by_fd.get(fd)
            if ready is not None and ready.conn is not None:
                self._service(ready, mask)
        if connecting:
            for st in self._states:
                if st.connecting is not None and st.connecting.done():
                    self._connected(st)
        now = time.monotonic()
        for st in self._states:
            if st.conn is not None and st.inflight and now >= st.deadline:
                self._fail(
                    st, ReadTimeout(f"no {self._op} reply within io_timeout_s ({self._io_timeout_s}s)", st.node.name)
                )

    def close(self) -> None:
        """Abandon what is outstanding (those keys answer False), give every connection back.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for st in self._states:
            if st.conn is not None:
                self._release(st, RuntimeError(f"{self._op} abandoned by the caller with replies outstanding"))
            if st.connecting is not None:
                st.connecting.add_done_callback(functools.partial(_return_unused, st.node))
                st.connecting = None
            self._answer_false(st)
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()

    # -- any thread --------------------------------------------------------------------------------

    def wake(self) -> None:
        """Make a blocked `poll` return soon. Safe from any thread, also after close."""
        sock = self._wake_w
        if sock is None:
            return
        try:
            sock.send(b"\0")
        except OSError:  # full (a wake is already pending) or closed: nothing to do
            pass

    # -- internals ---------------------------------------------------------------------------------

    def _open_wake(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r.fileno(), _READ)

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _start(self, st: _NodeState) -> None:
        """Get `st` a connection for its queued parts: an idle pooled one at once, or a new one
        connected on the executor (the answer then waits for `_connected`)."""
        try:
            conn = st.node.borrow_idle()
        except MemKVError as exc:  # marked down, or the client is closed
            self._on_failure(st.node, self._op, exc)
            self._answer_false(st)
            return
        if conn is not None:
            self._send(st, conn)
            return
        if self._wake_r is None:
            self._open_wake()
        try:
            st.connecting = self._executor.submit(st.node.borrow)
        except RuntimeError:  # the executor is shut down: the client was closed
            self._on_failure(st.node, self._op, ConnectError("client is closed", st.node.name))
            self._answer_false(st)
            return
        st.connecting.add_done_callback(lambda _fut: self.wake())

    def _connected(self, st: _NodeState) -> None:
        fut, st.connecting = st.connecting, None
        assert fut is not None
        try:
            conn = fut.result()  # anything but a MemKVError is a bug and propagates
        except MemKVError as exc:  # borrow marked the node down where the connect failed
            self._on_failure(st.node, self._op, exc)
            self._answer_false(st)
            return
        self._send(st, conn)

    def _send(self, st: _NodeState, conn: NodeConnection) -> None:
        """Send every queued part of `st` on `conn` (chunked to the node's max_batch)."""
        parts, st.queued = st.queued, []
        if not parts:  # nothing waited for this connection after all
            st.node.give_back(conn)
            return
        keys = parts[0][2] if len(parts) == 1 else [k for _, _, ks in parts for k in ks]
        step = conn.limits.max_batch
        st.conn = conn
        requests = [self._request(tuple(keys[lo : lo + step])) for lo in range(0, len(keys), step)]
        st.inflight.extend(zip(requests, _segments(parts, step)))  # before encoding: answered even if that fails
        try:
            for request in requests:
                conn.queue_request(request)
            st.sent_at = time.monotonic()
            st.deadline = st.sent_at + self._io_timeout_s
            done = conn.send_ready()
        except MemKVError as exc:
            self._fail(st, exc)
            return
        self._by_fd[conn.sock.fileno()] = st
        self._poller.register(conn.sock.fileno(), _READ if done else _READ | _WRITE)

    def _service(self, st: _NodeState, mask: int) -> None:
        conn = st.conn
        assert conn is not None
        try:
            if conn.unsent and conn.send_ready():
                self._poller.modify(conn.sock.fileno(), _READ)
            if mask & ~_WRITE:  # readable, or an error/hangup that the read will report
                while st.inflight:
                    reply = conn.recv_ready()
                    if reply is None:
                        break
                    request, segments = st.inflight[0]
                    reply = conn.matched(request, reply)
                    assert isinstance(reply, (p.StatusReply, p.LeaseReply))
                    st.inflight.popleft()
                    st.deadline = time.monotonic() + self._io_timeout_s  # the next reply's clock
                    _deliver(segments, [s == _OK for s in reply.statuses], self._op)
        except MemKVError as exc:
            self._fail(st, exc)
            return
        if not st.inflight:
            m.SECONDS.labels(self._op).observe(time.monotonic() - st.sent_at)
            m.REQUESTS.labels(st.node.name, self._op, "ok").inc()
            if st.queued:  # keys that waited behind these replies go out on the same connection
                self._poller.unregister(conn.sock.fileno())
                del self._by_fd[conn.sock.fileno()]
                st.conn = None
                self._send(st, conn)
            else:
                self._release(st, None)

    def _fail(self, st: _NodeState, exc: MemKVError) -> None:
        """Close `st`'s connection (marking the node down where give_back does), answer its
        outstanding keys False, and try again for keys that were waiting behind them."""
        self._release(st, exc)
        self._on_failure(st.node, self._op, exc)
        if st.queued:
            self._start(st)  # fails fast if the node is now marked down

    def _release(self, st: _NodeState, error: BaseException | None) -> None:
        conn, st.conn = st.conn, None
        assert conn is not None
        fd = conn.sock.fileno()
        if self._by_fd.pop(fd, None) is not None:
            self._poller.unregister(fd)
        if error is None and not conn.idle:
            error = RemoteProtocolError(f"{st.node.name}: bytes left over after the {self._op} replies")
        st.node.give_back(conn, error)
        inflight, st.inflight = st.inflight, collections.deque()
        for _, segments in inflight:
            _deliver(segments, [False] * _count(segments), self._op)

    def _answer_false(self, st: _NodeState) -> None:
        parts, st.queued = st.queued, []
        for cb, idx, _ in parts:
            _deliver([(cb, idx)], [False] * len(idx), self._op)


def _segments(parts: list[tuple[OnAnswer, list[int], list[bytes]]], step: int) -> list[list[_Segment]]:
    """The parts' keys cut into requests of at most `step` keys, each as its segments."""
    requests: list[list[_Segment]] = [[]]
    room = step
    for cb, idx, _ in parts:
        lo = 0
        while lo < len(idx):
            if room == 0:
                requests.append([])
                room = step
            hi = min(len(idx), lo + room)
            requests[-1].append((cb, idx[lo:hi] if lo or hi < len(idx) else idx))
            room -= hi - lo
            lo = hi
    return requests


def _count(segments: list[_Segment]) -> int:
    return sum(len(idx) for _, idx in segments)


def _deliver(segments: list[_Segment], hits: list[bool], op: str) -> None:
    """Hand a request's answers to the callbacks of the batches its keys came from."""
    if op == "exists":
        n = sum(hits)
        m.KEYS.labels("exists", "hit").inc(n)
        m.KEYS.labels("exists", "miss").inc(len(hits) - n)
    if len(segments) == 1:
        segments[0][0](segments[0][1], hits)
        return
    lo = 0
    for cb, idx in segments:
        cb(idx, hits[lo : lo + len(idx)])
        lo += len(idx)


def _return_unused(node: NodeClient, fut: concurrent.futures.Future[NodeConnection]) -> None:
    """A connect that finished after its pipeline closed: the fresh connection goes to the pool."""
    if not fut.cancelled() and fut.exception() is None:
        node.give_back(fut.result())


__all__ = ["OnAnswer", "StatusPipeline"]
