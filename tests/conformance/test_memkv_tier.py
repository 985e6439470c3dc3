"""The memkv tier inside vLLM's real TieringOffloadingManager, against real `memkv serve` nodes.

Behaviour under test (issue: the memkv secondary tier): cascades land in MemKV in place;
chunks evicted from the CPU pool are looked up (RETRY, then HIT) and promoted byte-exact; a
restarted engine hits its predecessor's blocks while another KV layout never collides; an
outage or a stalled node degrades lookups to MISS within lookup_timeout_s; a value gone
between lookup and load fails only that promotion, is purged and is not retried in a loop;
store backpressure sheds whole jobs and counts them, a shed request keeps only the jobs before its
first shed one (a usable prefix), and the default backlog keeps a prompt of half the pool whole; metrics are declared with their label arity; bad tier
keys and bad servers fail at startup with a message naming them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from memkv import __version__ as memkv_version
from memkv import sockio
from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, parse_servers
from memkv.local import LocalNode
from memkv_vllm import compat
from tests.conformance import vllm_harness as h
from tests.conformance.conftest import PluginLog, WaitingCalls, point_at
from tests.conftest import REMOTE

pytestmark = pytest.mark.conformance

LookupResult = h.LookupResult


def tier_of(engine: h.HeadlessEngine):
    (tier,) = engine.manager.secondary_tiers
    return tier


def memkv(tier_overrides: dict | None = None) -> dict:
    return {"type": "memkv", "n_read_threads": 2, "n_write_threads": 2, **(tier_overrides or {})}


def store_and_settle(engine: h.HeadlessEngine, keys) -> None:
    req = engine.new_request()
    outcome = engine.store_chunks(req, keys)
    assert set(outcome.rows) == set(keys)
    engine.finish_request(req)
    engine.step()
    engine.run_until_idle(timeout_s=20)


def in_memkv(engine: h.HeadlessEngine, keys) -> list[bool]:
    tier = tier_of(engine)
    return tier.client.exists(tier.namespace.keys(keys))


def memkv_stats(engine: h.HeadlessEngine, totals: dict) -> dict:
    """Accumulate the memkv series of get_stats() into `totals` ({(name, labels): value})."""
    for name, series in h.stats_values(engine.get_stats()).items():
        if "memkv" not in name:
            continue
        for labels, value in series.items():
            add = len(value) if isinstance(value, list) else value
            totals[(name, labels)] = totals.get((name, labels), 0) + add
    return totals


# -------------------------------------------------------------------------------------------------
# The happy path
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.over_tls_too
def test_cascade_then_promotion_after_pool_eviction_is_byte_exact(memkv_env, world_size):
    geometry = h.Geometry(world_size=world_size, num_rows=8)
    with h.HeadlessEngine([memkv()], geometry) as engine:
        keys = h.make_keys(4)
        store_and_settle(engine, keys)
        assert in_memkv(engine, keys) == [True] * 4, "cascade did not reach MemKV"
        engine.fill_pool_to_evict(keys)
        assert not any(engine.in_primary(k) for k in keys)

        loaded = engine.promote_and_read(keys)

        assert loaded.trace.per_key(0)[0] is LookupResult.RETRY  # the async probe is pending first
        assert loaded.trace.final == (LookupResult.HIT,) * 4
        for key in keys:
            assert loaded.data[key] == engine.payloads[key], f"promoted row differs for {key.hex()[:16]}"
        assert tier_of(engine).row_bytes == geometry.row_bytes


def test_values_are_whole_pool_rows_under_the_layout_namespace(memkv_env, auth_key_hex):
    geometry = h.Geometry(world_size=2, num_rows=8)
    with h.HeadlessEngine([memkv()], geometry) as engine:
        keys = h.make_keys(2)
        store_and_settle(engine, keys)
        tier = tier_of(engine)
        for key in keys:
            value = tier.client.get(tier.namespace.key(key))
            assert value == engine.payloads[key] and len(value) == geometry.row_bytes
        assert tier.namespace.namespace.endswith(f"/b{geometry.row_bytes}/")
        record = tier.client.get(tier.namespace.config_key)
        assert record is not None and b'"row_bytes": %d' % geometry.row_bytes in record


@pytest.mark.over_tls_too
def test_restarted_engine_hits_the_blocks_its_predecessor_stored(memkv_env):
    geometry = h.Geometry(world_size=2, num_rows=8)
    keys = h.make_keys(4)
    with h.HeadlessEngine([memkv()], geometry) as first:
        store_and_settle(first, keys)
        payloads = {k: first.payloads[k] for k in keys}
    with h.HeadlessEngine([memkv()], geometry) as second:  # a new engine id, an empty pool
        assert not any(second.in_primary(k) for k in keys)
        loaded = second.promote_and_read(keys)
        assert all(loaded.data[k] == payloads[k] for k in keys)


def test_engine_with_another_kv_layout_never_sees_those_blocks(memkv_env):
    keys = h.make_keys(3)
    with h.HeadlessEngine([memkv()], h.Geometry(world_size=2, num_rows=8)) as tp2:
        store_and_settle(tp2, keys)
    with h.HeadlessEngine([memkv()], h.Geometry(world_size=1, num_rows=8)) as tp1:
        trace = tp1.lookup_until_resolved(keys, tp1.new_request())
        assert trace.resolved and trace.final == (LookupResult.MISS,) * 3


def test_never_stored_key_is_a_miss_after_one_probe_round(memkv_env):
    with h.HeadlessEngine([memkv()]) as engine:
        trace = engine.lookup_until_resolved(h.make_keys(2), engine.new_request())
        assert trace.resolved and trace.final == (LookupResult.MISS,) * 2
        assert trace.per_key(0)[0] is LookupResult.RETRY


def test_keys_of_a_successful_store_supersede_the_miss_the_tier_remembered(memkv_env):
    """A request that looked a chunk up before it was stored (MISS, remembered while the request
    lives) finds it once another request's store of it succeeded and the pool evicted it: the
    tier probes again instead of answering the old MISS."""
    with h.HeadlessEngine([memkv()], h.Geometry(num_rows=16)) as engine:
        keys = h.make_keys(2)
        waiting = engine.new_request()
        before = engine.lookup_until_resolved(keys, waiting)
        assert before.resolved and before.final == (LookupResult.MISS,) * 2
        store_and_settle(engine, keys)  # another request computes and stores them
        engine.fill_pool_to_evict(keys)
        loaded = engine.promote_and_read(keys, waiting)
        assert all(loaded.data[k] == engine.payloads[k] for k in keys)


def test_reset_cache_drains_every_job_and_keeps_memkv_contents(memkv_env):
    with h.HeadlessEngine([memkv()], h.Geometry(num_rows=16)) as engine:
        keys = h.make_keys(8)
        req = engine.new_request()
        engine.store_chunks(req, keys)
        engine.finish_request(req)
        engine.reset_cache()  # drain_jobs must block until every cascade is reportable
        assert in_memkv(engine, keys) == [True] * 8
        assert not engine.has_pending_work()
        loaded = engine.promote_and_read(keys[:4])
        assert all(loaded.data[k] == engine.payloads[k] for k in keys[:4])


# -------------------------------------------------------------------------------------------------
# Failure isolation
# -------------------------------------------------------------------------------------------------


def _sigstop(node: LocalNode, timeout_s: float = 5.0) -> None:
    """SIGSTOP a node and wait until every one of its threads is stopped: kill() returns before
    the group stop completes, and until then a thread may still answer (seen with the RDMA
    transport, whose nodes run NIXL's threads too)."""
    import os

    node.signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{node.pid}/task"):
            try:
                with open(f"/proc/{node.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"node {node.address} did not stop within {timeout_s}s")


def _keys_by_owner(engine: h.HeadlessEngine, n: int, nodes) -> dict[str, list]:
    tier = tier_of(engine)
    owners: dict[str, list] = {node.address: [] for node in nodes}
    keys = h.make_keys(n)
    for key in keys:
        owners[tier.client.owner(tier.namespace.key(key)).name].append(key)
    return owners


@pytest.mark.over_tls_too
def test_killed_node_degrades_its_keys_to_miss_and_the_rest_still_promote(monkeypatch, private_cluster, auth_key_hex):
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    deadline_s = 2.0
    with h.HeadlessEngine([memkv({"lookup_timeout_s": deadline_s})], h.Geometry(num_rows=16)) as engine:
        owners = _keys_by_owner(engine, 12, private_cluster)
        dead, alive = private_cluster
        doomed, surviving = owners[dead.address], owners[alive.address]
        assert doomed and surviving
        store_and_settle(engine, doomed + surviving)
        engine.fill_pool_to_evict(doomed + surviving)
        dead.kill()

        trace = engine.lookup_until_resolved(doomed, engine.new_request(), max_steps=5000, timeout_s=deadline_s + 5)
        assert trace.resolved and trace.final == (LookupResult.MISS,) * len(doomed)
        assert trace.elapsed_s < deadline_s + 2.0
        loaded = engine.promote_and_read(surviving[:4])
        assert all(loaded.data[k] == engine.payloads[k] for k in surviving[:4])


@pytest.mark.over_tls_too
def test_stalled_node_lookups_resolve_miss_within_lookup_timeout(monkeypatch, private_cluster, auth_key_hex):
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    deadline_s = 1.0
    with h.HeadlessEngine([memkv({"lookup_timeout_s": deadline_s})], h.Geometry(num_rows=16)) as engine:
        owners = _keys_by_owner(engine, 12, private_cluster)
        stalled, healthy = private_cluster
        store_and_settle(engine, owners[stalled.address] + owners[healthy.address])
        engine.fill_pool_to_evict(owners[stalled.address])
        totals: dict = {}
        memkv_stats(engine, totals)
        _sigstop(stalled)
        try:
            started = time.monotonic()
            trace = engine.lookup_until_resolved(
                owners[stalled.address], engine.new_request(), max_steps=5000, timeout_s=10
            )
            took = time.monotonic() - started
            assert trace.resolved, f"lookups still pending after {took:.1f}s: {trace.summary(0)}"
            assert trace.final == (LookupResult.MISS,) * len(owners[stalled.address])
            assert took < deadline_s + 1.5, f"a stalled node held lookups for {took:.2f}s"
            memkv_stats(engine, totals)
            assert totals.get(("vllm:kv_offload_memkv_lookups", ("timeout", "tier")), 0) >= 1
        finally:
            stalled.signal(signal.SIGCONT)


def test_stalled_node_without_deadline_keeps_answering_retry(monkeypatch, private_cluster, auth_key_hex):
    """The negative control: with lookup_timeout_s <= 0 the tier waits for the probe, as an
    unguarded tier would, so the deadline above is what resolves the stall."""
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    with h.HeadlessEngine([memkv({"lookup_timeout_s": 0})], h.Geometry(num_rows=16)) as engine:
        owners = _keys_by_owner(engine, 12, private_cluster)
        stalled = private_cluster[0]
        _sigstop(stalled)
        try:
            trace = engine.lookup_until_resolved(
                owners[stalled.address], engine.new_request(), max_steps=5000, timeout_s=1.5
            )
            assert not trace.resolved and set(trace.final) == {LookupResult.RETRY}
        finally:
            stalled.signal(signal.SIGCONT)


def _nice_of_threads(prefix: str) -> set[int]:
    return {
        os.getpriority(os.PRIO_PROCESS, t.native_id)
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.native_id is not None
    }


@pytest.mark.parametrize("store_nice", [None, 0, 5])
def test_store_threads_yield_the_cpu_by_store_nice_and_loads_keep_the_engines_priority(
    memkv_env, no_leaked_regions, store_nice
):
    """The tier's write threads run at store_nice (default 10) above the engine's nice, its read
    threads at the engine's; blocks stored and promoted through those threads stay byte-exact."""
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    extra = {} if store_nice is None else {"store_nice": store_nice}
    with h.HeadlessEngine([memkv(extra)], h.Geometry(num_rows=8)) as engine:
        keys = h.make_keys(4)
        store_and_settle(engine, keys)
        engine.fill_pool_to_evict(keys)
        loaded = engine.promote_and_read(keys)
        assert all(loaded.data[k] == engine.payloads[k] for k in keys)
        want = engine_nice + (10 if store_nice is None else store_nice)
        assert _nice_of_threads("memkv-store-") == {min(19, want)}
        assert _nice_of_threads("memkv-load-") == {engine_nice}


def test_step_end_never_waits_while_a_lookup_is_pending_and_the_tier_threads_get_the_gil(
    monkeypatch, private_cluster, auth_key_hex
):
    """vLLM runs on_schedule_end on its scheduler loop and expects it not to block. With a node
    stopped (no deadline), lookups of its keys stay pending step after step, and no step end
    makes a waiting call (WaitingCalls: a profile hook of the scheduler thread, no timing).
    What a sleep there once bought is kept without waiting: while the lookup is pending the
    switch interval is step_yield_ms, so the tier's threads get the GIL within it of asking
    (memkv_vllm/gil.py); once the lookup resolved, the step end puts the interval back."""
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    before = sys.getswitchinterval()
    with h.HeadlessEngine([memkv({"lookup_timeout_s": 0, "step_yield_ms": 0.5})], h.Geometry(num_rows=16)) as engine:
        owners = _keys_by_owner(engine, 12, private_cluster)
        stalled = private_cluster[0]
        keys = owners[stalled.address]
        req = engine.new_request()
        _sigstop(stalled)
        try:
            for _ in range(3):
                with engine.lock:
                    assert {engine.manager.lookup(k, req) for k in keys} == {LookupResult.RETRY}
                    with WaitingCalls() as waits:
                        engine.end_step_locked()
                assert waits.calls == [], f"the step end waited: {waits.calls}"
                assert tier_of(engine).has_pending_work()
                assert sys.getswitchinterval() == pytest.approx(0.0005)
        finally:
            stalled.signal(signal.SIGCONT)
        trace = engine.lookup_until_resolved(keys, req, max_steps=5000, timeout_s=20)
        assert trace.resolved and set(trace.final) == {LookupResult.MISS}  # never stored
        engine.step()
        assert sys.getswitchinterval() == before


@pytest.mark.skipif(not compat.HAS_DEFERRED_RELEASE, reason="vLLM 0.34+: JobResult.deferred_release")
def test_promotion_stalled_on_a_stopped_node_misses_at_the_deadline_and_its_row_waits_for_the_read(
    monkeypatch, private_cluster, auth_key_hex, tmp_path
):
    """vLLM 0.34+: the node stops after the lookup said HIT, before the load is sent. The load's
    socket read then blocks (the client's io_timeout_s is a minute), yet the key turns MISS at
    lookup_timeout_s while the node is still stopped, and the row the promotion had is held out
    of the pool (vLLM's deferred release) until the read has ended: rows handed out meanwhile
    never receive the late value. Before 0.34 the request waited for the read (io_timeout_s)."""
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    config = tmp_path / "client.yaml"
    config.write_text("io_timeout_s: 60\n")  # the read outlives the whole test unless the node resumes
    monkeypatch.setenv("MEMKV_CONFIG", str(config))
    memkv_vllm.register()
    deadline_s = 1.0
    geometry = h.Geometry(num_rows=16)
    with h.HeadlessEngine([memkv({"lookup_timeout_s": deadline_s})], geometry) as engine:
        stalled = private_cluster[0]
        key = _keys_by_owner(engine, 12, private_cluster)[stalled.address][0]
        store_and_settle(engine, [key])
        engine.fill_pool_to_evict([key])
        tier = tier_of(engine)
        load_rows: list[int] = []
        real_submit = tier.submit_load

        def spy_submit(job):
            load_rows.extend(int(s) for s in compat.job_slot_ids(job))
            return real_submit(job)

        monkeypatch.setattr(tier, "submit_load", spy_submit)
        req = engine.new_request()
        resumed = False
        try:
            for _ in range(2000):  # until the promotion is queued: stop the node before it is sent
                with engine.lock:
                    queued = engine.manager.lookup(key, req) is LookupResult.HIT_PENDING
                    if queued:
                        _sigstop(stalled)
                    engine.end_step_locked()  # submits the promotion when queued
                if queued:
                    break
                time.sleep(0.005)
            assert queued and len(load_rows) == 1, "no promotion was submitted"
            trace = engine.lookup_until_resolved([key], req, max_steps=5000, timeout_s=deadline_s + 10)
            assert trace.resolved and trace.final == (LookupResult.MISS,), trace.summary(0)
            # Still stopped, the read still blocked: vLLM holds the row until the tier releases it.
            assert engine.manager.primary_tier.num_deferred_release_chunks == 1
            filler = engine.new_request()
            fillers = h.make_keys(geometry.num_rows - 1, tag=f"after-miss/{filler.req_id}")
            outcome = engine.store_chunks(filler, fillers)
            assert load_rows[0] not in outcome.rows.values(), "the held row was handed out"
            stalled.signal(signal.SIGCONT)  # the late value lands now, in the held row only
            resumed = True
            engine.finish_request(filler)
            engine.run_until_idle(timeout_s=30)
            assert engine.manager.primary_tier.num_deferred_release_chunks == 0
            for k, row in outcome.rows.items():
                assert engine.read_row(row) == engine.payloads[k], f"row {row} changed after it was handed out"
        finally:
            if not resumed:
                stalled.signal(signal.SIGCONT)


def test_value_deleted_between_lookup_and_load_fails_only_that_promotion(memkv_env, monkeypatch):
    with h.HeadlessEngine([memkv()], h.Geometry(num_rows=16)) as engine:
        keys = h.make_keys(3)
        store_and_settle(engine, keys)
        engine.fill_pool_to_evict(keys)
        tier = tier_of(engine)
        gone, kept = keys[0], keys[1:]
        totals = memkv_stats(engine, {})
        # The node evicts `gone` after the lookup said HIT, just before the load reads it.
        real_load = tier._load_task

        def evict_then_load(offload_keys, slots):
            tier.client.delete([tier.namespace.key(gone)])
            return real_load(offload_keys, slots)

        monkeypatch.setattr(tier, "_load_task", evict_then_load)
        req = engine.new_request()
        first = engine.lookup_until_resolved(keys, req, max_steps=2000)
        engine.run_until_idle(timeout_s=20)
        trace = engine.lookup_until_resolved(keys, req, max_steps=2000)

        assert first.resolved and trace.resolved
        assert trace.final[0] is LookupResult.MISS, trace.summary(0)  # remembered as a miss: no loop
        for _ in range(5):  # further steps start no new load of the failed key
            engine.step()
        memkv_stats(engine, totals)
        assert totals.get(("vllm:kv_offload_memkv_jobs_failed", ("load", "tier")), 0) == 1
        loaded = engine.promote_and_read(kept, req, max_steps=2000)  # the others still promote
        assert all(loaded.data[k] == engine.payloads[k] for k in kept)


def test_unloadable_value_is_purged_so_it_recomputes_once(memkv_env):
    """A value of another length under the key (e.g. another slot stride) fails the load and is
    deleted from MemKV, so the block recomputes and re-stores instead of failing again."""
    with h.HeadlessEngine([memkv()], h.Geometry(num_rows=16)) as engine:
        keys = h.make_keys(2)
        store_and_settle(engine, keys)
        engine.fill_pool_to_evict(keys)
        tier = tier_of(engine)
        bad = tier.namespace.key(keys[0])
        tier.client.put(bad, b"x" * 1000)
        req = engine.new_request()
        trace = engine.lookup_until_resolved(keys, req)
        deadline = time.monotonic() + 10
        while tier.client.exists([bad])[0] and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.01)
        assert tier.client.exists([bad]) == [False], "the unloadable value was not purged"
        engine.run_until_idle()
        trace = engine.lookup_until_resolved(keys, req)
        assert trace.final[0] is LookupResult.MISS


def test_store_jobs_are_admitted_whole_and_a_shed_request_keeps_only_its_prefix(
    monkeypatch, private_cluster, auth_key_hex
):
    # Rows of ~600 KB and a 1 MiB backlog. The nodes are stopped while the first jobs are
    # submitted, so request a's first job (1.8 MB, admitted whole: the backlog was empty) is
    # still in flight when b's first job comes: b is shed whole, and stays cut afterwards even
    # with an empty backlog, while a keeps storing: each request holds a prefix of its jobs.
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    geometry = h.Geometry(worker_kv_bytes_per_block=300_000, num_rows=16)
    keys = h.make_keys(8)
    with h.HeadlessEngine([memkv({"max_store_backlog_mb": 1, "blocks_per_op": 1})], geometry) as engine:
        a, b = engine.new_request(), engine.new_request()
        for node in private_cluster:
            node.signal(signal.SIGSTOP)
        try:
            engine.store_chunks(a, keys[0:3])
            engine.store_chunks(b, keys[3:5])
            engine.step()  # 0.29+ submits the cascades of the step here
        finally:
            for node in private_cluster:
                node.signal(signal.SIGCONT)
        engine.run_until_idle(timeout_s=20)
        engine.store_chunks(b, keys[5:6])
        engine.store_chunks(a, keys[6:8])
        engine.step()
        engine.run_until_idle(timeout_s=20)
        assert in_memkv(engine, keys) == [True] * 3 + [False] * 3 + [True] * 2
        totals = memkv_stats(engine, {})
        assert totals[("vllm:kv_offload_memkv_sheds", ("tier",))] == 3
        assert ("vllm:kv_offload_memkv_jobs_failed", ("store",)) not in totals


def test_with_the_default_backlog_a_prompt_of_half_the_pool_is_stored_whole_while_nothing_drains(
    monkeypatch, private_cluster, auth_key_hex
):
    # No max_store_backlog_mb: the bound is half the CPU pool (16 rows -> 8). The nodes are
    # stopped, so nothing drains while the prompt's four jobs of two rows arrive.
    import memkv_vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    memkv_vllm.register()
    geometry = h.Geometry(worker_kv_bytes_per_block=300_000, num_rows=16)
    keys = h.make_keys(10)
    with h.HeadlessEngine([memkv({"blocks_per_op": 1})], geometry) as engine:
        req = engine.new_request()
        for node in private_cluster:
            node.signal(signal.SIGSTOP)
        try:
            for lo in range(0, 10, 2):  # one job per scheduler step, as vLLM's connector makes them
                engine.store_chunks(req, keys[lo : lo + 2])
                engine.step()
        finally:
            for node in private_cluster:
                node.signal(signal.SIGCONT)
        engine.run_until_idle(timeout_s=20)
        # 8 rows = half the pool are kept; the fifth job would take the backlog past it.
        assert in_memkv(engine, keys) == [True] * 8 + [False] * 2
        assert memkv_stats(engine, {})[("vllm:kv_offload_memkv_sheds", ("tier",))] == 2


def test_promotions_are_never_shed(memkv_env):
    geometry = h.Geometry(worker_kv_bytes_per_block=300_000, num_rows=8)
    keys = h.make_keys(4)
    with h.HeadlessEngine([memkv()], geometry) as writer:
        store_and_settle(writer, keys)
    with h.HeadlessEngine([memkv({"max_store_backlog_mb": 1, "blocks_per_op": 1})], geometry) as engine:
        loaded = engine.promote_and_read(keys)
        assert len(loaded.data) == 4
        assert ("vllm:kv_offload_memkv_sheds", ("tier",)) not in memkv_stats(engine, {})


# -------------------------------------------------------------------------------------------------
# Metrics, configuration, startup
# -------------------------------------------------------------------------------------------------


def test_every_emitted_metric_is_declared_with_its_label_arity(memkv_env):
    from memkv_vllm import metrics as tm
    from memkv_vllm.tier import MemKVSecondaryTierManager

    definitions = MemKVSecondaryTierManager.build_metric_definitions({"type": "memkv"})
    assert set(definitions) == {tm.STORE_BYTES, tm.LOAD_BYTES, tm.JOB_SECONDS, tm.JOBS_FAILED, tm.SHEDS, tm.LOOKUPS}
    with h.HeadlessEngine([memkv()], h.Geometry(num_rows=8)) as engine:
        keys = h.make_keys(4)
        store_and_settle(engine, keys)
        engine.fill_pool_to_evict(keys)
        engine.promote_and_read(keys)
        engine.lookup_until_resolved(h.make_keys(1), engine.new_request())
        emitted = memkv_stats(engine, {})
    names = {name for name, _ in emitted}
    assert {tm.STORE_BYTES, tm.LOAD_BYTES, tm.JOB_SECONDS, tm.LOOKUPS} <= names
    for name, labels in emitted:
        assert name in definitions, f"{name} emitted but not declared"
        assert len(labels) == len(definitions[name].labelnames), f"{name}{labels} vs {definitions[name].labelnames}"
        assert labels[-1] == "tier" and definitions[name].labelnames[-1] == "mode"
    assert emitted[(tm.LOOKUPS, ("hit", "tier"))] == 4 and emitted[(tm.LOOKUPS, ("miss", "tier"))] >= 1


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"n_read_thread": 8}, "n_read_thread"),
        ({"blocks_per_op": 0}, "blocks_per_op"),
        ({"lookup_timeout_s": "5"}, "lookup_timeout_s"),
        ({"max_store_backlog_mb": True}, "max_store_backlog_mb"),
        ({"load_failure_grace_s": -1}, "load_failure_grace_s"),
        ({"store_nice": 20}, "store_nice"),
    ],
)
def test_bad_tier_key_fails_at_construction_naming_it(memkv_env, no_leaked_regions, bad, name):
    with pytest.raises(Exception) as info:
        h.HeadlessEngine([memkv(bad)])
    assert name in str(info.value)


def test_wrong_auth_key_fails_startup_naming_server_and_cause(monkeypatch, cluster, no_leaked_regions):
    import memkv_vllm

    point_at(monkeypatch, cluster, "ab" * 32)
    memkv_vllm.register()
    with pytest.raises(Exception) as info:
        h.HeadlessEngine([memkv()])
    message = str(info.value)
    assert cluster[0].address in message and "MEMKV_AUTH_KEY" in message
    assert "ab" * 32 not in message


def test_unreachable_server_fails_startup_naming_it(monkeypatch, cluster, auth_key_hex, no_leaked_regions):
    import memkv_vllm

    dead = LocalNode(auth_key_hex, capacity="64MiB")
    dead.stop()
    point_at(monkeypatch, [*cluster, dead], auth_key_hex)  # one bad entry among good ones
    memkv_vllm.register()
    with pytest.raises(Exception) as info:
        h.HeadlessEngine([memkv()])
    assert dead.address in str(info.value) and "MEMKV_SERVERS" in str(info.value)


def test_node_value_limit_below_row_size_fails_startup(monkeypatch, auth_key_hex, no_leaked_regions):
    import memkv_vllm

    small = LocalNode(auth_key_hex, capacity="64MiB", extra_args=["--max-value-size", "8KiB"])
    try:
        point_at(monkeypatch, [small], auth_key_hex)
        memkv_vllm.register()
        with pytest.raises(Exception) as info:
            h.HeadlessEngine([memkv()], h.Geometry(world_size=1))
        assert "--max-value-size" in str(info.value)
    finally:
        small.stop()


def test_module_path_form_loads_the_tier_without_registration(monkeypatch, cluster, auth_key_hex):
    import inspect

    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if "module_path" not in inspect.getsource(SecondaryTierFactory.get_tier_class):
        pytest.skip("module_path fallback exists from vLLM 0.28.0")
    point_at(monkeypatch, cluster, auth_key_hex)
    tier = {
        "type": "MemKVSecondaryTierManager",
        "module_path": "memkv_vllm.tier",
        "n_read_threads": 2,
        "n_write_threads": 2,
    }
    with h.HeadlessEngine([tier]) as engine:
        keys = h.make_keys(2)
        store_and_settle(engine, keys)
        assert in_memkv(engine, keys) == [True, True]


def test_ready_line_says_the_settings_in_force_and_which_receive_loop_runs(memkv_env):
    """What an operator reads to know what runs: the settings (given and defaulted), the
    transport, and whether the compiled receive-and-verify loop is in use."""
    with PluginLog() as log, h.HeadlessEngine([memkv({"blocks_per_op": 4})], h.Geometry(num_rows=8)) as engine:
        rdma = tier_of(engine).client.has_rdma()  # True in the conformance-rdma session
        servers = len(tier_of(engine).client.servers())
        shared = len(tier_of(engine).client.shared_memory_servers())
    (line,) = [x for x in log.lines if x.startswith("MemKV tier ready")]
    # Nodes on this host are each reached over its same-host socket by default; nodes on other
    # hosts (MEMKV_TEST_TOPOLOGY=remote) over TCP alone, shared memory included.
    local = 0 if REMOTE else servers
    if REMOTE:
        assert shared == 0
    for field in (
        "n_read_threads=2",
        "n_write_threads=2",
        "blocks_per_op=4",
        f"rdma={rdma},",
        f"same_host={local}/{servers},",
        f"shared_memory={shared}/{servers},",
        "(half the CPU pool)",
        "store_nice=10",
        f"memkv={memkv_version}",
    ):
        assert field in line, f"{field!r} missing from: {line}"
    assert f"receive={'compiled' if sockio.COMPILED_RECEIVE else 'python'}," in line


def test_ready_line_names_the_vllm_release_and_that_it_is_qualified(memkv_env):
    import vllm

    with PluginLog() as log, h.HeadlessEngine([memkv()], h.Geometry(num_rows=8)):
        pass
    (line,) = [x for x in log.lines if x.startswith("MemKV tier ready")]
    assert line.endswith(f"vllm={vllm.__version__} (qualified))"), line
    assert not [x for x in log.lines if "compat_matrix.py" in x]


def test_newer_vllm_release_starts_with_one_warning_naming_the_matrix_script(memkv_env, monkeypatch):
    """A release after the qualified ones is never refused: the tier starts, says so in its
    ready line, and one WARNING per process (not per engine) names scripts/compat_matrix.py."""
    import vllm

    from memkv_vllm import release

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(release, "_warned", False)
    with PluginLog() as log:
        for _ in range(2):
            with h.HeadlessEngine([memkv()], h.Geometry(num_rows=8)) as engine:
                loaded = engine.promote_and_read(_stored(engine, 1))
                assert all(loaded.data[k] == engine.payloads[k] for k in loaded.data)
    ready = [x for x in log.lines if x.startswith("MemKV tier ready")]
    assert len(ready) == 2 and all(x.endswith("vllm=0.99.0 (not qualified))") for x in ready), ready
    (warning,) = [x for x in log.lines if "compat_matrix.py" in x]
    assert "0.99.0" in warning and "0.25.0-0.34.0" in warning


def _stored(engine: h.HeadlessEngine, n: int) -> list:
    keys = h.make_keys(n)
    store_and_settle(engine, keys)
    engine.fill_pool_to_evict(keys)
    return keys


def test_hash_seed_warning_depends_on_pythonhashseed(monkeypatch):
    from memkv_vllm import compat

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert compat.block_hash_reuse_problem() is None
    monkeypatch.delenv("PYTHONHASHSEED")
    problem = compat.block_hash_reuse_problem()
    utils = sys.modules.get("vllm.v1.core.kv_cache_utils")
    if (
        utils is not None
        and hasattr(utils, "resolve_none_hash_seed")
        and getattr(utils, "_NONE_HASH_SEED", None) in (None, getattr(utils, "DEFAULT_NONE_HASH_SEED", None))
    ):
        assert problem is None  # 0.33+: sha256 hashes use a fixed default seed
    else:
        assert problem is not None and "PYTHONHASHSEED" in problem


def test_client_for_tests_sees_what_the_tier_stored(memkv_env, auth_key_hex):
    """The tier's keys are plain MemKV keys: any client with the key can inspect them."""
    with h.HeadlessEngine([memkv()]) as engine:
        keys = h.make_keys(1)
        store_and_settle(engine, keys)
        namespaced = tier_of(engine).namespace.key(keys[0])
    config = ClientConfig(
        servers=parse_servers(",".join(n.address for n in memkv_env), "test"),
        auth_key=AuthKey.from_hex(auth_key_hex, "test"),
    )
    with Client(config) as client:
        assert client.exists([namespaced]) == [True]
