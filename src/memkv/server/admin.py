"""Admin HTTP on the node's admin port: health, readiness, status, Prometheus metrics.

    GET /v1/health   200 {"status": "ok"} while the process serves HTTP (liveness)
    GET /v1/ready    200 while the node accepts clients, 503 once it is shutting down
    GET /v1/status   JSON: node id, addresses, capacity, bytes, values, lanes, evictions, connections
    GET /v1/metrics  Prometheus text format

Nothing secret is served: no key material, no value bytes (keys are not listed either).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from memkv import __version__
from memkv.server.node import Node

log = logging.getLogger("memkv.admin")


def node_status(node: Node, admin_address: tuple[str, int]) -> dict:
    stats = node.store.stats()
    return {
        "node_id": node.node_id,
        "version": __version__,
        "protocol_version": 1,
        "address": f"{node.address[0]}:{node.address[1]}",
        "admin_address": f"{admin_address[0]}:{admin_address[1]}",
        "ready": node.ready,
        "uptime_s": round(time.time() - node.started_at, 3),
        "connections": node.connection_count(),
        "max_value_bytes": node.limits.max_value_bytes,
        **stats,
        "hits": _counter(node, "memkv_node_keys_total", {"op": "get", "result": "ok"}),
        "misses": _counter(node, "memkv_node_keys_total", {"op": "get", "result": "miss"}),
    }


def _counter(node: Node, name: str, labels: dict) -> float:
    value = node.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


class AdminServer:
    def __init__(self, node: Node, host: str, port: int) -> None:
        self.node = node
        handler = _make_handler(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.address = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.25}, name="memkv-admin", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(admin: AdminServer):
    class Handler(BaseHTTPRequestHandler):
        server_version = f"memkv/{__version__}"

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
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
                self._json(404, {"error": f"no such endpoint {path}", "endpoints": ["/v1/health", "/v1/ready", "/v1/status", "/v1/metrics"]})

        def _json(self, code: int, doc: dict) -> None:
            self._send(code, "application/json", json.dumps(doc).encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("admin %s " + fmt, self.address_string(), *args)

    return Handler
