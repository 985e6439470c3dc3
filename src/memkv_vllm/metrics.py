"""The tier's metrics on vLLM's Prometheus endpoint (vllm:kv_offload_memkv_*).

Worker threads record into a `TierStats` accumulator under a lock; `get_stats()` (scheduler
thread) swaps it out once per step and turns it into vLLM's OffloadingConnectorStats. Every
name and label arity emitted is declared in `metric_definitions()`: vLLM's API server asserts
on anything undeclared.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

STORE_BYTES = "vllm:kv_offload_memkv_store_bytes"
LOAD_BYTES = "vllm:kv_offload_memkv_load_bytes"
JOB_SECONDS = "vllm:kv_offload_memkv_job_seconds"
JOBS_FAILED = "vllm:kv_offload_memkv_jobs_failed"
SHEDS = "vllm:kv_offload_memkv_sheds"
LOOKUPS = "vllm:kv_offload_memkv_lookups"

OPS = ("store", "load")
LOOKUP_RESULTS = ("hit", "miss", "retry", "timeout")
JOB_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def metric_definitions() -> dict[str, Any]:
    from memkv_vllm.compat import OffloadingCounterMetadata, OffloadingHistogramMetadata

    return {
        STORE_BYTES: OffloadingCounterMetadata("Bytes the memkv tier stored to MemKV (cascades)"),
        LOAD_BYTES: OffloadingCounterMetadata("Bytes the memkv tier loaded from MemKV into the CPU pool (promotions)"),
        JOB_SECONDS: OffloadingHistogramMetadata(
            "Wall time of memkv tier jobs from submission to completion, by op", labelnames=("op",),
            buckets=JOB_SECONDS_BUCKETS,
        ),
        JOBS_FAILED: OffloadingCounterMetadata("memkv tier jobs that failed (wholly or partly), by op", labelnames=("op",)),
        SHEDS: OffloadingCounterMetadata(
            "Blocks not stored to MemKV: store jobs shed whole because the store backlog was over max_store_backlog_mb, "
            "or because an earlier job of the same request was shed"
        ),
        LOOKUPS: OffloadingCounterMetadata(
            "memkv tier lookup answers: hit, miss, retry (probe pending), timeout (unanswered past lookup_timeout_s: a miss)",
            labelnames=("result",),
        ),
    }


class TierStats:
    """Thread-safe accumulator, drained by `take()` once per scheduler step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._observations: list[tuple[str, tuple[str, ...], float]] = []
        # Totals since start, never reset: for logs, tests and the ready line.
        self.totals: Counter[tuple[str, tuple[str, ...]]] = Counter()

    def count(self, name: str, value: float = 1, labels: tuple[str, ...] = ()) -> None:
        if not value:
            return
        with self._lock:
            self._counters[(name, labels)] += value
            self.totals[(name, labels)] += value

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._observations.append((name, labels, value))

    def total(self, name: str, labels: tuple[str, ...] = ()) -> float:
        with self._lock:
            return self.totals[(name, labels)]

    def take(self):
        """vLLM's OffloadingConnectorStats with everything since the last call, or None."""
        with self._lock:
            counters, self._counters = self._counters, Counter()
            observations, self._observations = self._observations, []
        if not counters and not observations:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for (name, labels), value in counters.items():
            stats.increase_counter(name, value, labels)
        for name, labels, value in observations:
            stats.observe_histogram(name, value, labels)
        return stats
