"""The connector harness drives vLLM's real OffloadingConnector, shown with the built-in fs tier.

Behaviour under test, on whichever vLLM release is installed: a prompt longer than the token
budget is prefilled in several steps and reaches the manager as one store job per step, each
holding that step's complete chunks (never the partial tail), with its keys as a set; the
workers' reports (per rank, merged like vLLM's aggregator) complete each job once; a cold
request's first lookup is deferred; after a cache reset a new request matches every full chunk,
is parked until its load is reported and loads rows whose bytes are the stored ones; the 0.33
manager lock is free between steps; shutdown removes the /dev/shm region.
If these fail, the harness (not a memkv tier) is wrong for that release.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from tests.conformance import connector_harness as ch
from tests.conformance import vllm_harness as h
from tests.conformance.harness_compat import STORE_JOB_KEYS_IN_PROMPT_ORDER

pytestmark = pytest.mark.conformance

GEOMETRY = h.Geometry(world_size=2, gpu_block_size=16, block_size=64, num_rows=32)
TPC = GEOMETRY.block_size


def fs_tier(root: Path) -> dict:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_long_prompt_reaches_the_manager_as_one_job_per_prefill_step_in_the_release_s_key_order(tmp_path, delay):
    tokens = 16 * TPC + 10  # 16 full chunks and a partial one
    with ch.ConnectorEngine(
        [fs_tier(tmp_path)], GEOMETRY, token_budget=4 * TPC, store_report_delay_steps=delay
    ) as engine:
        req = engine.run(f"p/{uuid.uuid4().hex}", tokens)
        assert req.matched_tokens == 0 and req.deferred_lookups >= 1
        assert [job.chunks for job in req.store_jobs] == [list(range(i, i + 4)) for i in range(0, 16, 4)]
        assert len({job.step for job in req.store_jobs}) == 4  # one job per step
        assert all(sorted(job.key_order) == job.chunks for job in req.store_jobs)
        if STORE_JOB_KEYS_IN_PROMPT_ORDER:  # 0.34+: a tuple in prompt order, not a set
            assert all(job.key_order == job.chunks for job in req.store_jobs)
        assert sorted(engine.completion_order) == [job.job_id for job in req.store_jobs]
        assert len(list(tmp_path.rglob("*.bin"))) == 16  # cascaded: the partial chunk never is
        assert engine.primary_holds(req.chunk_keys()) == [True] * 16


def test_revisit_after_reset_matches_every_full_chunk_and_loads_the_stored_bytes(tmp_path):
    tag, tokens = f"p/{uuid.uuid4().hex}", 16 * TPC + 10
    with ch.ConnectorEngine([fs_tier(tmp_path)], GEOMETRY, token_budget=4 * TPC) as engine:
        engine.run(tag, tokens)
        engine.reset_cache()
        assert engine.primary_holds(ch.prompt_keys(tag, 16, GEOMETRY)) == [False] * 16
        warm = engine.add_request(tag, tokens)
        engine.run_until_finished([warm])
        engine.run_until_idle()
        assert warm.matched_tokens == 16 * TPC and warm.deferred_lookups >= 1
        assert sorted(warm.loaded_chunks) == list(range(16))  # each row checked byte for byte
        assert engine.load_jobs == 1 and warm.store_jobs == []


def test_a_restarted_connector_over_the_same_root_dir_promotes_the_prompt(tmp_path):
    tag, tokens = f"p/{uuid.uuid4().hex}", 8 * TPC + 1
    with ch.ConnectorEngine([fs_tier(tmp_path)], GEOMETRY, token_budget=2 * TPC) as first:
        first.run(tag, tokens)
    with ch.ConnectorEngine([fs_tier(tmp_path)], GEOMETRY, token_budget=2 * TPC) as second:
        req = second.add_request(tag, tokens)
        second.run_until_finished([req])
        assert req.matched_tokens == 8 * TPC and sorted(req.loaded_chunks) == list(range(8))


def test_a_lagging_rank_changes_the_order_in_which_jobs_complete(tmp_path):
    """Rank 1 reports all three jobs in the step in which rank 0 reports the last one: the
    merged report (rank 0's dict first) completes the last job first."""
    with ch.ConnectorEngine([fs_tier(tmp_path)], GEOMETRY, token_budget=4 * TPC) as engine:
        engine.hold_store_reports(ranks=[1])
        req = engine.add_request(f"p/{uuid.uuid4().hex}", 12 * TPC)
        engine.run_until_finished([req])
        engine.release_store_reports(ranks=[1])
        engine.run_until_idle()
        jobs = [job.job_id for job in req.store_jobs]
        assert engine.completion_order == [jobs[2], jobs[0], jobs[1]]
        assert len(list(tmp_path.rglob("*.bin"))) == 12


def test_manager_lock_is_free_between_steps_and_the_region_is_removed_at_shutdown(tmp_path):
    engine = ch.ConnectorEngine([fs_tier(tmp_path)], dataclasses.replace(GEOMETRY, world_size=1), token_budget=4 * TPC)
    try:
        lock = getattr(engine.manager, "lock", None)
        req = engine.add_request(f"p/{uuid.uuid4().hex}", 8 * TPC + 3)
        for _ in range(50):
            engine.step()
            if lock is not None and hasattr(lock, "locked"):  # 0.33: a real Lock
                assert not lock.locked(), "the step left the manager lock held"
            if req.is_finished():
                break
        assert req.is_finished()
        engine.run_until_idle()
    finally:
        engine.shutdown()
    assert h.shm_region_paths(engine.engine_id) == []
