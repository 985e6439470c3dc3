"""Client transport metrics, exported over HTTP only when MEMKV_PROMETHEUS_BIND is set.

One registry per process (several Client objects share it, labelled by server); the exporter
starts at most once per process.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("memkv.client")

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "memkv_client_requests", "Requests sent, by server, op and outcome", ["server", "op", "result"], registry=REGISTRY
)
KEYS = Counter("memkv_client_keys", "Keys processed, by op and result", ["op", "result"], registry=REGISTRY)
BYTES = Counter("memkv_client_value_bytes", "Value bytes moved, by direction", ["direction"], registry=REGISTRY)
SECONDS = Histogram(
    "memkv_client_request_seconds",
    "Latency of one batched request to one server, by op",
    ["op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
SERVER_UP = Gauge(
    "memkv_client_server_up", "1 while the server is usable, 0 while marked down", ["server"], registry=REGISTRY
)
INTEGRITY_FAILURES = Counter(
    "memkv_client_integrity_failures",
    "Values whose checksum failed verification (loaded as a miss)",
    ["server"],
    registry=REGISTRY,
)

_exporter_lock = threading.Lock()
_exporter_address: tuple[str, int] | None = None


def start_exporter(host: str, port: int) -> tuple[str, int]:
    """Serve REGISTRY at http://host:port/metrics once per process; later calls are no-ops."""
    global _exporter_address
    with _exporter_lock:
        if _exporter_address is None:
            server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
            bound_host, bound_port = server.server_address[:2]
            _exporter_address = (str(bound_host), int(bound_port))
            log.info("memkv-client metrics on http://%s:%d/metrics", *_exporter_address)
        return _exporter_address
