"""Direct mode's staging <-> KV copies: `SectionCopier` (the worker's, through a scratch) and
`PieceCopier` (copy_method "pieces": one call into C per batch) move exactly the bytes the
reference per-run loop `copy_runs` moves, in both directions, for any runs
the worker builds: consecutive or scattered GPU blocks, several page sizes (an unaligned run takes
the copier's per-run path), KV rows wider than a page, batches larger than the scratch, and
sections that leave bytes uncovered (a store writes each run's bytes exactly and nothing outside
the sections' value bytes). CPU tensors stand in for the GPU, as in the rest of the suite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memkv_vllm.direct.copies import PieceCopier, PiecesUnavailable, SectionCopier, copy_runs

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


COPIERS = {
    "scratch": lambda tensors, staging, value_bytes, scratch_chunks, pages: SectionCopier(
        tensors, staging, value_bytes, scratch_chunks, pages),
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
    staging = torch.randint(-128, 127, (n_chunks * value_bytes,), dtype=torch.int8,
                            generator=torch.Generator().manual_seed(3))
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


@pytest.mark.parametrize("bad_run", [(0, 9, 2, 64, 0), (0, -1, 1, 64, 0), (0, 0, 1, 80, 0), (2, 0, 1, 64, 0),
                                     (0, 0, 1, 64, 1000), (1, 0, 2, 64, -64)],
                         ids=["past-the-last-block", "negative-block", "page-wider-than-the-row", "no-such-tensor",
                              "past-the-staging-buffer", "before-the-staging-buffer"])
def test_a_run_outside_its_tensor_or_the_staging_buffer_is_refused_before_any_byte_moves(bad_run):
    kv = [torch.zeros(10, 64, dtype=torch.int8) for _ in range(2)]
    staging = torch.arange(1024, dtype=torch.int32).to(torch.int8)
    before = staging.clone()
    good = (1, 3, 1, 64, 128)
    with pytest.raises(ValueError, match="outside|does not exist"):
        PieceCopier(kv, staging).copy([(0, [good, bad_run])], True, False)
    assert torch.equal(staging, before)


def test_tensors_it_cannot_address_as_rows_are_refused_at_construction():
    staging = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(PiecesUnavailable, match="int8"):
        PieceCopier([torch.zeros(4, 16, dtype=torch.float16)], staging)
    with pytest.raises(PiecesUnavailable, match="contiguous rows"):
        PieceCopier([torch.zeros(16, 4, dtype=torch.int8).t()], staging)
