"""`MemKVDirectWorker`: the worker side of direct mode.

load_guarantee "leased" (the default from vLLM 0.34): the worker moves its own rank's values
itself, streaming them through its ring of staging slots (memkv_vllm.direct.streaming): a load
job fetches each chunk's value (leased by the scheduler at lookup, verified by the client;
`n_read_threads` fetch threads) and copies it to the GPU blocks; a store job copies GPU blocks
into slots and puts them (`n_write_threads` put threads). A job of any length fits. A load that
cannot complete (value lost, node gone, corrupt after load_retry_s) is reported as failed where
vLLM takes it (0.34+: the request recomputes); before 0.34 it stops the engine (LoadFailed).

load_guarantee "staged": copies only, never the network. A store job copies this rank's GPU
blocks of each chunk into this rank's section of the chunk's staging slot; a load job copies
them back. The scheduler-side manager does every MemKV transfer (memkv_vllm.direct.manager), so
a load job's bytes are already in staging and verified when the job arrives: a copy between two
memories cannot fail, which is what vLLM's worker requires before 0.34 (it asserts `success`).

A job's GPU blocks arrive as a GPULoadStoreSpec (block ids; vLLM <= 0.33) or as DevicePointers
(0.34+); compat.gpu_blocks turns either into block ids of the worker's CanonicalKVCaches.

Byte order of one rank's section (one chunk of KV group g): layer-major. For the group's
layer refs 0..L-1 with page sizes p_i, ref i's `blocks_per_chunk` pages are contiguous at
`blocks_per_chunk * sum(p_0..p_{i-1})`, sub-block j at `+ j * p_i`. A job's GPU blocks map to
(chunk, sub-block) by vLLM's rule (vllm-spec-api.md 5.3): per group, `skip = block_indices[g]
% blocks_per_chunk`, GPU block j is sub-block `(skip + j) % bpc` of the group's chunk
`(skip + j) // bpc`, and the group consumes `ceil((n + skip) / bpc)` of the job's slots.

GPU ordering: a job's copies run on this worker's side stream, which first waits on the
stream that was current at submit (the compute that wrote a store's blocks; pending zeroing of
blocks re-allocated to a load). A batch of chunks moves through the stream's GPU scratch
(copies.SectionCopier, `copy_scratch_mb`): one host <-> GPU copy per chunk, one gather/scatter
per KV tensor; or, with `copy_method` "pieces", as one piece per run, all issued by one call into
C without the GIL (copies.PieceCopier): one cudaMemcpyBatchAsync where the runtime has it, else a
cudaMemcpyAsync per piece. "leased": a batch (every fetched chunk that is ready, or one gather of up to
`blocks_per_op`) is queued on the direction's side stream at once and waited for with one
event. CPU tensors (the conformance suite) copy synchronously, through the same batches.
The staging region is mapped and host-registered with CUDA (pinned) once, in get_worker.

Threading: every method is called by the worker's connector on one thread; "leased" jobs run on
the StreamingTransfers threads, which only touch the job's GPU blocks and their own ring slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from memkv_vllm import compat
from memkv_vllm.direct.config import PIECES, DirectSettings
from memkv_vllm.direct.copies import (
    PieceCopier,
    PiecesUnavailable,
    RunArray,
    SectionCopier,
    as_tuples,
    chunk_runs,
    copy_runs,
    run_bytes,
)
from memkv_vllm.direct.layout import StagingLayout
from memkv_vllm.direct.staging import StagingRegion
from memkv_vllm.direct.streaming import Chunk, Job, LoadFailed, StreamingTransfers

WAIT_MARGIN_S = 60.0  # wait() on a leased load: load_retry_s per batch plus this, then fail loudly

log = logging.getLogger("vllm.memkv_vllm.direct")


class MemKVDirectWorker(OffloadingWorker):
    def __init__(self, kv_caches, layout: StagingLayout, settings: DirectSettings | None = None) -> None:
        self.layout = layout
        self.settings = settings or DirectSettings()
        self._kv_caches = kv_caches
        self._report_failures = compat.load_failure_reportable()
        if self._report_failures and compat.load_failure_policy() == "fail":
            log.warning(
                "MemKV direct mode: kv_load_failure_policy is 'fail' (vLLM's default): a load MemKV cannot "
                "complete (a node lost between lookup and load) ends that request with an error; set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute it instead '
                "(docs/direct-mode.md)"
            )
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._groups: list[list[tuple[int, int, int]]] = []  # per group: (tensor idx, page bytes, offset)
        bpc = layout.blocks_per_chunk
        for g, refs in enumerate(kv_caches.group_data_refs):
            entries, offset = [], 0
            for ref in refs:
                entries.append((ref.tensor_idx, ref.page_size_bytes, offset))
                offset += ref.page_size_bytes * bpc
            if offset > layout.value_bytes:
                raise RuntimeError(
                    f"MemKV direct mode: KV group {g} holds {offset} bytes per chunk on rank "
                    f"{layout.rank} but the spec sized values at {layout.value_bytes} bytes"
                )
            self._groups.append(entries)
        self._cuda = any(t.is_cuda for t in self._tensors)
        self._pages = sorted({page for entries in self._groups for _, page, _ in entries})
        self._copiers: dict[str, SectionCopier] = {}  # per copy stream: "staged", "load", "store"
        self._region: StagingRegion | None = None
        self._staging: torch.Tensor | None = None
        self._registered = False
        self._stream = None
        self._pending: dict[int, tuple[object, int, float]] = {}  # job -> (end event, bytes, start)
        self._done: list[TransferResult] = []
        self._stage()  # map and pin at engine startup, not in a request's first transfer
        self._pieces = self._piece_copier() if self.settings.copy_method == PIECES else None
        self._streams: StreamingTransfers | None = None
        self._jobs: dict[int, Job] = {}  # leased jobs not reported yet
        if self.settings.leased:
            self._start_streaming()

    # -- load_guarantee "leased" ------------------------------------------------------------------

    def _start_streaming(self) -> None:
        from memkv import Client, ClientConfig

        client = Client(ClientConfig.from_env())  # connects at the first transfer
        try:
            client.register_pool(self._region.view)  # RDMA: nodes WRITE fetches into the ring
        except Exception:
            client.close()
            raise
        self._client = client
        device = self._tensors[0].device if self._cuda else None
        if self._cuda:
            self._load_stream = torch.cuda.Stream(device=device)
            self._store_stream = torch.cuda.Stream(device=device)

        def on_thread_start() -> None:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread

        layout = self.layout
        flat = self._region.view

        def section(slot: int) -> memoryview:
            start = layout.section_offset(slot, layout.rank)
            return flat[start : start + layout.value_bytes]

        st = self.settings
        self._streams = StreamingTransfers(
            client,
            layout.rank,
            section,
            layout.num_slots,
            self._copy_batch,
            st.blocks_per_op,
            st.load_retry_s,
            st.load_failure_grace_s,
            on_thread_start,
            fetch_threads=st.n_read_threads,
            put_threads=st.n_write_threads,
            put_nice=st.store_nice,
        )
        log.info(
            "MemKV direct mode: rank %d streams through %d load + %d store slot(s): %d fetch thread(s) of "
            "%d chunk(s), %d put thread(s) of %d chunk(s)",
            layout.rank,
            self._streams.load_ring.size,
            self._streams.store_ring.size,
            self._streams.n_fetch,
            self._streams.load_batch,
            self._streams.n_put,
            self._streams.store_batch,
        )

    def _copy_batch(self, items: list[tuple[Job, Chunk, int]], to_staging: bool) -> Callable[[], None] | None:
        """Every (job, chunk, slot) of `items` between the chunk's GPU blocks and the slot. On
        CUDA: queued together on this direction's side stream, after the compute that was
        current when each job was submitted; returns a function that waits for them (one event;
        the slots are reused after it). On CPU: copied, returns None."""
        rank = self.layout.rank
        sections = [(self.layout.section_offset(slot, rank), chunk.runs) for _, chunk, slot in items]
        direction = "store" if to_staging else "load"
        if not self._cuda:
            self._copy(direction, sections, to_staging, non_blocking=False)
            return None
        stream = self._store_stream if to_staging else self._load_stream
        waited: set[int] = set()
        for job, _, _ in items:
            if job.event is not None and id(job) not in waited:
                stream.wait_event(job.event)
                waited.add(id(job))
        with torch.cuda.stream(stream):
            self._copy(direction, sections, to_staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done.synchronize

    def _submit_streaming(self, job_id: int, gpu_spec, keys: list[bytes], load: bool) -> bool:
        chunks_runs = self._chunk_runs(gpu_spec, len(keys))
        suffix = b"/r%d" % self.layout.rank
        chunks = [Chunk(k + suffix, runs) for k, runs in zip(keys, chunks_runs)]
        nbytes = sum(run_bytes(runs) for runs in chunks_runs)
        if not chunks:
            self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        job = Job(job_id, load, chunks, event, nbytes)
        self._jobs[job_id] = job
        assert self._streams is not None
        self._streams.submit(job)
        return True

    def _collect_streaming(self) -> list[TransferResult]:
        if self._streams is None:
            return []
        out = []
        for job in self._streams.take_done():
            self._jobs.pop(job.job_id, None)
            if job.error is not None:
                if not self._report_failures:
                    raise LoadFailed(job.error)
                # Nothing of the failed chunk reached the GPU. A failed load: vLLM recomputes the
                # request (kv_load_failure_policy "recompute") or ends it with an error ("fail").
                log.warning("%s; reported to vLLM as a failed job", job.error)
                out.append(TransferResult(job.job_id, False, 0, time.perf_counter() - job.started))
                continue
            if job.shed or job.failed_puts:
                log.warning(
                    "MemKV direct mode: store job %d: %d chunk(s) shed by wait(), %d put(s) failed: "
                    "those chunks will be a MISS",
                    job.job_id,
                    job.shed,
                    job.failed_puts,
                )
            out.append(TransferResult(job.job_id, True, job.nbytes, time.perf_counter() - job.started))
        return out

    # -- the staging region ---------------------------------------------------------------------

    def _stage(self) -> torch.Tensor:
        if self._staging is None:
            self._region = StagingRegion.open_or_create(self.layout.path, self.layout.region_bytes, owner=True)
            self._staging = torch.frombuffer(self._region.view, dtype=torch.int8)
            if self._cuda:
                rc = torch.cuda.cudart().cudaHostRegister(self._staging.data_ptr(), self.layout.region_bytes, 0)
                if rc.value != 0:  # as vLLM's CPU spec does: go on, unpinned (slower, synchronous copies)
                    log.warning(
                        "MemKV direct mode: cudaHostRegister of the %d MiB staging region failed (%s); "
                        "copies go unpinned",
                        self.layout.region_bytes >> 20,
                        rc,
                    )
                else:
                    self._registered = True
                self._stream = torch.cuda.Stream()
        return self._staging

    # -- jobs -------------------------------------------------------------------------------------

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        if dst_spec.keys is not None:
            return self._submit_streaming(job_id, src_spec, dst_spec.keys, load=False)
        return self._run(job_id, src_spec, dst_spec.slots, to_staging=True)

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        if src_spec.keys is not None:
            return self._submit_streaming(job_id, dst_spec, src_spec.keys, load=True)
        return self._run(job_id, dst_spec, src_spec.slots, to_staging=False)

    def _run(self, job_id: int, gpu_spec, slots: list[int], to_staging: bool) -> bool:
        start = time.perf_counter()
        rank = self.layout.rank
        sections = [
            (self.layout.section_offset(slot, rank), runs)
            for slot, runs in zip(slots, self._chunk_runs(gpu_spec, len(slots)))
            if len(runs)
        ]
        nbytes = sum(run_bytes(runs) for _, runs in sections)
        if not sections:
            self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        self._stage()
        if self._cuda:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())  # after the compute of this step
            with torch.cuda.stream(stream):
                self._copy("staged", sections, to_staging, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self._pending[job_id] = (event, nbytes, start)
        else:
            self._copy("staged", sections, to_staging, non_blocking=False)
            self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def _chunk_runs(self, gpu_spec, n_chunks: int) -> list[RunArray]:
        """Per chunk of the job, its runs (copies.chunk_runs), offsets inside the rank's section."""
        blocks = compat.gpu_blocks(gpu_spec, self._kv_caches)
        return chunk_runs(
            blocks.block_ids,
            blocks.group_sizes,
            blocks.block_indices,
            self._groups,
            self.layout.blocks_per_chunk,
            n_chunks,
        )

    def _copy(self, stream: str, sections: list[tuple[int, RunArray]], to_staging: bool, non_blocking: bool) -> None:
        """Every run of `sections` ((staging offset of a chunk's section, its runs)); on CUDA
        queued on the current stream. As pieces in one call (copy_method "pieces"), else through
        the copy stream's SectionCopier (copies.py says why), or one copy_ per run with
        copy_scratch_mb 0."""
        staging = self._staging
        assert staging is not None
        if self._pieces is not None:
            self._pieces.copy(sections, to_staging, non_blocking)
            return
        scratch = self.settings.copy_scratch_bytes
        tuples = [(base, as_tuples(runs)) for base, runs in sections]  # the copiers below loop in Python
        if scratch == 0:
            copy_runs(
                self._tensors,
                staging,
                [(t, b, n, p, base + off) for base, runs in tuples for t, b, n, p, off in runs],
                to_staging,
                non_blocking,
            )
            return
        copier = self._copiers.get(stream)
        if copier is None:
            # Never more chunks than staging holds: no batch can be larger.
            chunks = max(1, min(scratch // self.layout.value_bytes, self.layout.num_slots))
            copier = self._copiers[stream] = SectionCopier(
                self._tensors, staging, self.layout.value_bytes, chunks, self._pages
            )
            log.info(
                "MemKV direct mode: rank %d copies %s chunks through %d MiB of %s scratch (%d chunk(s) at a "
                "time; memkv.copy_scratch_mb)",
                self.layout.rank,
                stream,
                copier.scratch_bytes >> 20,
                copier.device.type,
                copier.scratch_chunks,
            )
        copier.copy(tuples, to_staging, non_blocking)

    def _piece_copier(self) -> PieceCopier | None:
        """copy_method "pieces": the PieceCopier; None (said once, at startup) where it cannot run,
        and the worker copies through the scratch ("scratch") instead."""
        assert self._staging is not None
        try:
            copier = PieceCopier(self._tensors, self._staging)
        except PiecesUnavailable as exc:
            log.warning(
                'MemKV direct mode: rank %d: memkv.copy_method "pieces" cannot run here (%s); copies go '
                'through the scratch ("scratch")',
                self.layout.rank,
                exc,
            )
            return None
        log.info(
            "MemKV direct mode: rank %d copies chunks as pieces, one call per batch (memkv.copy_method): %s",
            self.layout.rank,
            "one cudaMemcpyBatchAsync" if copier.batched else "a copy per piece",
        )
        return copier

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        done += self._collect_streaming()  # raises LoadFailed: the engine stops, loudly
        for job_id in [j for j, (event, _, _) in self._pending.items() if event.query()]:
            _, nbytes, start = self._pending.pop(job_id)
            done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return done

    def wait(self, job_ids) -> None:
        """Blocks until those jobs no longer touch their GPU blocks. "staged": a GPU<->host copy,
        never the network. "leased": a load until it is loaded or failed (a failure: LoadFailed before
        vLLM 0.34; from 0.34 get_finished reports it); a store stops copying (its remaining chunks
        are shed) and returns after the copy in progress."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                if job.load:
                    bound = self.settings.load_retry_s * (1 + len(job.chunks)) + WAIT_MARGIN_S
                    if not job.done.wait(bound):
                        raise LoadFailed(
                            f"MemKV direct mode: rank {self.layout.rank}: load job {job_id} not done "
                            f"within {bound:.0f}s"
                        )
                    if job.error is not None and not self._report_failures:
                        raise LoadFailed(job.error)  # 0.34+: get_finished reports it as failed
                else:
                    job.cancelled = True
                    if not job.copies_done.wait(WAIT_MARGIN_S):
                        raise RuntimeError(
                            f"MemKV direct mode: rank {self.layout.rank}: store job {job_id} still "
                            f"copying after {WAIT_MARGIN_S:.0f}s"
                        )
                continue
            pending = self._pending.get(job_id)
            if pending is not None:
                pending[0].synchronize()

    def shutdown(self) -> None:
        if self._streams is not None:
            self._streams.shutdown()
            self._streams = None
            self._client.close()
        if self._stream is not None:
            self._stream.synchronize()
        if self._staging is not None:
            if self._registered:
                torch.cuda.cudart().cudaHostUnregister(self._staging.data_ptr())
                self._registered = False
            self._staging = None
        if self._region is not None:
            self._region.close()
            self._region = None
