"""`MemKVDirectManager`: the scheduler side of direct mode. MemKV is the offload medium.

vLLM's worker asserts success for every transfer job (vllm-spec-api.md 5.4): once the
connector has turned a lookup HIT into a load job, nothing can turn it back into a recompute.
So a HIT must mean "the bytes are already here". This manager answers HIT only for chunks
whose bytes sit in the engine's staging region, received whole and checksum-verified:

  lookup(key)   unknown       -> batched `exists` probe (LookupService: lookup_timeout_s
                                 deadline, MISS on outage) ............................ RETRY
                exists: no    -> ............................................................ MISS
                exists: yes   -> take a staging slot, prefetch every rank's value into it . RETRY
                                 (no free slot: ....................................... MISS)
                prefetching   -> ........................................................ RETRY
                                 (past lookup_timeout_s: abandon, slot quarantined ... MISS)
                prefetch failed or corrupt (the client verifies checksums) ............ MISS
                staged, verified -> ...................................................... HIT
  prepare_load  pins the staged slots; the workers copy slot -> GPU (local memory, cannot fail)
  complete_load unpins; a slot nobody needs is free again (no residency: staging is not a cache)

Stores go the other way, with the network after the GPU is released:

  prepare_store takes one slot per new chunk (all of the job, or None = "retry next step" while
                the job could fit once puts drain; a job larger than the whole region keeps
                its leading chunks and the request's later chunks are shed: what MemKV holds
                for a request is always a prefix, the only part the connector's prefix
                lookup can use);
  workers copy GPU -> their rank's section of the slots and report (a local copy: fast, so
                the engine's wait() on flushed jobs never waits on the network);
  complete_store puts every rank's section as its own value; the slot is free once the put
                returned. A failed put is just a future MISS.

Why the scheduler, not the workers, talks to MemKV: the connector gives the scheduler the
only point where a failure can still become a MISS (lookup), and one client per engine sees
the whole chunk (all ranks) for verification; workers stay free of sockets and timeouts.
The price: every byte crosses the scheduler process, as in the tier.

Threading: every public method runs on the scheduler thread (0.33: under the connector's
`manager.lock`, default nullcontext, which suffices: no thread of ours touches the fields
below). Ownership: `_entries`, `_req_refs`, `_loads`, `_fence`, the SlotTable and the store
admission state belong to the scheduler side; transfer threads (memkv_vllm.transfers) only
move bytes between MemKV and slots they were given, and report through TransferPool records
that `_drain` applies. No method waits on the network.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, PrepareStoreOutput

from memkv import __version__ as memkv_version
from memkv import Client, ClientConfig
from memkv.errors import MemKVError
from memkv.license import check_license
from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm import release
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.keys import DirectKeys
from memkv_vllm.direct.layout import MemKVLoadStoreSpec, StagingLayout
from memkv_vllm.direct.staging import SlotTable, StagingRegion
from memkv_vllm.lookup import LookupService
from memkv_vllm.transfers import LOAD, STORE, TaskResult, TransferPool

log = logging.getLogger("vllm.memkv_vllm.direct")
timing = logging.getLogger("memkv_vllm.direct.timing")  # DEBUG stage times (streaming.py says why)

FILLING, READY, WRITING, PUTTING = "filling", "ready", "writing", "putting"
RESET_FENCE_STEPS = 2  # <= 0.32: steps after a reset before flushed jobs' slots are reused
PUT_RECENTLY_MAX = 1 << 16  # keys this engine stored, answered without a probe (a prefetch still verifies)


class DirectStartupError(RuntimeError):
    """Direct mode cannot start: the message names the server or setting and the likely cause."""


class _Entry:
    """One chunk in staging. FILLING: prefetch in flight; READY: verified bytes; WRITING:
    workers are copying a store into it; PUTTING: stored bytes, put in flight (readable)."""

    __slots__ = ("key", "slot", "state", "refs", "pins", "started", "late")

    def __init__(self, key: bytes, slot: int, state: str, now: float) -> None:
        self.key = key
        self.slot = slot
        self.state = state
        self.refs: set[str] = set()  # requests whose lookups answered (or will answer) from it
        self.pins = 0  # load jobs between prepare_load and complete_load
        self.started = now
        self.late = False  # set by the transfer thread: a failed RDMA fetch may still write the slot

    @property
    def readable(self) -> bool:
        return self.state in (READY, PUTTING)


class MemKVDirectManager(OffloadingManager):
    def __init__(self, spec, settings: DirectSettings, layout: StagingLayout) -> None:
        self.settings = settings
        self.layout = layout
        self.client = Client(self._client_config())
        self._region: StagingRegion | None = None
        try:
            self._probe_all()
            self.keys = DirectKeys(settings.prefix, spec, layout.value_bytes, layout.world_size)
            self._write_config_record()
            self._region = StagingRegion.open_or_create(layout.path, layout.region_bytes, owner=True)
            self._register_region()
        except BaseException:
            if self._region is not None:
                self._region.close()
            self.client.close()
            raise
        self._flat = self._region.view
        self.slots = SlotTable(layout.num_slots)
        self.stats = tm.TierStats(mode="direct")
        self._clock = time.monotonic
        self._entries: dict[bytes, _Entry] = {}
        self._req_refs: dict[str, set[bytes]] = {}
        self._loads: dict[str, list[list[bytes]]] = {}  # req -> keys of each pinned load
        self._cut: set[str] = set()  # requests whose later store jobs are shed
        self._prefetch_queue: list[_Entry] = []
        self._jobs: dict[int, list[_Entry]] = {}
        self._job_ids = 0
        self._put_recently: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # bounded
        self._looked_up: set[str] = set()  # requests that looked something up this step
        self._retrying: set[str] = set()  # ... and got a RETRY
        self._probing: set[str] = set()  # ... and had a chunk whose exists probe is unanswered
        self._fence: list[tuple[int, list[_Entry]]] = []  # (steps left, entries) after reset_cache
        # Grace 0: a failed prefetch is reported at once (its lookup answers MISS now); what may
        # still land late is handled per slot here (_late), not by withholding the result.
        # "leased" moves no value bytes on this side (the workers do, with these thread counts).
        self._pool = None if settings.leased else TransferPool(settings.n_read_threads, settings.n_write_threads,
                                                               0.0)
        self._late: list[tuple[float, int]] = []  # (release time, slot): failed RDMA prefetches
        self._lookup = self._open_lookup()
        self._step_yield_s = settings.step_yield_ms / 1000.0
        self._closed = False
        problem = compat.block_hash_reuse_problem()
        if problem:
            log.warning("MemKV direct mode: %s: chunks stored by this engine cannot be reused by a restarted or "
                        "another engine. Set PYTHONHASHSEED (e.g. 0) on every instance that should share KV.", problem)
        log.info("MemKV direct mode ready (servers=%s, rdma=%s, load_guarantee=%s, reuses %s, world_size=%d, "
                 "value_bytes=%d, staging=%d slots x %d bytes = %d MiB at %s, namespace=%s, lookup_timeout_s=%s, "
                 "memkv=%s, %s)",
                 [a.name for a in self.client.servers()], self.client.has_rdma(), settings.load_guarantee,
                 self._reuse_summary(), layout.world_size, layout.value_bytes, layout.num_slots, layout.slot_bytes,
                 layout.region_bytes >> 20, layout.path, self.keys.namespace, settings.lookup_timeout_s,
                 memkv_version, release.vllm_field())
        release.warn_if_unqualified()
        self._warn_reuse_limits(spec)

    def _reuse_summary(self) -> str:
        if self.settings.leased:
            return "a prompt of any length"
        return f"at most {self.layout.staged_prompt_tokens} tokens of a prompt"

    def _warn_reuse_limits(self, spec) -> None:
        """Say at startup what the configuration cannot do, not at the first long prompt."""
        layout, st = self.layout, self.settings
        if not st.leased and layout.staged_prompt_tokens < layout.max_model_len:
            mib_per_1k = -(-layout.slot_bytes * layout.num_groups * 1024 // max(1, layout.tokens_per_chunk)) / (1 << 20)
            log.warning("MemKV direct mode: load_guarantee \"staged\" with memkv.staging_mb %d reuses at most %d of "
                        "max_model_len %d tokens of a prompt; the rest of a longer prompt is recomputed. Raise "
                        "staging_mb (%.0f MiB per 1k tokens) or use \"leased\" (the default from vLLM 0.34)",
                        st.staging_mb, layout.staged_prompt_tokens, layout.max_model_len, mib_per_1k)
        extra = getattr(spec, "extra_config", None) or {}
        if st.leased and int(extra.get("sync_load_budget_bytes", 0) or 0) > 0:
            log.warning("MemKV direct mode: sync_load_budget_bytes is set: vLLM cannot recompute a synchronous "
                        "(expedited) load that fails, it stops the engine; leave it unset with load_guarantee "
                        "\"leased\"")

    # ---------------------------------------------------------------------------------------------
    # Startup
    # ---------------------------------------------------------------------------------------------

    def _open_lookup(self) -> LookupService:
        return LookupService(self.client.exists_stream, self.settings.deadline_s,
                             on_timeout=lambda n: self.stats.count(tm.LOOKUPS, n, ("timeout",)),
                             store_keys=self.keys.probe_keys)

    @staticmethod
    def _client_config() -> ClientConfig:
        config = ClientConfig.from_env()  # MEMKV_CONFIG, then MEMKV_* (memkv.config)
        status = check_license(config.license, config.license_public_key)
        if status is not None:
            log.info(status.log_line())
        return config

    def _probe_all(self) -> None:
        """Every configured server: with HRW a bad entry would silently lose its share of keys."""
        from memkv_vllm.tier import explain_probe_failure  # one wording for both modes

        try:
            probes = self.client.probe()
        except MemKVError as exc:
            raise DirectStartupError(f"MemKV direct mode cannot start: {explain_probe_failure(exc)}") from exc
        for probe in probes:
            if probe.max_value_bytes < self.layout.value_bytes:
                raise DirectStartupError(
                    f"MemKV direct mode cannot start: server {probe.server} accepts values up to "
                    f"{probe.max_value_bytes} bytes but one rank's chunk is {self.layout.value_bytes} bytes -- start "
                    f"the node with --max-value-size >= {self.layout.value_bytes} or use a smaller block_size")

    def _write_config_record(self) -> None:
        key = self.keys.config_key
        if not self.client.exists([key])[0]:
            if not self.client.batch_put_views([(key, self.keys.config_record())])[0]:
                log.warning("MemKV direct mode: could not write the namespace record %r", key)

    def _register_region(self) -> None:
        """RDMA (docs/rdma.md): nodes WRITE prefetches straight into the staging region."""
        try:
            self.client.register_pool(self._region.view)
        except MemKVError as exc:
            raise DirectStartupError(f"MemKV direct mode cannot start: {exc}") from exc

    # ---------------------------------------------------------------------------------------------
    # Lookups and loads
    # ---------------------------------------------------------------------------------------------

    def lookup(self, key, req_context):
        self._drain()
        rid = req_context.req_id
        self._looked_up.add(rid)
        e = self._entries.get(key)
        if e is not None:
            if e.readable:
                self._ref(e, rid)
                return self._answer("hit")
            if e.state == FILLING:
                deadline = self.settings.deadline_s
                if deadline is not None and self._clock() - e.started >= deadline:
                    self._abandon(e)
                    log.warning("MemKV direct mode: prefetch unanswered after %.1fs: answering MISS "
                                "(lookup_timeout_s); its staging slot stays quarantined until the transfer ends",
                                self._clock() - e.started)
                    self.stats.count(tm.LOOKUPS, 1, ("timeout",))
                    return compat.LookupResult.MISS
                self._ref(e, rid)
            return self._answer("retry", rid)  # FILLING, or WRITING: its bytes land at complete_store
        found = self._lookup.lookup(key, rid)
        if found is False and key in self._put_recently:
            # Stored by this engine after the verdict was cached (the request that stored it may not
            # be reported finished yet, so its MISS is still remembered): it exists.
            found = True
        if found is None:
            self._probing.add(rid)
            return self._answer("retry", rid)
        if not found:
            if self._lookup.was_timeout(key):
                return compat.LookupResult.MISS  # counted as a timeout by the LookupService
            return self._answer("miss")
        if rid in self._probing:
            # An earlier chunk of this scan (the connector scans in prompt order and goes on past a
            # RETRY) is still being probed: it gets the next slot first, or a later chunk could take
            # the last one and leave a hole in the prefix.
            return self._answer("retry", rid)
        taken = self.slots.take(1)
        if taken is None:
            self.stats.count(tm.STAGING_FULL, 1, ("load",))
            return self._answer("miss")
        e = _Entry(key, taken[0], FILLING, self._clock())
        self._entries[key] = e
        self._ref(e, rid)
        self._prefetch_queue.append(e)
        return self._answer("retry", rid)

    def _answer(self, result: str, rid: str | None = None):
        self.stats.count(tm.LOOKUPS, 1, (result,))
        if result == "retry":
            self._retrying.add(rid)
            return compat.LookupResult.RETRY
        return compat.LookupResult.HIT if result == "hit" else compat.LookupResult.MISS

    def prepare_load(self, keys, req_context):
        self._drain()
        rid = req_context.req_id
        keys = list(keys)
        slots = []
        for key in keys:
            e = self._entries.get(key)
            # The connector asks only for keys that answered HIT, in this step (0.33: in the same
            # lock region); a HIT entry is dropped only once no request refers to it.
            if e is None or not e.readable:
                raise AssertionError(f"MemKV direct mode: prepare_load of a chunk that is not staged "
                                     f"({None if e is None else e.state}); this is a bug")
            e.pins += 1
            self._ref(e, rid)
            slots.append(e.slot)
        self._loads.setdefault(rid, []).append(keys)
        loading = set(keys)
        self._unref(rid, keep=loading)  # staged past the loaded prefix: not needed any more
        return MemKVLoadStoreSpec(slots)

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
        rid = req_context.req_id
        keyset = self._pop_load(rid, keys)
        if keyset is None:
            return
        for key in keyset:
            e = self._entries.get(key)
            if e is not None and e.pins:
                e.pins -= 1
        self._unref(rid, only=keyset)

    def get_load_source(self, key, req_context):  # 0.32+: a remote memory store, not the CPU pool
        if compat.TIER_CACHE_HIT_SOURCE is not None:
            return compat.TIER_CACHE_HIT_SOURCE
        return super().get_load_source(key, req_context)

    # ---------------------------------------------------------------------------------------------
    # Stores
    # ---------------------------------------------------------------------------------------------

    def prepare_store(self, keys, req_context):
        self._drain()
        rid = req_context.req_id
        keys = list(keys)  # prompt order (the connector builds it so; only complete_store gets a set)
        todo = [k for k in keys if k not in self._entries]  # staged or being stored: skip for good
        if rid in self._cut:
            self.stats.count(tm.SHEDS, len(todo))
            return PrepareStoreOutput(keys_to_store=[], store_spec=MemKVLoadStoreSpec([]), evicted_keys=[])
        slots = self.slots.take(len(todo))
        if slots is None:
            if len(todo) <= self.slots.num_slots:
                # Puts are draining the region: the connector offers the same chunks next step.
                self.stats.count(tm.STAGING_FULL, len(todo), ("store",))
                return None
            # Larger than the whole region: keep what fits now, shed the rest and every later job
            # of this request (the prefix rule), and say which key to raise.
            fit = self.slots.free
            slots = self.slots.take(fit) or []
            shed = len(todo) - fit
            todo = todo[:fit]
            self._cut.add(rid)
            self.stats.count(tm.SHEDS, shed)
            log.warning("MemKV direct mode: a store job of %s needs more staging than memkv.staging_mb (%d MiB) "
                        "holds; kept its first %d chunk(s), shed %d and the rest of the request. Raise "
                        "staging_mb, lower max_num_batched_tokens, or set memkv.load_guarantee \"leased\" (any "
                        "prompt length through the same region; docs/direct-mode.md, 'Two load guarantees').",
                        rid, self.settings.staging_mb, fit, shed)
        now = self._clock()
        for key, slot in zip(todo, slots):
            e = _Entry(key, slot, WRITING, now)
            self._entries[key] = e
        return PrepareStoreOutput(keys_to_store=todo, store_spec=MemKVLoadStoreSpec(slots), evicted_keys=[])

    def complete_store(self, keys, req_context, success: bool = True) -> None:
        entries = []
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.state != WRITING:
                continue
            if not success:  # never passed by the connector (0.25-0.33); kept for the contract
                self._drop(e)
                continue
            e.state = PUTTING
            entries.append(e)
        if entries:
            self._submit(STORE, entries, self._put_task)

    def _put_task(self, entries: list[_Entry]) -> TaskResult:
        items, owners = [], []
        last = self.layout.world_size - 1
        present = self.client.exists([self.keys.value_key(e.key, last) for e in entries])
        ok = list(present)  # another engine stored it already: one small round trip saves the bytes
        for i, e in enumerate(entries):
            if present[i]:
                continue
            for rank, vk in enumerate(self.keys.value_keys(e.key)):
                items.append((vk, self._section(e.slot, rank)))
                owners.append(i)
        if items:
            stored = self.client.batch_put_views(items)
            per = [True] * len(entries)
            for i, good in zip(owners, stored):
                per[i] &= good
            for i, e in enumerate(entries):
                if not present[i]:
                    ok[i] = per[i]
            self.stats.count(tm.STORE_BYTES, self.layout.value_bytes * sum(stored))
        return TaskResult(ok)

    # ---------------------------------------------------------------------------------------------
    # Transfers
    # ---------------------------------------------------------------------------------------------

    def _section(self, slot: int, rank: int) -> memoryview:
        start = self.layout.section_offset(slot, rank)
        return self._flat[start : start + self.layout.value_bytes]

    def _submit(self, kind: str, entries: list[_Entry], run) -> None:
        """Pool jobs of up to blocks_per_op chunks; each entry's slot is busy until its job's
        record is drained (a failed RDMA load: until load_failure_grace_s after it).

        A job is reported when its last task returns and a batch returns when its slowest node
        does, so jobs never mix chunks of different owner sets: a stalled node holds only its
        own chunks, and the others HIT at once."""
        groups: dict[frozenset, list[_Entry]] = {}
        for e in entries:
            self.slots.mark_busy(e.slot)
            owners = frozenset(self.client.owner(vk).name for vk in self.keys.value_keys(e.key))
            groups.setdefault(owners, []).append(e)
        step = self.settings.blocks_per_op
        for group in groups.values():
            for lo in range(0, len(group), step):
                part = group[lo : lo + step]
                job_id = self._job_ids
                self._job_ids += 1
                self._jobs[job_id] = part
                self._pool.submit(job_id, kind, [e.key for e in part], [(0, len(part), lambda es=part: run(es))])

    def _prefetch_task(self, entries: list[_Entry]) -> TaskResult:
        items, owners = [], []
        for i, e in enumerate(entries):
            for rank, vk in enumerate(self.keys.value_keys(e.key)):
                items.append((vk, self._section(e.slot, rank)))
                owners.append(i)
        result = self.client.batch_load_into(items)  # whole, exact length, checksum verified, or False
        ok = [True] * len(entries)
        for i, good in zip(owners, result.ok):
            ok[i] &= good
        self.stats.count(tm.LOAD_BYTES, self.layout.value_bytes * sum(result.ok))
        if result.may_land_late:
            for e, good in zip(entries, ok):
                e.late = not good  # read by the scheduler thread once this job's record is drained
        failed = [vk for (vk, _), i in zip(items, owners) if not ok[i]]
        if failed:
            # Purge: a chunk that cannot load (evicted, corrupt, a rank missing) must recompute and
            # re-store once instead of failing the same prefetch again.
            self.client.delete(failed)
        return TaskResult(ok, may_land_late=result.may_land_late)

    def _drain(self) -> None:
        if self._pool is None:  # "leased": no transfer pool on this side (LeasedDirectManager)
            return
        if self._late:
            now = self._clock()
            due = [slot for t, slot in self._late if t <= now]
            if due:
                self._late = [(t, slot) for t, slot in self._late if t > now]
                for slot in due:
                    self.slots.transfer_done(slot)
        for f in self._pool.take_finished():
            entries = self._jobs.pop(f.job_id)
            self.stats.observe(tm.JOB_SECONDS, f.seconds, (f.kind,))
            if not all(f.ok):
                self.stats.count(tm.JOBS_FAILED, 1, (f.kind,))
            missed = []
            for e, good in zip(entries, f.ok):
                if e.late and not good and self.settings.load_failure_grace_s > 0:
                    # RDMA: a node may still WRITE into the slot; it stays quarantined a while.
                    self._late.append((self._clock() + self.settings.load_failure_grace_s, e.slot))
                else:
                    self.slots.transfer_done(e.slot)  # the transfer can no longer touch the slot
                if self._entries.get(e.key) is not e:
                    continue  # abandoned by a deadline, or dropped by a reset: its slot was released
                if f.kind == LOAD:
                    if good:
                        e.state = READY
                    else:
                        missed.append(e.key)
                        self._drop(e)
                        continue
                else:
                    e.state = READY  # stored (or not: a failed put is a future MISS); bytes still valid
                    if good:
                        self._put_recently[e.key] = None
                        self._put_recently.move_to_end(e.key)
                        if len(self._put_recently) > PUT_RECENTLY_MAX:
                            self._put_recently.popitem(last=False)
                self._maybe_drop(e)
            if missed:
                self._lookup.mark_miss(missed)
                for key in missed:
                    self._put_recently.pop(key, None)

    # ---------------------------------------------------------------------------------------------
    # Entries and references
    # ---------------------------------------------------------------------------------------------

    def _ref(self, e: _Entry, rid: str) -> None:
        if rid not in e.refs:
            e.refs.add(rid)
            self._req_refs.setdefault(rid, set()).add(e.key)

    def _unref(self, rid: str, keep: set[bytes] = frozenset(), only: set[bytes] | None = None) -> None:
        keys = self._req_refs.get(rid)
        if not keys:
            return
        for key in list(keys if only is None else keys & only):
            if key in keep:
                continue
            keys.discard(key)
            e = self._entries.get(key)
            if e is not None:
                e.refs.discard(rid)
                self._maybe_drop(e)
        if not keys:
            self._req_refs.pop(rid, None)

    def _maybe_drop(self, e: _Entry) -> None:
        if e.state == FILLING and not e.refs and not e.pins:
            self._abandon(e)  # nobody waits for it any more
        elif e.state == READY and not e.refs and not e.pins:
            self._drop(e)

    def _drop(self, e: _Entry) -> None:
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        self.slots.release(e.slot)  # free now, or when its transfer returns (quarantine)

    def _abandon(self, e: _Entry) -> None:
        self._drop(e)
        self._lookup.mark_miss([e.key])
        self._put_recently.pop(e.key, None)

    # ---------------------------------------------------------------------------------------------
    # Step hooks and requests
    # ---------------------------------------------------------------------------------------------

    def on_new_request(self, req_context):
        return compat.RequestOffloadingContext()

    def on_schedule_end(self, context) -> None:
        self._drain()
        self._lookup.flush()
        if self._prefetch_queue:
            queued, self._prefetch_queue = self._prefetch_queue, []
            live = [e for e in queued if self._entries.get(e.key) is e and e.state == FILLING]
            if live:
                self._submit(LOAD, live, self._prefetch_task)
        # A request whose lookups this step were all final has been answered: what it did not
        # pin with prepare_load (staged past its prefix, or a prefix under one chunk) is released.
        for rid in self._looked_up - self._retrying:
            self._unref(rid, keep=self._pinned_keys(rid))
        self._looked_up.clear()
        self._retrying.clear()
        self._probing.clear()
        self._advance_fence()
        self._report_staging()
        if self._step_yield_s and (self._lookup.probing() or self._pool.loading()):
            # As in the tier (memkv_vllm.tier.on_schedule_end): a scheduler stepping in pure Python
            # keeps the GIL from the lookup and transfer threads; sleeping releases it.
            time.sleep(self._step_yield_s)

    def _pinned_keys(self, rid: str) -> set[bytes]:
        return {k for job in self._loads.get(rid, ()) for k in job}

    def on_request_finished(self, req_context) -> None:
        rid = req_context.req_id
        self._lookup.cleanup(rid)
        self._cut.discard(rid)
        self._unref(rid, keep=self._pinned_keys(rid))  # a load in flight keeps its pins and refs

    def has_pending_work(self) -> bool:
        # Quarantined slots do not count: nobody waits for them, the next drain frees them.
        return bool(self._pool.busy() or self._lookup.pending() or self._prefetch_queue or self._fence)

    def reset_cache(self) -> None:
        """Forget every request's state. Jobs in flight at the reset are flushed to the workers
        and their reports ignored, so their slots (stores being written, loads pinned) are fenced:
        0.33 frees them at on_reset_flushed; earlier releases after RESET_FENCE_STEPS steps
        (the flush runs in the workers' next step, whose report arrives before the one after)."""
        fenced = []
        for e in list(self._entries.values()):
            e.refs.clear()
            if e.state == WRITING or e.pins:
                del self._entries[e.key]
                fenced.append(e)
            else:
                self._maybe_drop(e)
        self._req_refs.clear()
        self._loads.clear()
        self._cut.clear()
        if fenced:
            self._fence.append((RESET_FENCE_STEPS, fenced))

    def on_reset_flushed(self) -> None:  # 0.33
        for _, fenced in self._fence:
            for e in fenced:
                self.slots.release(e.slot)
        self._fence.clear()

    def _advance_fence(self) -> None:
        if not self._fence:
            return
        keep = []
        for steps, fenced in self._fence:
            if steps <= 1:
                for e in fenced:
                    self.slots.release(e.slot)
            else:
                keep.append((steps - 1, fenced))
        self._fence = keep

    # ---------------------------------------------------------------------------------------------
    # Metrics and lifecycle
    # ---------------------------------------------------------------------------------------------

    def _report_staging(self) -> None:
        load = store = 0
        for e in self._entries.values():
            if e.state in (FILLING, READY):
                load += 1
            else:
                store += 1
        slot = self.layout.slot_bytes
        self.stats.gauge(tm.STAGING_BYTES, load * slot, ("load",))
        self.stats.gauge(tm.STAGING_BYTES, store * slot, ("store",))
        self.stats.gauge(tm.STAGING_BYTES, self.slots.quarantined * slot, ("quarantine",))

    def get_stats(self):
        return self.stats.take()

    def config_info(self) -> list[dict[str, Any]]:  # 0.33 info metric
        return [{
            "memkv_mode": "direct",
            "memkv_servers": ",".join(a.name for a in self.client.servers()),
            "memkv_prefix": self.settings.prefix,
            "memkv_staging_mb": str(self.settings.staging_mb),
        }]

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._lookup.shutdown()
        if self._pool is not None:
            self._pool.shutdown()
        self.client.close()
        self._flat = None
        if self._region is not None:
            self._region.close()  # unlinks the file; workers' mappings stay valid until they close


# -------------------------------------------------------------------------------------------------
# load_guarantee "leased" (opt-in)
# -------------------------------------------------------------------------------------------------


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


class LeasedDirectManager(MemKVDirectManager):
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
    this side moves no value bytes. Threading as the base class: every public method on the
    scheduler thread; lease renewals and releases run on one control thread (`_ctl`) that
    touches only the client."""

    def _open_lookup(self) -> LookupService:
        import queue

        self._orphans: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        ttl = self.settings.lease_ttl_s
        return LookupService(lambda: ChunkLeaseProber(self.client, self.keys, ttl, self._orphans),
                             self.settings.deadline_s,
                             on_timeout=lambda n: self.stats.count(tm.LOOKUPS, n, ("timeout",)))

    def __init__(self, spec, settings: DirectSettings, layout: StagingLayout) -> None:
        import concurrent.futures

        super().__init__(spec, settings, layout)
        self._held: dict[bytes, _Held] = {}
        self._storing: set[bytes] = set()
        self._lease_fence: list[tuple[int, list[bytes]]] = []
        self._lookup_times: dict[str, tuple[float, int]] = {}  # timing log only: first lookup, calls
        self._ctl = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memkv-direct-lease")
        self._ctl_futures: list = []  # scheduler-owned; each future is completed by the control thread
        self._renew_every_s = settings.lease_ttl_s / 3
        self._check_lease_ttl()

    def _check_lease_ttl(self) -> None:
        """Every node must speak LEASE and grant our ttl: a node that caps it lower would let
        leases lapse between renewals."""
        probe = self.keys.config_key
        for server in self.client.servers():
            try:
                reply = self.client.lease_on(server, [probe], self.settings.lease_ttl_s)
            except MemKVError as exc:
                raise DirectStartupError(
                    f"MemKV direct mode cannot start: server {server.name} did not answer LEASE ({exc}); "
                    f"load_guarantee \"leased\" needs nodes of memkv >= this version, or use \"staged\"") from exc
            granted_s = reply.ttl_ms / 1000.0
            if granted_s < self.settings.lease_ttl_s:
                self._renew_every_s = min(self._renew_every_s, granted_s / 3)
                log.warning("MemKV direct mode: server %s caps leases at %.1fs (--max-lease-ttl), below "
                            "memkv.lease_ttl_s=%.1fs: renewing every %.1fs", server.name, granted_s,
                            self.settings.lease_ttl_s, self._renew_every_s)
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
            timing.debug("request %s: load of %d leased chunk(s) prepared %.3f s after its first lookup "
                         "(%d lookup call(s))", rid, len(keys), time.perf_counter() - first, calls)
        return MemKVLoadStoreSpec([], keys=[self.keys.chunk_prefix(k) for k in keys])

    def complete_load(self, keys, req_context) -> None:
        rid = req_context.req_id
        keyset = self._pop_load(rid, keys)
        if keyset is None:
            return
        for key in keyset:
            h = self._held.get(key)
            if h is not None and h.pins:
                h.pins -= 1
        self.stats.count(tm.LOAD_BYTES, self.layout.value_bytes * self.layout.world_size * len(keyset))
        self._unref(rid, only=keyset)

    # -- references -------------------------------------------------------------------------------

    def _unref(self, rid: str, keep: set[bytes] = frozenset(), only: set[bytes] | None = None) -> None:
        keys = self._req_refs.get(rid)
        if not keys:
            return
        gone = []
        for key in list(keys if only is None else keys & only):
            if key in keep:
                continue
            keys.discard(key)
            h = self._held.get(key)
            if h is not None:
                h.refs.discard(rid)
                if not h.refs and not h.pins:
                    del self._held[key]
                    gone.append(key)
        if not keys:
            self._req_refs.pop(rid, None)
        self._release_chunks(gone)

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
                log.warning("MemKV direct mode: %d of %d lease renewal(s) failed (node unreachable or restarted); "
                            "a load of those chunks retries for load_retry_s, then fails loudly", len(lost), len(ok))

        self._control(renew)

    # -- stores -----------------------------------------------------------------------------------

    def prepare_store(self, keys, req_context):
        keys = list(keys)  # prompt order
        todo = [k for k in keys if k not in self._held and k not in self._storing]
        self._storing.update(todo)
        return PrepareStoreOutput(keys_to_store=todo,
                                  store_spec=MemKVLoadStoreSpec([], keys=[self.keys.chunk_prefix(k) for k in todo]),
                                  evicted_keys=[])

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
        for rid in self._looked_up - self._retrying:
            self._unref(rid, keep=self._pinned_keys(rid))
        self._looked_up.clear()
        self._retrying.clear()
        self._probing.clear()
        self._advance_lease_fence()
        self._renew()
        self.stats.gauge(tm.LEASED_BYTES, len(self._held) * self.layout.value_bytes * self.layout.world_size)
        # Also while a leased load streams, at TP=1 only: then the worker's fetch and copy threads
        # share this process (and its GIL) with the scheduler loop, which spins while the request
        # waits; at TP > 1 they run in the worker processes and a sleep here would buy nothing.
        loads_here = bool(self._loads) and self.layout.world_size == 1
        if self._step_yield_s and (self._lookup.probing() or loads_here):
            time.sleep(self._step_yield_s)

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
        return bool(self._lookup.pending() or self._storing or self._lease_fence
                    or any(not f.done() for f in self._ctl_futures) or any(h.pins for h in self._held.values()))

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

    def config_info(self) -> list[dict[str, Any]]:  # 0.33 info metric
        info = super().config_info()
        info[0]["memkv_mode"] = "direct-leased"
        return info

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        held = [vk for k in self._held for vk in self.keys.value_keys(k)]
        self._held.clear()
        if held:
            try:
                self._ctl.submit(self.client.release, held, timeout_s=1.0).result(timeout=5.0)
            except Exception:  # best effort: the leases expire by themselves
                pass
        self._ctl.shutdown(wait=False)
        super().shutdown()
