"""The headless harness drives vLLM's real tiering stack, shown with the built-in fs tier.

Behaviour under test, on whichever vLLM release is installed: chunks written into the
primary pool cascade to the fs tier; filler stores evict them from the pool (LRU); a later
lookup answers RETRY (probe pending, then promotion in flight) before HIT, never MISS; the
promoted rows hold the original bytes although every row was overwritten in between; a
restarted engine over the same root_dir finds the first engine's chunks; rows are laid
out as round_up(world_size * per-worker chunk, page) for 1, 2 and 4 simulated ranks; a
cache reset empties the pool but not the tier; shutdown removes the /dev/shm region.
If these fail, the harness (not a memkv tier) is wrong for that release.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="conformance tests need vLLM (run them through nox)")

from vllm.v1.kv_offload.base import LookupResult

from tests.conformance.vllm_harness import (
    Geometry,
    HeadlessEngine,
    make_key,
    make_keys,
    register_tier,
    row_bytes,
    shm_region_paths,
)

pytestmark = pytest.mark.conformance

TRANSIENT = {LookupResult.RETRY, LookupResult.HIT_PENDING}


def fs_tier(root: Path) -> dict:
    return {
        "type": "fs",
        "root_dir": str(root),
        "n_read_threads": 2,
        "n_write_threads": 2,
    }


def stored_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


def cascade(engine: HeadlessEngine, keys: list[bytes]) -> dict[bytes, int]:
    """Store ``keys`` through the primary pool and wait until the tier has them."""
    req = engine.new_request()
    outcome = engine.store_chunks(req, keys)
    assert set(outcome.rows) == set(keys)
    engine.finish_request(req)
    engine.step()
    engine.run_until_idle()
    return outcome.rows


@pytest.fixture
def engine(tmp_path: Path):
    with HeadlessEngine([fs_tier(tmp_path / "fs")], Geometry(world_size=2)) as eng:
        yield eng


def test_stored_chunks_cascade_to_the_fs_tier_as_one_file_per_row(engine, tmp_path):
    keys = make_keys(4)
    cascade(engine, keys)
    files = stored_files(tmp_path / "fs")
    assert len(files) == len(keys)
    assert {f.stat().st_size for f in files} == {engine.row_bytes}


def test_filler_stores_evict_the_originals_from_the_primary_pool(engine):
    keys = make_keys(4)
    cascade(engine, keys)
    assert all(engine.in_primary(k) for k in keys)
    evicted = engine.fill_pool_to_evict(keys)
    assert set(keys) <= set(evicted)


def test_lookup_of_an_evicted_chunk_retries_then_hits(engine):
    keys = make_keys(4)
    cascade(engine, keys)
    engine.fill_pool_to_evict(keys)
    trace = engine.lookup_until_resolved(keys, engine.new_request(), max_steps=50)
    assert trace.resolved, trace.summary()
    assert trace.final == (LookupResult.HIT,) * len(keys)
    for i in range(len(keys)):
        answers = trace.per_key(i)
        # First the tier's async probe is pending, then (0.28+: HIT_PENDING) the
        # promotion is in flight; a MISS on the way would drop the prefix.
        assert answers[0] is LookupResult.RETRY, trace.summary(i)
        assert set(answers[:-1]) <= TRANSIENT, trace.summary(i)


def test_lookup_of_a_never_stored_key_retries_then_misses(engine):
    trace = engine.lookup_until_resolved([make_key("never stored")], engine.new_request())
    assert trace.resolved
    assert trace.per_key(0)[0] is LookupResult.RETRY
    assert trace.final == (LookupResult.MISS,)


def test_promoted_rows_hold_the_original_bytes_after_every_row_was_overwritten(engine):
    keys = make_keys(4)
    stored_rows = cascade(engine, keys)
    engine.fill_pool_to_evict(keys)
    # Fillers rewrote the whole pool: no row still holds an original payload, so
    # matching bytes below can only have come back from the tier.
    originals = {engine.payloads[k] for k in keys}
    assert not originals & {engine.read_row(r) for r in range(engine.num_rows)}

    loaded = engine.promote_and_read(keys)

    for key in keys:
        assert loaded.data[key] == engine.payloads[key], f"row {stored_rows[key]} -> {loaded.rows[key]}: bytes differ"


def test_restarted_engine_over_the_same_root_dir_hits_the_first_engines_chunks(
    tmp_path,
):
    keys = make_keys(3)
    with HeadlessEngine([fs_tier(tmp_path / "fs")], Geometry(world_size=2)) as first:
        cascade(first, keys)
        payloads = {k: first.payloads[k] for k in keys}

    with HeadlessEngine([fs_tier(tmp_path / "fs")], Geometry(world_size=2)) as second:
        assert not any(second.in_primary(k) for k in keys)
        loaded = second.promote_and_read(keys)
        assert loaded.data == payloads


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rows_hold_every_ranks_slice_padded_to_a_page(tmp_path, world_size):
    geometry = Geometry(world_size=world_size, worker_kv_bytes_per_block=6000)
    per_worker_chunk = 6000 * geometry.blocks_per_chunk
    expected_row = -(-world_size * per_worker_chunk // 4096) * 4096

    with HeadlessEngine([fs_tier(tmp_path / "fs")], geometry) as engine:
        view = engine.view
        assert row_bytes(engine.manager) == row_bytes(engine.spec) == expected_row
        assert view.shape == (engine.num_rows, expected_row) == (geometry.num_rows, expected_row)
        assert view.strides == (expected_row, 1)
        assert view.format == "b" and view.c_contiguous

        keys = make_keys(2)
        cascade(engine, keys)
        assert {f.stat().st_size for f in stored_files(tmp_path / "fs")} == {expected_row}
        engine.fill_pool_to_evict(keys)
        loaded = engine.promote_and_read(keys)
        assert all(loaded.data[k] == engine.payloads[k] for k in keys)


def test_mib_sized_rows_round_trip_byte_exact(tmp_path):
    geometry = Geometry(world_size=4, worker_kv_bytes_per_block=256 * 1024, num_rows=4)
    assert geometry.row_bytes == 2 * 1024 * 1024
    with HeadlessEngine([fs_tier(tmp_path / "fs")], geometry) as engine:
        keys = make_keys(2)
        cascade(engine, keys)
        engine.fill_pool_to_evict(keys)
        loaded = engine.promote_and_read(keys)
        assert all(loaded.data[k] == engine.payloads[k] for k in keys)


def test_reset_cache_empties_the_pool_but_the_fs_tier_still_serves_the_chunks(engine):
    keys = make_keys(3)
    cascade(engine, keys)
    engine.reset_cache()
    assert not any(engine.in_primary(k) for k in keys)
    loaded = engine.promote_and_read(keys)
    assert all(loaded.data[k] == engine.payloads[k] for k in keys)


def test_shutdown_removes_the_primary_region_from_dev_shm(tmp_path):
    engine = HeadlessEngine([fs_tier(tmp_path / "fs")])
    try:
        assert shm_region_paths(engine.engine_id)
        assert all(os.path.getsize(p) > 0 for p in shm_region_paths(engine.engine_id))
    finally:
        engine.shutdown()
    assert not shm_region_paths(engine.engine_id)
    engine.shutdown()  # idempotent


def test_a_registered_out_of_tree_tier_is_built_and_a_second_registration_is_swallowed():
    name = f"harness_{uuid.uuid4().hex[:8]}"
    module, cls = (
        "vllm.v1.kv_offload.tiering.example.manager",
        "ExampleSecondaryTierManager",
    )
    assert register_tier(name, module, cls) is True
    assert register_tier(name, module, cls) is False
    assert register_tier("fs", module, cls) is False  # built-in names stay taken

    with HeadlessEngine([{"type": name, "custom_param": 7}]) as engine:
        (tier,) = engine.manager.secondary_tiers
        assert (type(tier).__name__, tier.tier_type) == (cls, name)
