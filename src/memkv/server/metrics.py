"""Node metrics, exposed on the admin port at /v1/metrics (Prometheus text format).

Counters and histograms are updated by connection threads; gauges describing the store are
read from `Store.stats()` at scrape time by a custom collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from memkv.server.store import Store

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class StoreCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats()
        yield GaugeMetricFamily(
            "memkv_node_capacity_bytes", "Configured byte capacity of the node", value=s["capacity_bytes"]
        )
        yield GaugeMetricFamily("memkv_node_stored_bytes", "Value bytes of the stored values", value=s["stored_bytes"])
        yield GaugeMetricFamily(
            "memkv_node_allocated_bytes",
            "Buffer bytes held: stored, pooled for reuse, and in flight",
            value=s["allocated_bytes"],
        )
        yield GaugeMetricFamily("memkv_node_values", "Number of stored values", value=s["values"])
        yield GaugeMetricFamily(
            "memkv_node_inflight_bytes",
            "Buffer bytes reserved for PUT values still being received",
            value=s["inflight_bytes"],
        )
        yield GaugeMetricFamily("memkv_node_leases", "Leases held (key, holder pairs)", value=s["leases"])
        yield GaugeMetricFamily(
            "memkv_node_lease_holders", "Holders (lease tokens) with a lease", value=s["lease_holders"]
        )
        yield GaugeMetricFamily(
            "memkv_node_leased_bytes", "Buffer bytes of values with at least one lease", value=s["leased_bytes"]
        )
        yield CounterMetricFamily(
            "memkv_node_lease_expirations", "Leases that ended by expiring (not released)", value=s["lease_expirations"]
        )
        yield CounterMetricFamily(
            "memkv_node_leases_refused",
            "Leases answered MISS because a lease count or leased bytes bound (the node's or a holder's) was reached",
            value=s["leases_refused"],
        )
        lane_bytes = GaugeMetricFamily("memkv_node_lane_used_bytes", "Buffer bytes used per lane", labels=["lane"])
        lane_share = GaugeMetricFamily("memkv_node_lane_share_bytes", "Capacity share per lane", labels=["lane"])
        lane_values = GaugeMetricFamily("memkv_node_lane_values", "Values per lane", labels=["lane"])
        evictions = CounterMetricFamily(
            "memkv_node_evictions", "Values evicted to make room, per lane", labels=["lane"]
        )
        for lane in s["lanes"]:
            lane_bytes.add_metric([lane["name"]], lane["used_bytes"])
            lane_share.add_metric([lane["name"]], lane["share_bytes"])
            lane_values.add_metric([lane["name"]], lane["values"])
            evictions.add_metric([lane["name"]], lane["evictions"])
        yield from (lane_bytes, lane_share, lane_values, evictions)
        if self.store.shared is not None:  # memfd values (memkv/server/shm.py)
            shm = self.store.shared.stats()
            yield GaugeMetricFamily(
                "memkv_node_shm_bytes",
                "Buffer bytes of the values held in memfds (stored through shared memory, or reserved for an "
                "SHM_PUT), part of memkv_node_allocated_bytes",
                value=shm["bytes"],
            )
            yield GaugeMetricFamily(
                "memkv_node_shm_values", "Memfds the node holds (values and pending reservations)", value=shm["values"]
            )
            yield GaugeMetricFamily(
                "memkv_node_shm_node_written_bytes",
                "Buffer bytes of the node's own reused memfds (values stored over the socket with "
                "--shared-memory-stores node, pooled or reserved), part of memkv_node_allocated_bytes",
                value=shm["node_written_bytes"],
            )
            yield GaugeMetricFamily(
                "memkv_node_shm_spare_bytes",
                "Buffer bytes of spares: fresh memfds faulted in for the same-host stores to come, part of "
                "memkv_node_allocated_bytes",
                value=shm["spare_bytes"],
            )
            yield CounterMetricFamily(
                "memkv_node_shm_spares_taken",
                "SHM_PUT items given a spare (their writer's copy faulted no page in)",
                value=shm["spares_taken"],
            )
            yield CounterMetricFamily(
                "memkv_node_shm_puts_refused",
                "SHM_PUT items answered NOT_SHARED because a memfd bound was reached (the client stores them over "
                "the socket)",
                value=shm["refused_puts"],
            )
            yield CounterMetricFamily(
                "memkv_node_shm_commits_refused",
                "SHM_COMMIT items refused (STILL_MAPPED): the memfd was still mapped writable, so it could not be sealed",
                value=shm["refused_commits"],
            )
            yield CounterMetricFamily(
                "memkv_node_shm_reservations_reclaimed",
                "SHM_PUT reservations dropped uncommitted (not committed within io_timeout_s, connection ended)",
                value=shm["reclaimed_reservations"],
            )


class NodeMetrics:
    """One registry per node (tests run several nodes in one process)."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(StoreCollector(store))
        # process_resident_memory_bytes & co: RSS against stored bytes is the node's memory
        # overhead (docs/operations.md); a private registry does not get them by default.
        ProcessCollector(registry=r)
        self.requests = Counter(
            "memkv_node_requests", "Requests handled, by op (counted when read, before the reply)", ["op"], registry=r
        )
        self.keys = Counter("memkv_node_keys", "Keys processed, by op and result", ["op", "result"], registry=r)
        self.request_seconds = Histogram(
            "memkv_node_request_seconds",
            "Time to serve one request, by op",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter("memkv_node_received_bytes", "Value bytes received (PUT)", registry=r)
        self.bytes_out = Counter("memkv_node_sent_bytes", "Value bytes sent (GET)", registry=r)
        self.errors = Counter("memkv_node_errors", "Connections ended by an error, by error code", ["code"], registry=r)
        self.auth_failures = Counter(
            "memkv_node_auth_failures", "Refused handshakes and frames, by reason", ["reason"], registry=r
        )
        self.connections = Gauge("memkv_node_connections", "Open client connections", registry=r)
        self.connections_total = Counter("memkv_node_connections_accepted", "Client connections accepted", registry=r)
        self.local_connections_total = Counter(
            "memkv_node_local_connections_accepted",
            "Client connections accepted on the same-host (Unix) socket, of memkv_node_connections_accepted",
            registry=r,
        )
        self.refused_connections = Counter(
            "memkv_node_connections_refused",
            "Data-port connections refused or shed, by reason (max_connections, fd_limit, fd_limit_system, no_memory, no_thread)",
            ["reason"],
            registry=r,
        )
        self.admin_connections = Gauge("memkv_node_admin_connections", "Open admin-port (HTTP) connections", registry=r)
        self.admin_refused = Counter(
            "memkv_node_admin_connections_refused",
            "Admin-port connections refused or closed by the node, by reason (max_connections, idle_shed, timeout)",
            ["reason"],
            registry=r,
        )
        self.rdma_registrations = Counter(
            "memkv_node_rdma_registrations",
            "Store buffers registered with NIXL, by when (alloc: as a PUT made the buffer; read: on "
            "its first RDMA read, which pays the registration)",
            ["when"],
            registry=r,
        )
        self.rdma_registration_seconds = Counter(
            "memkv_node_rdma_registration_seconds", "Seconds spent registering store buffers with NIXL, by when",
            ["when"], registry=r,
        )  # fmt: skip
        self.puts_refused = Counter(
            "memkv_node_puts_refused",
            "PUT items refused, by reason (no_space, inflight_limit: NO_SPACE; leased: LEASED)",
            ["reason"],
            registry=r,
        )

    def count_registration(self, when: str, seconds: float) -> None:
        """One store buffer registered with NIXL (memkv/server/rdma.py): when is "alloc" or "read"."""
        self.rdma_registrations.labels(when).inc()
        self.rdma_registration_seconds.labels(when).inc(seconds)
