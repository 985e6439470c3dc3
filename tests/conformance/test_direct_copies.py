"""Direct mode's staging <-> KV copies: `SectionCopier` (the worker's, through a scratch) and
`PieceCopier` (copy_method "pieces": one call into C per batch) move exactly the bytes the
reference per-run loop `copy_runs` moves, in both directions, for any runs
the worker builds: consecutive or scattered GPU blocks, several page sizes (an unaligned run takes
the copier's per-run path), KV rows wider than a page, batches larger than the scratch, and
sections that leave bytes uncovered (a store writes each run's bytes exactly and nothing outside
the sections' value bytes). CPU tensors stand in for the GPU, as in the rest of the suite."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memkv_vllm import _copy_pieces
from memkv_vllm.direct.copies import (
    CudaRuntime,
    PieceCopier,
    PiecesUnavailable,
    SectionCopier,
    chunk_runs,
    copy_runs,
    run_bytes,
)

pytestmark = pytest.mark.conformance

NUM_BLOCKS = 12


@st.composite
def layouts(draw):
    """KV tensors, a staging buffer of sections and per-section runs, as worker._chunk_runs builds
    them: each section holds, per tensor, `bpc` pages; a chunk's GPU blocks are distinct."""
    pages = draw(st.lists(st.sampled_from([8, 16, 24, 64]), min_size=1, max_size=4))
    widths = [p + draw(st.sampled_from([0, 0, 8])) for p in pages]  # a row may be wider than its page
    bpc = draw(st.integers(1, 3))
    n_chunks = draw(st.integers(1, 5))
    value_bytes = bpc * sum(pages) + draw(st.sampled_from([0, 8, 40]))  # padding after the last tensor
    gap = draw(st.sampled_from([0, 8, 4096 - 8]))  # section stride beyond value_bytes (other ranks, rounding)
    order = draw(st.permutations(range(NUM_BLOCKS)))
    sections, used = [], 0
    for c in range(n_chunks):
        base = c * (value_bytes + gap)
        subs = sorted(draw(st.sets(st.integers(0, bpc - 1), min_size=1, max_size=bpc)))
        runs, offset = [], 0
        for t, page in enumerate(pages):
            for sub in subs:
                block = order[(c * bpc + sub) % NUM_BLOCKS]
                runs.append((t, block, 1, page, offset + sub * page))
            offset += bpc * page
        sections.append((base, runs))
        used = base + value_bytes
    return pages, widths, value_bytes, sections, used


def _tensors(widths, gen):
    return [torch.randint(-128, 127, (NUM_BLOCKS, w), dtype=torch.int8, generator=gen) for w in widths]


def _absolute(sections):
    return [(t, b, n, p, base + off) for base, runs in sections for t, b, n, p, off in runs]


@st.composite
def jobs(draw):
    """A job's GPU blocks as vLLM hands them over: per KV group a prompt position and blocks that
    are partly consecutive (as vLLM's allocator often leaves them), partly scattered."""
    bpc = draw(st.integers(1, 4))
    groups, block_ids, sizes, indices = [], [], [], []
    for _ in range(draw(st.integers(1, 3))):
        pages = draw(st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=3))
        entries, offset = [], 0
        for page in pages:
            entries.append((draw(st.integers(0, 5)), page, offset))
            offset += bpc * page
        groups.append(entries)
        n = draw(st.integers(0, 9))
        ids: list[int] = []
        while len(ids) < n:
            start, length = draw(st.integers(0, 200)), draw(st.integers(1, 4))
            ids += range(start, start + length)
        block_ids += ids[:n]
        sizes.append(n)
        indices.append(draw(st.integers(0, 50)))
    n_chunks = sum(-(-(n + i % bpc) // bpc) for n, i in zip(sizes, indices) if n)
    return bpc, groups, block_ids, sizes, indices, n_chunks


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_chunk_runs_place_every_block_where_vllms_rule_puts_it(job):
    """Each GPU block of group g at position j is sub-block (skip + j) % bpc of the group's chunk
    (skip + j) // bpc, one page per layer; consecutive blocks of one chunk are one run."""
    bpc, groups, block_ids, sizes, indices, n_chunks = job
    expected: list[set] = [set() for _ in range(n_chunks)]
    expected_runs = 0
    pos = key = 0
    for g, n in enumerate(sizes):
        skip = indices[g] % bpc
        for j in range(n):
            chunk, sub = divmod(skip + j, bpc)
            block = block_ids[pos + j]
            if j == 0 or sub == 0 or block != block_ids[pos + j - 1] + 1:
                expected_runs += len(groups[g])
            for t, page, offset in groups[g]:
                expected[key + chunk].add((t, block, page, offset + sub * page))
        pos += n
        key += -(-(n + skip) // bpc) if n else 0
    got = chunk_runs(block_ids, sizes, indices, groups, bpc, n_chunks)
    assert len(got) == n_chunks
    assert sum(len(runs) for runs in got) == expected_runs
    for chunk, runs in enumerate(got):
        assert runs.dtype == np.int64 and runs.shape[1:] == (5,)
        blocks = [(t, b + i, p, o + i * p) for t, b, n, p, o in runs.tolist() for i in range(n)]
        assert len(blocks) == len(set(blocks)) and set(blocks) == expected[chunk]
        assert run_bytes(runs) == sum(p for _, _, p, _ in blocks)


def test_chunk_runs_refuse_a_job_whose_blocks_do_not_cover_its_chunks():
    groups = [[(0, 16, 0)]]
    with pytest.raises(AssertionError, match="cover more"):
        chunk_runs([1, 2, 3], [3], [0], groups, 2, 1)
    with pytest.raises(AssertionError, match="cover 2"):
        chunk_runs([1, 2, 3], [3], [0], groups, 2, 3)


def test_pieces_take_run_arrays_and_leave_them_as_they_are():
    """The worker hands PieceCopier each chunk's run array; the section offsets are added to a
    copy, so a chunk retried in another slot still holds its own offsets."""
    gen = torch.Generator().manual_seed(3)
    kv = _tensors([16], gen)
    runs = chunk_runs([4, 5, 9], [3], [0], [[(0, 16, 0)]], 4, 1)[0]
    before = runs.copy()
    staging = torch.zeros(256, dtype=torch.int8)
    PieceCopier(kv, staging).copy([(64, runs)], True, False)
    assert (runs == before).all()
    want = torch.zeros(256, dtype=torch.int8)
    copy_runs(kv, want, [(t, b, n, p, 64 + o) for t, b, n, p, o in runs.tolist()], True, False)
    assert torch.equal(staging, want)


COPIERS = {
    "scratch": lambda tensors, staging, value_bytes, scratch_chunks, pages: SectionCopier(
        tensors, staging, value_bytes, scratch_chunks, pages
    ),
    "pieces": lambda tensors, staging, value_bytes, scratch_chunks, pages: PieceCopier(tensors, staging),
}


@pytest.mark.parametrize("method", COPIERS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), scratch_chunks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_copiers_move_exactly_the_bytes_of_the_per_run_copy(method, layout, scratch_chunks, seed):
    make = COPIERS[method]
    pages, widths, value_bytes, sections, used = layout
    # Scattered blocks of one chunk never repeat within a batch (vLLM gives a job distinct blocks);
    # keep only batches whose blocks are distinct, as the worker's would be.
    blocks = [(t, b) for _, runs in sections for t, b, _, _, _ in runs]
    assume(len(set(blocks)) == len(blocks))
    gen = torch.Generator().manual_seed(seed)
    staging_bytes = used + 64

    # load: staging -> KV
    staging = torch.randint(-128, 127, (staging_bytes,), dtype=torch.int8, generator=gen)
    want_kv = _tensors(widths, gen)
    got_kv = [t.clone() for t in want_kv]
    copy_runs(want_kv, staging, _absolute(sections), to_staging=False, non_blocking=False)
    make(got_kv, staging, value_bytes, scratch_chunks, pages).copy(sections, False, False)
    for w, g in zip(want_kv, got_kv):
        assert torch.equal(w, g)

    # store: KV -> staging; every byte a run covers is the KV's, no byte outside the sections changes
    kv = _tensors(widths, gen)
    want = torch.randint(-128, 127, (staging_bytes,), dtype=torch.int8, generator=gen)
    got = want.clone()
    copy_runs(kv, want, _absolute(sections), to_staging=True, non_blocking=False)
    make(kv, got, value_bytes, scratch_chunks, pages).copy(sections, True, False)
    covered = torch.zeros(staging_bytes, dtype=torch.bool)
    for _, _, n, p, off in _absolute(sections):
        covered[off : off + n * p] = True
    inside = torch.zeros(staging_bytes, dtype=torch.bool)
    for base, _ in sections:
        inside[base : base + value_bytes] = True
    assert torch.equal(got[covered], want[covered])
    assert torch.equal(got[~inside], want[~inside])


def test_a_batch_larger_than_the_scratch_goes_through_it_in_parts():
    page, bpc, n_chunks = 64, 2, 7
    value_bytes = bpc * page * 2
    tensors = [torch.zeros(n_chunks * bpc, page, dtype=torch.int8) for _ in range(2)]
    staging = torch.randint(
        -128, 127, (n_chunks * value_bytes,), dtype=torch.int8, generator=torch.Generator().manual_seed(3)
    )
    sections = [(c * value_bytes, [(t, c * bpc, bpc, page, t * bpc * page) for t in range(2)]) for c in range(n_chunks)]
    copier = SectionCopier(tensors, staging, value_bytes, scratch_chunks=3, pages=[page])
    copier.copy(sections, False, False)
    copier.copy(sections, False, False)  # again, through the views built by the first call
    assert copier.scratch_bytes == 3 * value_bytes  # bounded: three chunks, whatever the batch
    for t in range(2):
        want = staging.view(n_chunks, 2, bpc * page)[:, t].reshape(n_chunks * bpc, page)
        assert torch.equal(tensors[t], want)


@pytest.mark.parametrize("width", [64, 96], ids=["rows-contiguous", "rows-wider-than-the-page"])
def test_pieces_of_several_rows_match_the_per_run_copy_both_ways(width):
    """A run of several consecutive blocks is one piece where the rows are contiguous, one per row
    where a row is wider than the page: the bytes are those of `copy_runs` either way."""
    page, gen = 64, torch.Generator().manual_seed(5)
    kv = [torch.randint(-128, 127, (10, width), dtype=torch.int8, generator=gen)[:, :page] for _ in range(3)]
    runs = [(0, 1, 4, page, 0), (1, 6, 3, page, 4 * page), (2, 0, 1, 32, 7 * page), (2, 8, 2, page, 8 * page)]
    staging = torch.randint(-128, 127, (16 * page,), dtype=torch.int8, generator=gen)
    want, got = staging.clone(), staging.clone()
    copy_runs(kv, want, runs, to_staging=True, non_blocking=False)
    PieceCopier(kv, got).copy([(0, runs)], True, False)
    assert torch.equal(got, want)
    want_kv, got_kv = [t.clone() for t in kv], [t.clone().zero_() for t in kv]
    for t in want_kv:
        t.zero_()
    copy_runs(want_kv, staging, runs, to_staging=False, non_blocking=False)
    PieceCopier(got_kv, staging).copy([(0, runs)], False, False)
    for w, g in zip(want_kv, got_kv):
        assert torch.equal(w, g)


@pytest.mark.parametrize(
    "bad_run",
    [(0, 9, 2, 64, 0), (0, -1, 1, 64, 0), (0, 0, 1, 80, 0), (2, 0, 1, 64, 0), (0, 0, 1, 64, 1000), (1, 0, 2, 64, -64)],
    ids=[
        "past-the-last-block",
        "negative-block",
        "page-wider-than-the-row",
        "no-such-tensor",
        "past-the-staging-buffer",
        "before-the-staging-buffer",
    ],
)
def test_a_run_outside_its_tensor_or_the_staging_buffer_is_refused_before_any_byte_moves(bad_run):
    kv = [torch.zeros(10, 64, dtype=torch.int8) for _ in range(2)]
    staging = torch.arange(1024, dtype=torch.int32).to(torch.int8)
    before = staging.clone()
    good = (1, 3, 1, 64, 128)
    with pytest.raises(ValueError, match=r"outside|does not exist"):
        PieceCopier(kv, staging).copy([(0, [good, bad_run])], True, False)
    assert torch.equal(staging, before)


def test_tensors_it_cannot_address_as_rows_are_refused_at_construction():
    staging = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(PiecesUnavailable, match="int8"):
        PieceCopier([torch.zeros(4, 16, dtype=torch.float16)], staging)
    with pytest.raises(PiecesUnavailable, match="contiguous rows"):
        PieceCopier([torch.zeros(16, 4, dtype=torch.int8).t()], staging)


# cudaMemcpyBatchAsync, as the CUDA runtime declares it (driver_types.h, 12.8+), stood in for by
# ctypes callbacks that copy with memmove: the runtime is the boundary this host cannot run.
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_hint", _MemLocation),
        ("dst_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_U64P, _SIZEP = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
# cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, [fail_idx,] stream):
# CUDA 12.8-12.9 have the failure index, CUDA 13 dropped it.
_BATCH_HEAD = (_U64P, _U64P, _U64P, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), _SIZEP, ctypes.c_size_t)
_BATCH_13 = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_HEAD, ctypes.c_void_p)
_BATCH_12 = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_HEAD, _SIZEP, ctypes.c_void_p)


class FakeBatchCopy:
    """Records each call (count, attributes, stream) and copies every piece, or fails with `error`."""

    def __init__(self, version: int, error: int = 0) -> None:
        self.calls: list[tuple[int, tuple[int, int, int, int, int, int], int | None]] = []
        self.error = error
        if version >= 13000:
            self.fn = _BATCH_13(lambda d, s, z, n, a, i, na, stream: self._copy(d, s, z, n, a, i, na, stream))
        else:
            self.fn = _BATCH_12(lambda d, s, z, n, a, i, na, fail, stream: self._copy(d, s, z, n, a, i, na, stream))
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _copy(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream) -> int:
        a = attrs[0]
        assert num_attrs == 1 and idxs[0] == 0  # one set of attributes, for every piece
        self.calls.append(
            (
                count,
                (a.src_access_order, a.src_hint.type, a.src_hint.id, a.dst_hint.type, a.dst_hint.id, a.flags),
                stream,
            )
        )
        if self.error:
            return self.error
        for k in range(count):
            ctypes.memmove(dsts[k], srcs[k], sizes[k])
        return 0


def _pieces(n: int, size: int, gen):
    src = np.frombuffer(
        torch.randint(0, 255, (n * size,), dtype=torch.uint8, generator=gen).numpy().tobytes(), dtype=np.uint8
    ).copy()
    dst = np.zeros(n * size, dtype=np.uint8)
    order = np.array(torch.randperm(n, generator=gen).tolist(), dtype=np.uint64)  # scattered destinations
    srcs = src.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
    dsts = dst.ctypes.data + order * np.uint64(size)
    want = np.zeros_like(dst).reshape(n, size)
    want[order.astype(np.int64)] = src.reshape(n, size)
    return src, dst, srcs, dsts, want.reshape(-1)


@pytest.mark.parametrize("version", [12080, 13000], ids=["cuda-12.8-signature", "cuda-13-signature"])
@pytest.mark.parametrize("kind", [1, 2], ids=["host-to-device", "device-to-host"])
def test_a_batch_is_one_batched_call_of_every_piece_in_stream_order(version, kind):
    """Every piece goes to the runtime in ONE cudaMemcpyBatchAsync, called with the signature of
    the runtime's version, the caller's stream, sources read in stream order, the host/device
    hints of the direction; the bytes land where the per-piece copy would put them."""
    gen = torch.Generator().manual_seed(version + kind)
    _src, dst, srcs, dsts, want = _pieces(300, 96, gen)
    batch = FakeBatchCopy(version)
    sizes = np.full(300, 96, dtype=np.uint64)
    assert _copy_pieces.copy_pieces(0, kind, 0xABC0, dsts, srcs, sizes, batch.address, version, 3) == 0
    host, device = (2, 0), (1, 3)  # cudaMemLocationTypeHost, id 0; cudaMemLocationTypeDevice, the GPU's index
    src_hint, dst_hint = (host, device) if kind == 1 else (device, host)
    assert batch.calls == [(300, (1, *src_hint, *dst_hint, 0), 0xABC0)]
    assert np.array_equal(dst, want)


def test_a_failed_batch_is_copied_piece_by_piece_and_its_error_returned():
    gen = torch.Generator().manual_seed(11)
    _src, dst, srcs, dsts, want = _pieces(50, 40, gen)
    batch = FakeBatchCopy(13000, error=1)  # cudaErrorInvalidValue
    sizes = np.full(50, 40, dtype=np.uint64)
    assert _copy_pieces.copy_pieces(0, 1, 7, dsts, srcs, sizes, batch.address, 13000, 0) == 1
    assert len(batch.calls) == 1
    assert np.array_equal(dst, want)  # by the loop (memcpy here: fn 0)


def test_the_copier_warns_once_and_stops_batching_after_a_failed_batch(caplog):
    """A runtime that refuses the batched call costs one failed call, not one per batch, and no
    byte: the copier says so and copies piece by piece from then on."""
    page, gen = 64, torch.Generator().manual_seed(13)
    kv = [torch.zeros(10, page, dtype=torch.int8) for _ in range(2)]
    staging = torch.randint(-128, 127, (20 * page,), dtype=torch.int8, generator=gen)
    runs = [(0, 2, 3, page, 0), (1, 7, 2, page, 5 * page)]
    copier = PieceCopier(kv, staging)
    batch = FakeBatchCopy(13000, error=801)  # cudaErrorNotSupported
    copier._runtime = CudaRuntime(0, batch.address, 13000)  # CPU tensors: memcpy is the per-piece copy
    assert copier.batched
    with caplog.at_level(logging.WARNING, logger="memkv_vllm.direct.copies"):
        copier.copy([(0, runs)], False, False)
        copier.copy([(0, runs)], False, False)
    assert len(batch.calls) == 1 and not copier.batched
    assert [r.getMessage() for r in caplog.records if "cudaMemcpyBatchAsync" in r.getMessage()] == [
        "MemKV direct mode: cudaMemcpyBatchAsync failed with CUDA error 801 (runtime 13000); this batch and the next "
        "are copied one cudaMemcpyAsync per piece"
    ]
    want = [torch.zeros_like(t) for t in kv]
    copy_runs(want, staging, runs, to_staging=False, non_blocking=False)
    assert all(torch.equal(w, g) for w, g in zip(want, kv))


def test_a_copier_told_not_to_batch_or_on_cpu_copies_piece_by_piece():
    kv, staging = [torch.zeros(4, 16, dtype=torch.int8)], torch.zeros(64, dtype=torch.int8)
    assert not PieceCopier(kv, staging).batched  # CPU tensors: memcpy per piece
    assert not PieceCopier(kv, staging, batch=False).batched
