"""What the two direct-mode managers share: startup, the staging region, request bookkeeping.

`MemKVDirectManager` (manager.py, load_guarantee "staged") and `LeasedDirectManager`
(leased.py, "leased") are siblings built on `DirectManagerBase`. The base's `__init__` runs
the startup (startup.py: config chain, probe, namespace record, the staging region and its
RDMA registration) and sets up only its own fields; each manager then builds its lookup service
and state and calls `_started(spec)` last, which says the ready line. Nothing in the base's
`__init__` calls into a subclass.

Threading: every public method runs on the scheduler thread (0.33: under the connector's
`manager.lock`, default nullcontext). The fields here belong to the scheduler side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager

from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.keys import DirectKeys
from memkv_vllm.direct.layout import StagingLayout
from memkv_vllm.direct.staging import SlotTable, StagingRegion
from memkv_vllm.gil import SwitchInterval
from memkv_vllm.lookup import LookupService, Prober
from memkv_vllm.startup import Startup

log = logging.getLogger("vllm.memkv_vllm.direct")
RESET_FENCE_STEPS = 2  # <= 0.32: steps after a reset before flushed jobs' slots or leases are let go


class DirectManagerBase(OffloadingManager):
    mode = "direct"  # config_info's memkv_mode

    def __init__(self, spec, settings: DirectSettings, layout: StagingLayout) -> None:
        self.settings = settings
        self.layout = layout
        self._startup = Startup("MemKV direct mode", log)
        self.client = self._startup.open_client()
        self._region: StagingRegion | None = None
        try:
            self._startup.probe(self.client, layout.value_bytes, "one rank's chunk")
            self.keys = DirectKeys(settings.prefix, spec, layout.value_bytes, layout.world_size)
            self._startup.write_config_record(self.client, self.keys.config_key, self.keys.config_record())
            self._region = StagingRegion.open_or_create(layout.path, layout.region_bytes, owner=True)
            self._startup.register_pool(self.client, self._region.view)  # RDMA: nodes WRITE prefetches into it
        except BaseException:
            self._abort_startup()
            raise
        self._flat = self._region.view
        # The region's slots: "staged" takes them here; "leased" takes none on this side (its
        # workers stream through rings of the region), so all stay free.
        self.slots = SlotTable(layout.num_slots)
        self.stats = tm.TierStats(mode="direct")
        self._clock = time.monotonic
        self._req_refs: dict[str, set[bytes]] = {}  # request -> chunks it refers to
        self._loads: dict[str, list[list[bytes]]] = {}  # req -> keys of each pinned load
        self._looked_up: set[str] = set()  # requests that looked something up this step
        self._retrying: set[str] = set()  # ... and got a RETRY
        self._gil = SwitchInterval(settings.step_yield_ms / 1000.0)
        self._lookup: LookupService  # built by each manager (its prober)
        self._closed = True  # until _started

    def _abort_startup(self) -> None:
        """Undo the startup: for a failure before the manager has threads."""
        if self._region is not None:
            self._region.close()
        self.client.close()

    def _lookup_service(
        self, open_prober: Callable[[], Prober], store_keys: Callable[[list[bytes]], list[bytes]] = list
    ) -> LookupService:
        return LookupService(
            open_prober,
            self.settings.deadline_s,
            on_timeout=lambda n: self.stats.count(tm.LOOKUPS, n, ("timeout",)),
            store_keys=store_keys,
        )

    def _started(self, spec) -> None:
        """The last step of a manager's __init__: the ready line and what it cannot do."""
        self._closed = False
        layout, settings = self.layout, self.settings
        self._startup.warn_block_hashes("chunks")
        self._startup.ready(
            self.client,
            "load_guarantee=%s, reuses %s, world_size=%d, value_bytes=%d, staging=%d "
            "slots x %d bytes = %d MiB at %s, namespace=%s, lookup_timeout_s=%s, store_nice=%d",
            settings.load_guarantee,
            self._reuse_summary(),
            layout.world_size,
            layout.value_bytes,
            layout.num_slots,
            layout.slot_bytes,
            layout.region_bytes >> 20,
            layout.path,
            self.keys.namespace,
            settings.lookup_timeout_s,
            settings.store_nice,
        )
        self._warn_limits(spec)

    def _reuse_summary(self) -> str:
        raise NotImplementedError

    def _warn_limits(self, spec) -> None:
        """Say at startup what the configuration cannot do, not at the first long prompt."""

    # ---------------------------------------------------------------------------------------------
    # Lookups and requests
    # ---------------------------------------------------------------------------------------------

    def _answer(self, result: str, rid: str | None = None):
        self.stats.count(tm.LOOKUPS, 1, (result,))
        if result == "retry":
            self._retrying.add(rid)
            return compat.LookupResult.RETRY
        return compat.LookupResult.HIT if result == "hit" else compat.LookupResult.MISS

    def _pop_load(self, rid: str, keys) -> set | None:
        """The keys of `rid`'s load job with these keys, forgotten; None for a load that a
        reset_cache flushed (its pins were dropped or fenced there)."""
        jobs = self._loads.get(rid, [])
        keyset = set(keys)
        for i, job in enumerate(jobs):
            if set(job) == keyset:
                del jobs[i]
                break
        else:
            return None
        if not jobs:
            self._loads.pop(rid, None)
        return keyset

    def complete_load(self, keys, req_context) -> None:
        """The load job is over: its chunks are unpinned, and let go once no request refers to them."""
        rid = req_context.req_id
        keyset = self._pop_load(rid, keys)
        if keyset is None:
            return
        for key in keyset:
            held = self._held_entry(key)
            if held is not None and held.pins:
                held.pins -= 1
        self._loaded(keyset)
        self._unref(rid, only=keyset)

    def _held_entry(self, key: bytes) -> Any:
        """What this engine holds for chunk `key` (an object with `refs`, the requests whose
        lookups answered HIT from it, and `pins`, its load jobs in flight), or None."""
        raise NotImplementedError

    def _unreferenced(self, entries: list[tuple[bytes, Any]]) -> None:
        """(key, entry) pairs that no request refers to and no load pins any more."""
        raise NotImplementedError

    def _loaded(self, keyset: set[bytes]) -> None:  # empty: a manager that counts elsewhere keeps it
        """A load job of these chunks completed (the staged manager counts bytes as they arrive)."""

    def _pinned_keys(self, rid: str) -> set[bytes]:
        return {k for job in self._loads.get(rid, ()) for k in job}

    def _unref(self, rid: str, keep: set[bytes] = frozenset(), only: set[bytes] | None = None) -> None:
        """`rid` lets go of the chunks it refers to (those in `only`, or all), never of those in
        `keep`; what nothing refers to or pins any more goes to `_unreferenced`."""
        keys = self._req_refs.get(rid)
        if not keys:
            return
        free = []
        for key in list(keys if only is None else keys & only):
            if key in keep:
                continue
            keys.discard(key)
            held = self._held_entry(key)
            if held is not None:
                held.refs.discard(rid)
                if not held.refs and not held.pins:
                    free.append((key, held))
        if not keys:
            self._req_refs.pop(rid, None)
        self._unreferenced(free)

    def _release_answered(self) -> None:
        """A request whose lookups this step were all final has been answered: what it did not
        pin with prepare_load (past its prefix, or a prefix under one chunk) is let go."""
        for rid in self._looked_up - self._retrying:
            self._unref(rid, keep=self._pinned_keys(rid))
        self._looked_up.clear()
        self._retrying.clear()

    def get_load_source(self, key, req_context):  # 0.32+: a remote memory store, not the CPU pool
        if compat.TIER_CACHE_HIT_SOURCE is not None:
            return compat.TIER_CACHE_HIT_SOURCE
        return super().get_load_source(key, req_context)

    def on_new_request(self, req_context):
        return compat.RequestOffloadingContext()

    # ---------------------------------------------------------------------------------------------
    # Metrics and lifecycle
    # ---------------------------------------------------------------------------------------------

    def get_stats(self):
        return self.stats.take()

    def config_info(self) -> list[dict[str, Any]]:  # 0.33 info metric
        return [
            {
                "memkv_mode": self.mode,
                "memkv_servers": ",".join(a.name for a in self.client.servers()),
                "memkv_prefix": self.settings.prefix,
                "memkv_staging_mb": str(self.settings.staging_mb),
            }
        ]

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._gil.close()
        self._stop()
        self._lookup.shutdown()
        self.client.close()
        self._flat = None
        if self._region is not None:
            self._region.close()  # unlinks the file; workers' mappings stay valid until they close

    def _stop(self) -> None:
        """A manager's own threads, stopped at shutdown while the client is still open."""
