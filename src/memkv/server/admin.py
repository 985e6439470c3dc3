"""Admin HTTP on the node's admin port: health, readiness, status, Prometheus metrics.

    GET /v1/health   200 {"status": "ok"} while the process serves HTTP (liveness)
    GET /v1/ready    200 while the node accepts clients, 503 once it is shutting down
    GET /v1/status   JSON: node id, addresses, capacity, bytes, values, lanes, evictions, connections
    GET /v1/metrics  Prometheus text format

Nothing secret is served: no key material, no value bytes (keys are not listed either).

Bounds: one request per connection (HTTP/1.0), and each connection is closed ADMIN_TIMEOUT_S after
it was accepted, however its peer paces its bytes. At most ADMIN_MAX_CONNECTIONS
(memkv/server/node.py) are served at once; at the cap a new connection sheds the oldest one that
has not yet sent its request (so idle connections cannot lock a health check out), and when every
connection is busy answering it is refused with a 503. Closes and refusals are counted in
`memkv_node_admin_connections_refused_total{reason}`.

TLS: when the node has a certificate (--tls-cert), the admin port speaks HTTPS only, with the
same certificate (re-read on SIGHUP with the data port's), and never asks for a client
certificate, even under --tls-ca: kubelet's HTTPS probes and Prometheus scrapes present none,
and nothing here is secret. Each connection's TLS handshake runs on its own thread on a
duplicate of the accepted socket, so the reaper's shutdown of the original still ends it.

A MemKV client pointed here by mistake sends a ClientHello: it is answered at once with an HTTP
400 naming the data port, so the client can say what is wrong instead of timing out.

Threading: the server's thread accepts; each connection gets a daemon thread; a reaper thread
enforces the per-connection deadline. All connection bookkeeping is under `_lock`.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from memkv import __version__
from memkv.protocol import HELLO_MAGIC
from memkv.server.metrics import NodeMetrics
from memkv.server.node import ACCEPT_BACKOFF_S, ADMIN_MAX_CONNECTIONS, EXHAUSTED_ERRNOS, Node
from memkv.tls import ServerTls, handshake

log = logging.getLogger("memkv.admin")

ADMIN_TIMEOUT_S = 10.0  # a whole admin connection, accept to close: scrapes take milliseconds
_REFUSAL = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_NOT_THE_DATA_PORT = (
    b"this is a MemKV node's admin port (HTTP), not its data port: point MEMKV_SERVERS at the data port "
    b"(by default the admin port - 1)\n"
)


def node_status(node: Node, admin_address: tuple[str, int]) -> dict[str, Any]:
    stats = node.store.stats()
    return {
        "node_id": node.node_id,
        "version": __version__,
        "protocol_version": 1,
        "address": f"{node.address[0]}:{node.address[1]}",
        "admin_address": f"{admin_address[0]}:{admin_address[1]}",
        "local_socket": node.local_socket,
        "shared_memory": None if node.shared is None else node.shared.stats(),
        "ready": node.ready,
        "uptime_s": round(time.time() - node.started_at, 3),
        "connections": node.connection_count(),
        "max_connections": node.max_connections,
        "max_value_bytes": node.limits.max_value_bytes,
        **stats,
        "hits": _counter(node, "memkv_node_keys_total", {"op": "get", "result": "ok"}),
        "misses": _counter(node, "memkv_node_keys_total", {"op": "get", "result": "miss"}),
    }


def _counter(node: Node, name: str, labels: dict[str, str]) -> float:
    value = node.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


class _Conn:
    __slots__ = ("deadline", "waiting", "closing")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.waiting = True  # no request read yet: the first to go when the cap is reached
        self.closing = False  # shut down by us; its thread is on its way out


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a connection cap, shedding and a per-connection deadline."""

    daemon_threads = True
    request_queue_size = 128  # a burst of scrapes waits in the backlog, not in SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        metrics: NodeMetrics,
        max_connections: int = ADMIN_MAX_CONNECTIONS,
        timeout_s: float = ADMIN_TIMEOUT_S,
    ) -> None:
        super().__init__(address, handler)
        self.metrics = metrics
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="memkv-admin-reaper", daemon=True)
        self._reaper.start()

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in EXHAUSTED_ERRNOS:  # the listener stays readable: back off, do not spin
                self.metrics.admin_refused.labels(EXHAUSTED_ERRNOS[exc.errno]).inc()
                self._closed.wait(ACCEPT_BACKOFF_S)
            raise  # socketserver drops this accept and polls again

    def process_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        with self._lock:
            live = [(c.deadline, s) for s, c in self._conns.items() if not c.closing]
            if len(live) >= self.max_connections:
                idle = min(((d, s) for d, s in live if self._conns[s].waiting), default=None, key=lambda x: x[0])
                if idle is None or len(self._conns) >= 2 * self.max_connections:
                    self._refuse(request, "max_connections")
                    return
                self._close(idle[1], "idle_shed")
            self._conns[request] = _Conn(time.monotonic() + self.timeout_s)
            self.metrics.admin_connections.inc()
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread to be had: refuse rather than stop the admin port
            self._forget(request)
            self._refuse(request, "no_thread")

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def mark_busy(self, request: socket.socket) -> None:
        with self._lock:
            conn = self._conns.get(request)
            if conn is not None:
                conn.waiting = False

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            if self._conns.pop(request, None) is not None:
                self.metrics.admin_connections.dec()

    def _refuse(self, request: socket.socket, reason: str) -> None:
        self.metrics.admin_refused.labels(reason).inc()
        try:
            request.setblocking(False)  # never wait on a peer we refuse
            request.send(_REFUSAL)
        except OSError:
            pass
        self.shutdown_request(request)

    def _close(self, request: socket.socket, reason: str) -> None:
        """Shut a connection down (lock held); its own thread closes it and forgets it."""
        self._conns[request].closing = True
        self.metrics.admin_refused.labels(reason).inc()
        try:
            request.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _reap(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                for request, conn in list(self._conns.items()):
                    if not conn.closing and now > conn.deadline:
                        self._close(request, "timeout")

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


class AdminServer:
    def __init__(
        self,
        node: Node,
        host: str,
        port: int,
        max_connections: int = ADMIN_MAX_CONNECTIONS,
        timeout_s: float = ADMIN_TIMEOUT_S,
    ) -> None:
        self.node = node
        self.tls: ServerTls | None = node.tls  # the data port's certificate, reloads included
        handler = _make_handler(self)
        self.httpd = BoundedHTTPServer((host, port), handler, node.metrics, max_connections, timeout_s)
        host_bound, port_bound = self.httpd.server_address[:2]
        self.address: tuple[str, int] = (str(host_bound), int(port_bound))
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.25}, name="memkv-admin", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _admin_tls(tls: ServerTls, sock: socket.socket) -> ssl.SSLSocket | None:
    """HTTPS on a duplicate of `sock` (server certificate only), or None when the handshake
    failed (a scan, a plain-HTTP client): the connection is then closed unanswered."""
    dup = sock.dup()
    try:
        wrapped = tls.admin_context.wrap_socket(dup, server_side=True, do_handshake_on_connect=False)
    except OSError:
        dup.close()
        return None
    try:
        handshake(wrapped, time.monotonic() + ADMIN_TLS_HANDSHAKE_S)
    except OSError:
        wrapped.close()
        return None
    return wrapped


# The admin TLS handshake's bound (the reaper's ADMIN_TIMEOUT_S bounds the whole connection).
ADMIN_TLS_HANDSHAKE_S = 5.0


def _make_handler(admin: AdminServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = f"memkv/{__version__}"
        timeout = 2 * ADMIN_TIMEOUT_S  # each read and write: a backstop; the reaper bounds the whole connection

        def setup(self) -> None:
            self.tracked = self.request  # the socket BoundedHTTPServer knows this connection by
            self.tls_failed = False
            if admin.tls is not None:
                self.request = _admin_tls(admin.tls, self.request)
                self.tls_failed = self.request is None
                if self.request is None:
                    self.request = self.tracked
            super().setup()

        def handle(self) -> None:
            if not self.tls_failed:
                super().handle()

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                if self.request is not self.tracked:
                    self.request.close()  # the TLS duplicate; socketserver closes the original

        def handle_one_request(self) -> None:
            try:
                # rfile is a BufferedReader (StreamRequestHandler's default rbufsize), which can peek
                head = self.rfile.peek(len(HELLO_MAGIC))[: len(HELLO_MAGIC)]  # type: ignore[attr-defined]
            except OSError:  # timed out, reset, or shut down by the reaper
                self.close_connection = True
                return
            if head == HELLO_MAGIC:  # a MemKV client at the wrong port: say so at once
                self.close_connection = True
                try:
                    self.wfile.write(
                        b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: "
                        + str(len(_NOT_THE_DATA_PORT)).encode()
                        + b"\r\nConnection: close\r\n\r\n"
                        + _NOT_THE_DATA_PORT
                    )
                except OSError:
                    pass
                return
            super().handle_one_request()

        def parse_request(self) -> bool:
            admin.httpd.mark_busy(self.tracked)  # a request line arrived: no longer idle
            return super().parse_request()

        def do_GET(self) -> None:
            node = admin.node
            path = self.path.split("?", 1)[0]
            if path == "/v1/health":
                self._json(200, {"status": "ok"})
            elif path == "/v1/ready":
                self._json(200 if node.ready else 503, {"ready": node.ready})
            elif path == "/v1/status":
                self._json(200, node_status(node, admin.address))
            elif path == "/v1/metrics":
                body = generate_latest(node.metrics.registry)
                self._send(200, CONTENT_TYPE_LATEST, body)
            else:
                self._json(
                    404,
                    {
                        "error": f"no such endpoint {path}",
                        "endpoints": ["/v1/health", "/v1/ready", "/v1/status", "/v1/metrics"],
                    },
                )

        def _json(self, code: int, doc: dict[str, Any]) -> None:
            self._send(code, "application/json", json.dumps(doc).encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("admin %s " + fmt, self.address_string(), *args)

    return Handler
