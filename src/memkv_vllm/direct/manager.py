"""`MemKVDirectManager`: the scheduler side of direct mode with load_guarantee "staged".

MemKV is the offload medium. Its sibling for "leased" is leased.py; what both share (startup,
request bookkeeping) is base.py.

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

from vllm.v1.kv_offload.base import PrepareStoreOutput

from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm.direct.base import RESET_FENCE_STEPS, DirectManagerBase, log
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.layout import MemKVLoadStoreSpec, StagingLayout
from memkv_vllm.transfers import LOAD, STORE, TaskResult, TransferPool

FILLING, READY, WRITING, PUTTING = "filling", "ready", "writing", "putting"
PUT_RECENTLY_MAX = 1 << 16  # keys this engine stored, answered without a probe (a prefetch still verifies)


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


class MemKVDirectManager(DirectManagerBase):
    """Direct mode with load_guarantee "staged" (the module docstring)."""

    def __init__(self, spec, settings: DirectSettings, layout: StagingLayout) -> None:
        super().__init__(spec, settings, layout)
        self._entries: dict[bytes, _Entry] = {}
        self._cut: set[str] = set()  # requests whose later store jobs are shed
        self._prefetch_queue: list[_Entry] = []
        self._jobs: dict[int, list[_Entry]] = {}
        self._job_ids = 0
        self._put_recently: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # bounded
        self._probing: set[str] = set()  # requests with a chunk whose exists probe is unanswered this step
        self._fence: list[tuple[int, list[_Entry]]] = []  # (steps left, entries) after reset_cache
        # Grace 0: a failed prefetch is reported at once (its lookup answers MISS now); what may
        # still land late is handled per slot here (_late), not by withholding the result.
        self._pool = TransferPool(
            settings.n_read_threads, settings.n_write_threads, 0.0, store_nice=settings.store_nice
        )
        self._late: list[tuple[float, int]] = []  # (release time, slot): failed RDMA prefetches
        self._lookup = self._lookup_service(self.client.exists_stream, store_keys=self.keys.probe_keys)
        self._started(spec)

    def _reuse_summary(self) -> str:
        return f"at most {self.layout.staged_prompt_tokens} tokens of a prompt"

    def _warn_limits(self, spec) -> None:
        layout, st = self.layout, self.settings
        if layout.staged_prompt_tokens < layout.max_model_len:
            mib_per_1k = -(-layout.slot_bytes * layout.num_groups * 1024 // max(1, layout.tokens_per_chunk)) / (1 << 20)
            log.warning(
                'MemKV direct mode: load_guarantee "staged" with memkv.staging_mb %d reuses at most %d of '
                "max_model_len %d tokens of a prompt; the rest of a longer prompt is recomputed. Raise "
                'staging_mb (%.0f MiB per 1k tokens) or use "leased" (the default from vLLM 0.34)',
                st.staging_mb,
                layout.staged_prompt_tokens,
                layout.max_model_len,
                mib_per_1k,
            )

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
                    log.warning(
                        "MemKV direct mode: prefetch unanswered after %.1fs: answering MISS "
                        "(lookup_timeout_s); its staging slot stays quarantined until the transfer ends",
                        self._clock() - e.started,
                    )
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
                raise AssertionError(
                    f"MemKV direct mode: prepare_load of a chunk that is not staged "
                    f"({None if e is None else e.state}); this is a bug"
                )
            e.pins += 1
            self._ref(e, rid)
            slots.append(e.slot)
        self._loads.setdefault(rid, []).append(keys)
        loading = set(keys)
        self._unref(rid, keep=loading)  # staged past the loaded prefix: not needed any more
        return MemKVLoadStoreSpec(slots)

    def _held_entry(self, key: bytes) -> _Entry | None:
        return self._entries.get(key)

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
            log.warning(
                "MemKV direct mode: a store job of %s needs more staging than memkv.staging_mb (%d MiB) "
                "holds; kept its first %d chunk(s), shed %d and the rest of the request. Raise "
                'staging_mb, lower max_num_batched_tokens, or set memkv.load_guarantee "leased" (any '
                "prompt length through the same region; docs/direct-mode.md, 'Two load guarantees').",
                rid,
                self.settings.staging_mb,
                fit,
                shed,
            )
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
            for i in range(len(entries)):
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

    def _unreferenced(self, entries: list[tuple[bytes, _Entry]]) -> None:
        for _, e in entries:
            self._maybe_drop(e)

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

    def on_schedule_end(self, context) -> None:
        self._drain()
        self._lookup.flush()
        if self._prefetch_queue:
            queued, self._prefetch_queue = self._prefetch_queue, []
            live = [e for e in queued if self._entries.get(e.key) is e and e.state == FILLING]
            if live:
                self._submit(LOAD, live, self._prefetch_task)
        self._release_answered()
        self._probing.clear()
        self._advance_fence()
        self._report_staging()
        # As in the tier: the lookup and prefetch threads get the GIL promptly (gil.py).
        self._gil.hold(self._lookup.probing() or self._pool.loading())

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

    def _stop(self) -> None:
        self._pool.shutdown()
