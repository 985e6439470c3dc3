"""`LeasedDirectManager`: direct mode with load_guarantee "leased" (docs/direct-mode.md).

A HIT is a lease on every rank's value, not staged bytes: the workers stream a load through
their staging ring (streaming.py), so a prompt of any length is reused. A sibling of the staged
`MemKVDirectManager` (manager.py); what both share is in base.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time

from vllm.v1.kv_offload.base import PrepareStoreOutput

from memkv import Client
from memkv.errors import MemKVError
from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm.direct.base import RESET_FENCE_STEPS, DirectManagerBase, log
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.keys import DirectKeys
from memkv_vllm.direct.layout import MemKVLoadStoreSpec, StagingLayout
from memkv_vllm.startup import StartupError

timing = logging.getLogger("memkv_vllm.direct.timing")  # DEBUG stage times (streaming.py says why)


class ChunkLeaseProber:
    """A lookup Prober (memkv_vllm.lookup) that LEASEs every rank's value of each chunk: a chunk
    answers True only when all `world_size` leases were granted. Leases granted for a chunk that
    answers False are orphans: posted to `orphans` for the manager to release.

    Threading: the lookup thread only (as the StatusPipeline it drives); `orphans` is a
    SimpleQueue drained by the scheduler."""

    def __init__(self, client: Client, keys: DirectKeys, ttl_s: float, orphans) -> None:
        self._pipe = client.lease_stream(ttl_s)
        self._keys = keys
        self._orphans = orphans

    def submit(self, chunk_keys: list[bytes], on_answer) -> None:
        w = self._keys.world_size
        value_keys = [vk for k in chunk_keys for vk in self._keys.value_keys(k)]
        left = [w] * len(chunk_keys)
        granted: list[list[bytes]] = [[] for _ in chunk_keys]

        def answered(indices: list[int], hits: list[bool]) -> None:
            done, verdicts = [], []
            for j, hit in zip(indices, hits):
                c = j // w
                if hit:
                    granted[c].append(value_keys[j])
                left[c] -= 1
                if left[c] == 0:
                    ok = len(granted[c]) == w
                    if not ok and granted[c]:
                        self._orphans.put(granted[c])
                    done.append(c)
                    verdicts.append(ok)
            if done:
                on_answer(done, verdicts)

        self._pipe.submit(value_keys, answered)

    def poll(self, timeout_s: float | None = None) -> None:
        self._pipe.poll(timeout_s)

    def wake(self) -> None:
        self._pipe.wake()

    def close(self) -> None:
        self._pipe.close()


class _Held:
    """A chunk whose every rank's value this engine holds a lease on."""

    __slots__ = ("refs", "pins", "renewed")

    def __init__(self, renewed: float) -> None:
        self.refs: set[str] = set()  # requests whose lookups answered HIT from it
        self.pins = 0  # load jobs between prepare_load and complete_load
        self.renewed = renewed


class LeasedDirectManager(DirectManagerBase):
    """Direct mode with load_guarantee "leased": a HIT is a lease, not staged bytes.

      lookup(key)   held by this engine .............................................. HIT
                    being stored by this engine (until complete_store) ............... RETRY
                    unknown -> batched LEASE of every rank's value (LookupService with a
                    ChunkLeaseProber: lookup_timeout_s deadline, MISS on outage) ..... RETRY
                    all leased -> held ............................................... HIT
                    any rank missing, refused or unreachable ......................... MISS
      prepare_load  pins the held leases; the job names the chunks' keys and each worker
                    streams its rank's values through its staging ring (streaming.py)
      complete_load unpins; a lease nobody needs any more is released (off this thread)
      prepare_store all new chunks at once (any number: the workers stream them through the
                    ring; never None, nothing shed); complete_store: their leases can be taken

    Leases are renewed every third of lease_ttl_s while held (a request may wait several steps
    between its HIT and its load). The staging region belongs to the workers (a ring per rank);
    this side moves no value bytes. Threading: every public method on the scheduler thread;
    lease renewals and releases run on one control thread (`_ctl`) that touches only the client."""

    mode = "direct-leased"

    def __init__(self, spec, settings: DirectSettings, layout: StagingLayout) -> None:
        super().__init__(spec, settings, layout)
        self._renew_every_s = settings.lease_ttl_s / 3
        try:
            self._check_lease_ttl()
        except BaseException:
            self._abort_startup()
            raise
        self._held: dict[bytes, _Held] = {}
        self._storing: set[bytes] = set()
        self._lease_fence: list[tuple[int, list[bytes]]] = []
        self._lookup_times: dict[str, tuple[float, int]] = {}  # timing log only: first lookup, calls
        self._ctl = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memkv-direct-lease")
        self._ctl_futures: list = []  # scheduler-owned; each future is completed by the control thread
        self._orphans: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()  # from ChunkLeaseProber
        ttl = settings.lease_ttl_s
        self._lookup = self._lookup_service(lambda: ChunkLeaseProber(self.client, self.keys, ttl, self._orphans))
        self._started(spec)

    def _reuse_summary(self) -> str:
        return "a prompt of any length"

    def _warn_limits(self, spec) -> None:
        extra = getattr(spec, "extra_config", None) or {}
        if int(extra.get("sync_load_budget_bytes", 0) or 0) > 0:
            log.warning(
                "MemKV direct mode: sync_load_budget_bytes is set: vLLM cannot recompute a synchronous "
                "(expedited) load that fails, it stops the engine; leave it unset with load_guarantee "
                '"leased"'
            )

    def _check_lease_ttl(self) -> None:
        """Every node must speak LEASE and grant our ttl: a node that caps it lower would let
        leases lapse between renewals."""
        probe = self.keys.config_key
        for server in self.client.servers():
            try:
                reply = self.client.lease_on(server, [probe], self.settings.lease_ttl_s)
            except MemKVError as exc:
                raise StartupError(
                    f"MemKV direct mode cannot start: server {server.name} did not answer LEASE ({exc}); "
                    f'load_guarantee "leased" needs nodes of memkv >= this version, or use "staged"'
                ) from exc
            granted_s = reply.ttl_ms / 1000.0
            if granted_s < self.settings.lease_ttl_s:
                self._renew_every_s = min(self._renew_every_s, granted_s / 3)
                log.warning(
                    "MemKV direct mode: server %s caps leases at %.1fs (--max-lease-ttl), below "
                    "memkv.lease_ttl_s=%.1fs: renewing every %.1fs",
                    server.name,
                    granted_s,
                    self.settings.lease_ttl_s,
                    self._renew_every_s,
                )
        self.client.release([probe])

    # -- lookups and loads ------------------------------------------------------------------------

    def lookup(self, key, req_context):
        rid = req_context.req_id
        self._looked_up.add(rid)
        if timing.isEnabledFor(logging.DEBUG):
            first, calls = self._lookup_times.get(rid, (time.perf_counter(), 0))
            self._lookup_times[rid] = (first, calls + 1)
        h = self._held.get(key)
        if h is not None:
            self._hold_ref(key, h, rid)
            return self._answer("hit")
        if key in self._storing:
            return self._answer("retry", rid)  # its puts are in flight: wait for complete_store
        found = self._lookup.lookup(key, rid)
        if found is None:
            return self._answer("retry", rid)
        if not found:
            if self._lookup.was_timeout(key):
                return compat.LookupResult.MISS  # counted as a timeout by the LookupService
            return self._answer("miss")
        # Granted at most lookup_timeout_s ago: renewal counts from then, to be safe.
        h = _Held(self._clock() - (self.settings.deadline_s or 0.0))
        self._held[key] = h
        self._hold_ref(key, h, rid)
        return self._answer("hit")

    def _hold_ref(self, key: bytes, h: _Held, rid: str) -> None:
        if rid not in h.refs:
            h.refs.add(rid)
            self._req_refs.setdefault(rid, set()).add(key)

    def prepare_load(self, keys, req_context):
        rid = req_context.req_id
        keys = list(keys)
        for key in keys:
            h = self._held.get(key)
            if h is None:  # the connector asks only for keys that answered HIT, in this step
                raise AssertionError("MemKV direct mode: prepare_load of a chunk that is not leased; this is a bug")
            h.pins += 1
            self._hold_ref(key, h, rid)
        self._loads.setdefault(rid, []).append(keys)
        self._unref(rid, keep=set(keys))
        if rid in self._lookup_times:
            first, calls = self._lookup_times.pop(rid)
            timing.debug(
                "request %s: load of %d leased chunk(s) prepared %.3f s after its first lookup (%d lookup call(s))",
                rid,
                len(keys),
                time.perf_counter() - first,
                calls,
            )
        return MemKVLoadStoreSpec([], keys=[self.keys.chunk_prefix(k) for k in keys])

    def _held_entry(self, key: bytes) -> _Held | None:
        return self._held.get(key)

    def _loaded(self, keyset: set[bytes]) -> None:
        # Workers fetched these chunks themselves: the scheduler side counts them here.
        self.stats.count(tm.LOAD_BYTES, self.layout.value_bytes * self.layout.world_size * len(keyset))

    # -- references -------------------------------------------------------------------------------

    def _unreferenced(self, entries: list[tuple[bytes, _Held]]) -> None:
        for key, _ in entries:
            del self._held[key]
        self._release_chunks([key for key, _ in entries])

    def _release_chunks(self, chunk_keys: list[bytes]) -> None:
        if not chunk_keys:
            return
        self._lookup.forget(chunk_keys)  # a later lookup leases anew
        self._release_values([vk for k in chunk_keys for vk in self.keys.value_keys(k)])

    def _release_values(self, value_keys: list[bytes]) -> None:
        if value_keys:
            self._control(lambda: self.client.release(value_keys))

    def _control(self, fn) -> None:
        """Run a lease renewal or release on the control thread; the scheduler never waits."""

        def run() -> None:
            try:
                fn()
            except Exception as exc:  # a node failure answers False, so this is a bug: log it
                log.warning("MemKV direct mode: lease control failed: %s", exc)

        self._ctl_futures = [f for f in self._ctl_futures if not f.done()]
        self._ctl_futures.append(self._ctl.submit(run))

    def _renew(self) -> None:
        now = self._clock()
        due = [k for k, h in self._held.items() if now - h.renewed >= self._renew_every_s]
        if not due:
            return
        for key in due:
            self._held[key].renewed = now
        value_keys = [vk for k in due for vk in self.keys.value_keys(k)]
        ttl = self.settings.lease_ttl_s

        def renew() -> None:
            ok = self.client.lease(value_keys, ttl)
            lost = [vk for vk, good in zip(value_keys, ok) if not good]
            if lost:
                log.warning(
                    "MemKV direct mode: %d of %d lease renewal(s) failed (node unreachable or restarted); "
                    "a load of those chunks retries for load_retry_s, then fails loudly",
                    len(lost),
                    len(ok),
                )

        self._control(renew)

    # -- stores -----------------------------------------------------------------------------------

    def prepare_store(self, keys, req_context):
        keys = list(keys)  # prompt order
        todo = [k for k in keys if k not in self._held and k not in self._storing]
        self._storing.update(todo)
        return PrepareStoreOutput(
            keys_to_store=todo,
            store_spec=MemKVLoadStoreSpec([], keys=[self.keys.chunk_prefix(k) for k in todo]),
            evicted_keys=[],
        )

    def complete_store(self, keys, req_context, success: bool = True) -> None:
        done = [k for k in keys if k in self._storing]
        self._storing.difference_update(done)
        self._lookup.forget(done, only_misses=True)  # a MISS remembered from before the store
        self.stats.count(tm.STORE_BYTES, self.layout.value_bytes * self.layout.world_size * len(done))

    # -- step hooks -------------------------------------------------------------------------------

    def on_schedule_end(self, context) -> None:
        orphans: list[bytes] = []
        while not self._orphans.empty():
            orphans += self._orphans.get_nowait()
        self._release_values(orphans)
        self._lookup.flush()
        self._release_answered()
        self._advance_lease_fence()
        self._renew()
        self.stats.gauge(tm.LEASED_BYTES, len(self._held) * self.layout.value_bytes * self.layout.world_size)
        # Also while a leased load streams, at TP=1 only: then the worker's fetch and copy threads
        # share this process (and its GIL) with the scheduler loop, which spins while the request
        # waits; at TP > 1 they run in the worker processes and the interval would buy nothing.
        loads_here = bool(self._loads) and self.layout.world_size == 1
        self._gil.hold(self._lookup.probing() or loads_here)

    def on_request_finished(self, req_context) -> None:
        rid = req_context.req_id
        self._lookup_times.pop(rid, None)
        fenced = {k for _, keys in self._lease_fence for k in keys}
        dropped = [k for k in self._lookup.cleanup(rid) if k not in self._held and k not in fenced]
        if dropped:  # leased by a probe, never answered as a HIT: nobody holds them (a load
            # flushed by reset_cache still streams under the fenced ones: the fence releases them)
            self._release_values([vk for k in dropped for vk in self.keys.value_keys(k)])
        self._unref(rid, keep=self._pinned_keys(rid))

    def has_pending_work(self) -> bool:
        return bool(
            self._lookup.pending()
            or self._storing
            or self._lease_fence
            or any(not f.done() for f in self._ctl_futures)
            or any(h.pins for h in self._held.values())
        )

    def reset_cache(self) -> None:
        """Forget every request. Loads in flight keep their leases until the flushed jobs are
        done (0.33: on_reset_flushed; earlier: RESET_FENCE_STEPS steps); the rest are released."""
        fenced, free = [], []
        for key, h in self._held.items():
            (fenced if h.pins else free).append(key)
        self._held.clear()
        self._req_refs.clear()
        self._loads.clear()
        self._storing.clear()
        self._release_chunks(free)
        if fenced:
            self._lease_fence.append((RESET_FENCE_STEPS, fenced))

    def on_reset_flushed(self) -> None:  # 0.33
        for _, keys in self._lease_fence:
            self._release_chunks(keys)
        self._lease_fence.clear()

    def _advance_lease_fence(self) -> None:
        keep = []
        for steps, keys in self._lease_fence:
            if steps <= 1:
                self._release_chunks(keys)
            else:
                keep.append((steps - 1, keys))
        self._lease_fence = keep

    def _stop(self) -> None:
        held = [vk for k in self._held for vk in self.keys.value_keys(k)]
        self._held.clear()
        if held:
            try:
                self._ctl.submit(self.client.release, held, timeout_s=1.0).result(timeout=5.0)
            except Exception:  # best effort: the leases expire by themselves
                pass
        self._ctl.shutdown(wait=False)
