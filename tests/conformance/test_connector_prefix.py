"""The memkv tier behind vLLM's real OffloadingConnector (scheduler side), against real nodes.

Behaviour under test (issue 13): job shapes exactly as vLLM makes them -- a long prompt
prefilled in several chunks reaches the tier as several store jobs, each a *set* of keys -- and
what the tier keeps is usable by the connector's prefix lookup:

* with the tier config as README.md shows it (no backlog key) and a prompt whose KV fits in half
  of the CPU pool, the whole prompt promotes after it left the pool, for a new request and for a
  restarted connector on the same nodes;
* with a backlog smaller than the prompt, the tokens the connector matches on a revisit are
  exactly the chunks the nodes hold for that request, and those form a prefix (sheds counted);
* several concurrent long prompts over a backlog that fits about one: each request's chunks on
  the nodes form a prefix (kept whole, cut, or shed from the start; never scattered holes);
* a cold run stores the same chunks in the CPU pool with the tier as without it.

connector_harness.py says what is real (the connector, the manager, the pool, the tier) and
what is simulated (the engine's scheduler loop and the GPU workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
import uuid

import pytest

from tests.conformance import connector_harness as ch
from tests.conformance import vllm_harness as h
from tests.conformance.conftest import point_at, start_nodes
from tests.conformance.harness_compat import STORE_JOB_KEYS_IN_PROMPT_ORDER
from tests.faults.nodeops import all_threads_stopped

pytestmark = [pytest.mark.conformance, pytest.mark.over_tls_too]  # every test also over TLS (conftest.py)

SHEDS = "vllm:kv_offload_memkv_sheds"
README_TIER = {"type": "memkv", "n_read_threads": 8, "n_write_threads": 8}  # README.md, verbatim

# 1 MiB rows (2 GPU blocks of 512 KiB per 32-token chunk), a 64-row (64 MiB) CPU pool.
GEOMETRY = h.Geometry(worker_kv_bytes_per_block=512 << 10, gpu_block_size=16, block_size=32, num_rows=64)
TPC = GEOMETRY.block_size  # tokens per chunk
TAIL = 5  # prompt tokens after the last full chunk: never stored, never matched


@pytest.fixture
def nodes(monkeypatch, auth_key_hex, wire):
    """Two nodes of our own per test (tests here fill, stop and count them); TLS-only ones for
    a test's `[tls]` run (tests/conformance/conftest.py)."""
    import memkv_vllm

    with start_nodes(auth_key_hex, 2, "512MiB", tls=wire == "tls") as started:
        point_at(monkeypatch, started, auth_key_hex)
        memkv_vllm.register()
        yield started


def tier_of(engine: ch.ConnectorEngine):
    (tier,) = engine.manager.secondary_tiers
    return tier


def held_chunks(engine: ch.ConnectorEngine, req: ch.EngineRequest) -> list[int]:
    """Chunk indices of ``req``'s prompt that the nodes hold, asked of the nodes directly."""
    tier = tier_of(engine)
    present = tier.client.exists(tier.namespace.keys(req.chunk_keys()))
    return [c for c, p in enumerate(present) if p]


def is_prefix(chunks: list[int]) -> bool:
    return chunks == list(range(len(chunks)))


@contextlib.contextmanager
def stopped(nodes, timeout_s: float = 5.0):
    """SIGSTOP every node (and wait until all their threads are stopped), SIGCONT on exit: stores
    submitted meanwhile stay in the tier's backlog, so admission decisions are deterministic."""
    try:
        for node in nodes:
            node.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(all_threads_stopped(n.pid) for n in nodes):
            assert time.monotonic() < deadline, "nodes did not stop"
            time.sleep(0.005)
        yield
    finally:
        for node in nodes:
            node.signal(signal.SIGCONT)


def prefill_with_bulk_reports(engine: ch.ConnectorEngine, prompts: dict[str, int], nodes=None):
    """Prefill ``prompts`` ({tag: tokens}) concurrently, withholding every store report, then
    report all store jobs in one step (the manager cascades them back to back), with the nodes
    stopped meanwhile if given; returns the requests once the engine is idle."""
    engine.hold_store_reports()
    reqs = [engine.add_request(tag, n) for tag, n in prompts.items()]
    engine.run_until_finished(reqs)
    assert engine.held_store_reports() >= len(reqs)
    engine.release_store_reports()
    with stopped(nodes) if nodes else contextlib.nullcontext():
        engine.step()  # update_connector_output: complete_store -> submit_store, per job
    engine.run_until_idle()
    return reqs


def revisit(engine: ch.ConnectorEngine, tag: str, num_tokens: int) -> ch.EngineRequest:
    """A new request for the same prompt; returns it once finished (loads checked byte for byte)."""
    req = engine.add_request(tag, num_tokens)
    engine.run_until_finished([req])
    engine.run_until_idle()
    return req


def evict_with_fillers(engine: ch.ConnectorEngine, keys, filler_chunks: int = 24) -> None:
    """Prefill other prompts until the pool's LRU evicted ``keys`` (bounded)."""
    for i in range(2 * GEOMETRY.num_rows // filler_chunks + 2):
        if not any(engine.primary_holds(keys)):
            return
        engine.run(f"filler/{uuid.uuid4().hex}/{i}", filler_chunks * TPC + TAIL)
    assert not any(engine.primary_holds(keys)), "fillers did not evict the prompt from the pool"


# -------------------------------------------------------------------------------------------------
# a. Defaults: the whole prompt promotes
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reports", ["next-step", "bulk"])
def test_readme_config_promotes_the_whole_prompt_after_pool_eviction_and_restart(nodes, reports):
    chunks = 24  # 24 MiB of KV: fits in half of the 64 MiB pool
    tag, tokens = f"long/{uuid.uuid4().hex}", chunks * TPC + TAIL
    # A 256-token budget: the prompt is prefilled in 4 steps, so it reaches the tier as 3+ jobs.
    with ch.ConnectorEngine([README_TIER], GEOMETRY, token_budget=256) as engine:
        if reports == "bulk":
            (cold,) = prefill_with_bulk_reports(engine, {tag: tokens})
        else:
            cold = engine.run(tag, tokens)
        assert cold.matched_tokens == 0
        assert len(cold.store_jobs) >= 3 and sorted(cold.stored_chunks) == list(range(chunks))
        assert held_chunks(engine, cold) == list(range(chunks)), "the tier did not keep the whole prompt"
        assert engine.stat(SHEDS, ("tier",)) == 0

        evict_with_fillers(engine, cold.chunk_keys())
        warm = revisit(engine, tag, tokens)
        assert warm.matched_tokens == chunks * TPC
        assert sorted(warm.loaded_chunks) == list(range(chunks))  # bytes checked by the harness

    with ch.ConnectorEngine([README_TIER], GEOMETRY, token_budget=256) as restarted:
        again = revisit(restarted, tag, tokens)
        assert again.matched_tokens == chunks * TPC
        assert sorted(again.loaded_chunks) == list(range(chunks))
        assert again.store_jobs == []  # everything came from MemKV: nothing recomputed, nothing stored


# -------------------------------------------------------------------------------------------------
# b. A backlog smaller than the prompt: what is held is what is matched, and it is a prefix
# -------------------------------------------------------------------------------------------------


def prefill_with_nodes_stopped_after_the_first_job(engine: ch.ConnectorEngine, tag: str, tokens: int, nodes):
    """Prefill one prompt with store reports on time (one job per step), the nodes stopped from
    the step its first store job is made until every job of it reached the tier: the first job
    meets an empty backlog and stays in it, the later ones find it full."""
    req = engine.add_request(tag, tokens)
    engine.run_until(lambda: bool(req.store_jobs), 60.0, "no store job was made", max_steps=5000)
    with stopped(nodes):
        engine.run_until(
            lambda: req.is_finished() and engine.held_store_reports() == 0,
            60.0,
            "the prompt's store jobs were not all reported",
            max_steps=5000,
        )
    engine.run_until_idle()
    return req


def test_backlog_smaller_than_prompt_holds_exactly_the_prefix_that_a_revisit_matches(nodes):
    """1 MiB backlog, a 48 MiB prompt in 3 jobs of 16 chunks (2 tasks of blocks_per_op 8 each),
    one job per step, the nodes stopped while they arrive: the first job meets an empty
    backlog, the others a full one. Before the whole-job fix the tier kept its first *task*, 8
    chunks in hash-set order, and the revisit matched only the run of them that happened to lead."""
    chunks = 48
    tag, tokens = f"long/{uuid.uuid4().hex}", chunks * TPC + TAIL
    tier = {**README_TIER, "max_store_backlog_mb": 1}
    with ch.ConnectorEngine([tier], GEOMETRY, token_budget=16 * TPC) as engine:
        cold = prefill_with_nodes_stopped_after_the_first_job(engine, tag, tokens, nodes)
        assert [len(job.chunks) for job in cold.store_jobs] == [16, 16, 16]
        if STORE_JOB_KEYS_IN_PROMPT_ORDER:  # 0.34+: each job's keys in prompt order
            assert all(job.key_order == job.chunks for job in cold.store_jobs)
        else:  # before 0.34: sets, not in prompt order
            assert any(job.key_order != job.chunks for job in cold.store_jobs)
        held = held_chunks(engine, cold)
        sheds = engine.stat(SHEDS, ("tier",))
        assert 0 < len(held) < chunks and sheds == chunks - len(held), (held, sheds)

        engine.reset_cache()  # the prompt leaves the CPU pool; MemKV keeps it
        assert not any(engine.primary_holds(cold.chunk_keys()))
        warm = revisit(engine, tag, tokens)

        assert warm.matched_tokens == len(held) * TPC, f"matched {warm.matched_tokens} tokens, nodes hold {held}"
        assert is_prefix(held), f"the nodes hold chunks {held}: not a prefix"
        assert sorted(warm.loaded_chunks) == held


# -------------------------------------------------------------------------------------------------
# c. Concurrent long prompts over a backlog that fits about one: each keeps a prefix
# -------------------------------------------------------------------------------------------------


def test_concurrent_prompts_over_a_small_backlog_each_keep_a_prefix_and_one_is_whole(nodes):
    """Three 24-chunk prompts prefilled side by side (12 chunks per request per step, so each
    sends 2 jobs of 2 tasks), a 30 MiB backlog, all jobs reported at once with the nodes stopped.
    Task-by-task admission cut the third prompt's first job to 4 chunks in hash-set order. The
    pool has room for all three prompts while their rows are pinned: with 64 rows the connector's
    prepare_store finds none free for the third prompt's second job, which is then never made."""
    chunks = 24
    geometry = dataclasses.replace(GEOMETRY, num_rows=96)
    tokens = chunks * TPC + TAIL
    tags = [f"concurrent/{uuid.uuid4().hex}/{i}" for i in range(3)]
    tier = {**README_TIER, "max_store_backlog_mb": 30}
    with ch.ConnectorEngine(
        [tier], geometry, token_budget=3 * 12 * TPC, long_prefill_token_threshold=12 * TPC
    ) as engine:
        reqs = prefill_with_bulk_reports(engine, {tag: tokens for tag in tags}, nodes=nodes)
        assert all(len(r.store_jobs) == 2 for r in reqs)
        steps = [{job.step for job in r.store_jobs} for r in reqs]
        assert steps[0] & steps[1] & steps[2], f"prompts did not prefill side by side: {steps}"
        held = {r.tag: held_chunks(engine, r) for r in reqs}
        assert engine.stat(SHEDS, ("tier",)) == 3 * chunks - sum(len(v) for v in held.values())

        engine.reset_cache()
        matched = {tag: revisit(engine, tag, tokens).matched_tokens for tag in tags}

    for tag in tags:
        assert is_prefix(held[tag]), f"{tag}: the nodes hold chunks {held[tag]}: not a prefix"
        assert matched[tag] == len(held[tag]) * TPC, (tag, matched[tag], held[tag])
    assert any(len(v) == chunks for v in held.values()), f"no prompt was kept whole: {held}"


# -------------------------------------------------------------------------------------------------
# d. The cascade costs the CPU pool nothing
# -------------------------------------------------------------------------------------------------


def test_cold_run_stores_the_same_chunks_in_the_pool_with_and_without_the_tier(nodes):
    """Two long prompts side by side and a third after them, cold: the connector's store jobs
    (which chunks, in which of the request's steps) and the pool's final contents are the same with the memkv tier as
    with no secondary tier. (What the nodes keep depends on how fast they write: the two prompts
    side by side may fill the default backlog, half the pool, and lose their last jobs; whatever
    is kept is a prefix.) The pool has room for all three prompts: when it must evict, the rows
    the cascades pin make its LRU pick other victims, so its contents would differ."""
    geometry = dataclasses.replace(GEOMETRY, num_rows=96)
    prompts = {f"cold/{uuid.uuid4().hex}/{i}": (20 + 4 * i) * TPC + TAIL for i in range(3)}
    runs = {}
    for name, tiers in (("none", []), ("memkv", [README_TIER])):
        with ch.ConnectorEngine(
            tiers, geometry, token_budget=2 * 8 * TPC, long_prefill_token_threshold=8 * TPC
        ) as engine:
            first = [engine.add_request(tag, n) for tag, n in list(prompts.items())[:2]]
            engine.run_until_finished(first)
            tag, n = list(prompts.items())[2]
            last = engine.run(tag, n)
            reqs = [*first, last]
            runs[name] = {
                # Steps counted from each request's first job: the tier's first lookup answers
                # RETRY, so a cold request waits one step more before it is scheduled.
                "jobs": [(r.tag, job.step - r.store_jobs[0].step, job.chunks) for r in reqs for job in r.store_jobs],
                "stored": {r.tag: sorted(r.stored_chunks) for r in reqs},
                "in_pool": {r.tag: engine.primary_holds(r.chunk_keys()) for r in reqs},
            }
            if tiers:
                held = {r.tag: held_chunks(engine, r) for r in reqs}
                assert all(is_prefix(v) for v in held.values()), held
    assert runs["memkv"] == runs["none"]
    assert all(all(v) for v in runs["none"]["in_pool"].values())


# -------------------------------------------------------------------------------------------------
# e. Jobs that complete out of order (tensor parallel, one rank behind): admitted together
# -------------------------------------------------------------------------------------------------


def test_store_jobs_completed_out_of_order_across_ranks_still_leave_a_prefix(nodes):
    """TP=2, 1 MiB backlog, a 48-chunk prompt in 3 jobs. Rank 1 lags: it reports nothing until
    the prompt is done, then all three jobs in the step in which rank 0 reports the last one, so
    they complete in the order 2, 0, 1. Per-job admission kept the tail (job 2 met an empty
    backlog) and shed the head; the tier admits a request's jobs of one step together, so the
    prompt is kept whole (admission.py: across steps each rank's order holds)."""
    geometry = dataclasses.replace(GEOMETRY, world_size=2, worker_kv_bytes_per_block=256 << 10)
    chunks = 48
    tag, tokens = f"tp2/{uuid.uuid4().hex}", chunks * TPC  # no tail: the last job comes last
    tier = {**README_TIER, "max_store_backlog_mb": 1}
    with ch.ConnectorEngine([tier], geometry, token_budget=16 * TPC) as engine:
        engine.hold_store_reports(ranks=[1])
        cold = engine.add_request(tag, tokens)
        engine.run_until_finished([cold])
        engine.release_store_reports(ranks=[1])
        with stopped(nodes):
            engine.step()
        engine.run_until_idle()
        jobs = [job.job_id for job in cold.store_jobs]
        assert len(jobs) == 3 and engine.completion_order == [jobs[2], jobs[0], jobs[1]]
        held = held_chunks(engine, cold)
        assert held and engine.stat(SHEDS, ("tier",)) == chunks - len(held)

        engine.reset_cache()
        warm = revisit(engine, tag, tokens)
        assert is_prefix(held), f"the nodes hold chunks {held[0]}..{held[-1]}: not a prefix"
        assert warm.matched_tokens == len(held) * TPC
