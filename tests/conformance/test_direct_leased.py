"""Direct mode with load_guarantee "leased" (opt-in), through vLLM's real connector.

A lookup HIT is a lease on every rank's value; each worker streams its rank's values through
its ring of staging slots. Asserted with real `memkv serve` nodes and CPU tensors for the GPU:

* a prompt whose KV is 8x (TP=1) or 16x (TP=2) the staging region -- everything else at its
  default -- is stored whole (nothing shed, store jobs larger than the region) and loaded whole,
  byte-exact, by a restarted engine;
* a value the node would evict under memory pressure survives while it is leased: the load
  after the pressure is byte-exact;
* a node killed between the lookup and the load, or restarted empty (the value lost despite its
  lease): the worker retries for load_retry_s, then the load fails and no byte of that node's
  chunks reaches the GPU tensors. vLLM 0.34+: the job is reported failed, the request is
  recomputed (kv_load_failure_policy "recompute"; "fail" ends only that request with an error)
  and the engine goes on, loading the next request's reachable prefix byte-exact. Before 0.34
  (vLLM asserts every job's success) the engine fails loudly with an error naming the node and
  the key;
* a node stalled (SIGSTOP) between the lookup and the load that comes back within the retry
  window: the load succeeds, byte-exact;
* a corrupt value (a byte flipped on its way into the node): it never reaches the GPU tensors,
  the load fails as above (0.34+: the request recomputes; before: the engine fails loudly naming
  it), and the value is purged (a restarted engine recomputes from that chunk on);
* vLLM's `reset_prefix_cache(reset_connector=True)` with a leased load in flight (its node
  stalled): the flushed load completes byte-exact, its leases stay fenced until it is done
  (0.33: on_reset_flushed; earlier: a few steps) and are released after it, none leaks.

Every loop is bounded by the harness (steps and wall time); no assert on a duration.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest
import torch
from vllm.v1.request import RequestStatus

from memkv_vllm import compat
from memkv_vllm import metrics as tm
from memkv_vllm.direct.streaming import LoadFailed
from tests.conformance import direct_harness as dh
from tests.conformance.conftest import point_at
from tests.conformance.test_memkv_tier import _sigstop
from tests.faults.nodeops import NO_LOCAL_SOCKET, metric_value, metrics_of
from tests.faults.proxy import FaultProxy, FlipNextPut

pytestmark = pytest.mark.conformance

BIG = 256  # tokens per chunk: 16 GPU blocks, one value is 128 KiB, a 1 MiB region holds 8 (TP=1) or 4 slots (TP=2)
N_CHUNKS = 8


REPORTS_FAILED_LOADS = compat.load_failure_reportable()  # vLLM 0.34+


def _zero_blocks(engine: dh.DirectEngine, req: dh.Request, chunks: range, ranks: list[int] | None = None) -> bool:
    """True when no byte was written into the GPU blocks of these chunks, on every rank of
    `ranks` (default: all; the blocks of the failed load where there was one: a recomputing
    request has fresh ones)."""
    g = engine.g
    block_ids = req.failed_block_ids or req.block_ids
    for rank in range(g.world_size) if ranks is None else ranks:
        for c in chunks:
            for b in range(c * g.blocks_per_chunk, (c + 1) * g.blocks_per_chunk):
                for layer in range(dh.NUM_LAYERS):
                    if torch.count_nonzero(engine.kv[rank][layer][block_ids[b]]):
                        return False
    return True


def _fails_then_engine_goes_on(engine: dh.DirectEngine, req: dh.Request, what: str) -> str | None:
    """Run `req`, whose load will fail, to its end. 0.34+: the request is recomputed and finishes
    normally (None). Before 0.34: the engine stops with LoadFailed (its message)."""
    if not REPORTS_FAILED_LOADS:
        with pytest.raises(LoadFailed) as info:
            engine.run_until(lambda: req.is_finished(), timeout_s=60, what=what)
        return str(info.value)
    engine.run_until(lambda: req.is_finished(), timeout_s=60, what=what)
    assert engine.failed_loads == [req.request_id]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, req  # recomputed, not an error
    assert req.num_output_tokens == req.max_tokens
    return None


def _owned_by(engine: dh.DirectEngine, tag: str, n: int) -> list[set[str]]:
    m = engine.manager
    return [{m.client.owner(vk).name for vk in m.keys.value_keys(k)} for k in dh.prompt_keys(tag, n, engine.g)]


def _owned_by_rank(engine: dh.DirectEngine, tag: str, chunk: int) -> list[str]:
    """The node of each rank's value of one chunk of prompt `tag`."""
    m = engine.manager
    key = dh.prompt_keys(tag, chunk + 1, engine.g)[chunk]
    return [m.client.owner(vk).name for vk in m.keys.value_keys(key)]


def _tag_with_chunk_on(engine: dh.DirectEngine, node: str, n: int = N_CHUNKS) -> tuple[str, int]:
    """A prompt whose chunk 0 is not on `node` and some later chunk is (bounded search)."""
    for _ in range(500):
        tag = uuid.uuid4().hex
        owners = _owned_by(engine, tag, n)
        first = next((c for c, o in enumerate(owners) if node in o), None)
        if first is not None and first >= 1:
            return tag, first
    raise AssertionError("no suitable prompt in 500 tags")


@pytest.mark.parametrize("world_size", [1, 2])
def test_prompt_8x_the_staging_region_is_stored_and_loaded_whole_byte_exact(
    monkeypatch, cluster, auth_key_hex, world_size
):
    point_at(monkeypatch, cluster, auth_key_hex)
    g = dh.Geometry(world_size=world_size, block_size=BIG, num_gpu_blocks=1100)
    n_chunks = 64  # 64 x 128 KiB per rank: 8 MiB (TP=1) / 16 MiB (TP=2) through a 1 MiB region
    tokens = n_chunks * BIG + 7
    config = dh.direct_config(
        staging_mb=1, block_size=BIG, load_guarantee="leased"
    )  # only the region shrunk (and the ratio kept)
    with dh.DirectEngine(g, config, token_budget=4096) as engine:  # store jobs of 16 chunks > the region
        assert engine.manager.layout.num_slots * engine.manager.layout.slot_bytes <= 1 << 20
        engine.run(tag := uuid.uuid4().hex, tokens, timeout_s=120)
        assert engine.stat(tm.SHEDS, ("direct",)) == 0
        m = engine.manager
        present = m.client.exists([vk for k in dh.prompt_keys(tag, n_chunks, g) for vk in m.keys.value_keys(k)])
        assert all(present), f"{present.count(False)} of {len(present)} values missing"
    with dh.DirectEngine(g, config, token_budget=4096) as restarted:
        again = restarted.run(tag, tokens, timeout_s=120)
        assert again.matched_tokens == n_chunks * BIG
        assert again.loaded_blocks == n_chunks * g.blocks_per_chunk  # byte-exact on every rank (harness)
        assert restarted.stat(tm.LOAD_BYTES, ("direct",)) == n_chunks * world_size * g.value_bytes
        assert not restarted.manager._held, "every lease is released after the load"


def test_leased_value_survives_memory_pressure_that_evicts_everything_else(monkeypatch, start_node, auth_key_hex):
    node = start_node(capacity="4MiB", extra_args=["--max-value-size", "1MiB"])
    point_at(monkeypatch, [node], auth_key_hex)
    g = dh.Geometry()
    tag, bystander = uuid.uuid4().hex, uuid.uuid4().hex
    tokens = N_CHUNKS * g.block_size + 3
    flooded = []

    def flood(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        c = engine.manager.client
        if req.tag == tag and not flooded:  # after the HIT (leased), before the load
            for i in range(48):  # 3x the node's capacity
                c.put(f"flood/{i}", bytes([i]) * (256 << 10))
            flooded.append(True)

    with dh.DirectEngine(g) as engine:
        engine.run(tag, tokens)
        engine.run(bystander, tokens)  # stored after `tag`: evicted first if leases did nothing
    with dh.DirectEngine(g, before_alloc=flood) as engine:
        again = engine.run(tag, tokens)
        assert flooded
        assert again.matched_tokens == N_CHUNKS * g.block_size
        assert again.loaded_blocks == N_CHUNKS * g.blocks_per_chunk  # byte-exact (harness)
        m = engine.manager
        unleased = [m.keys.value_key(k, 0) for k in dh.prompt_keys(bystander, N_CHUNKS, g)]
        assert not any(m.client.exists(unleased)), "the pressure should have evicted the unleased prompt"


def test_node_killed_between_lookup_and_load_fails_the_load_not_the_engine_on_034(
    monkeypatch, private_cluster, auth_key_hex
):
    point_at(monkeypatch, private_cluster, auth_key_hex)
    g = dh.Geometry()
    _healthy, doomed = private_cluster
    tokens = N_CHUNKS * g.block_size + 3
    config = dh.direct_config(load_retry_s=1.0, blocks_per_op=1, load_guarantee="leased")

    def kill(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        if matched and doomed.proc.poll() is None:
            doomed.kill()

    with dh.DirectEngine(g, config) as engine:
        tag, first = _tag_with_chunk_on(engine, doomed.address)
        engine.run(tag, tokens)
        engine.before_alloc = kill
        req = engine.add_request(tag, tokens)
        message = _fails_then_engine_goes_on(engine, req, "the failing load")
        if message is not None:
            assert doomed.address in message and "load_retry_s" in message and "/r0" in message
        assert req.matched_tokens == N_CHUNKS * g.block_size  # the HIT the connector committed to
        assert _zero_blocks(engine, req, range(first, first + 1)), "bytes of the dead node's chunk reached the GPU"
        if REPORTS_FAILED_LOADS:  # the same engine serves on: the live node's prefix loads byte-exact
            again = engine.run(tag, tokens, timeout_s=60)
            assert again.matched_tokens == first * g.block_size
            assert again.loaded_blocks == first * g.blocks_per_chunk and engine.failed_loads == [req.request_id]


@pytest.mark.skipif(
    not REPORTS_FAILED_LOADS,
    reason="vLLM < 0.34 cannot take a failed load (the node-killed test covers its loud failure)",
)
@pytest.mark.parametrize(("policy", "world_size"), [("recompute", 1), ("fail", 1), ("recompute", 2)])
def test_value_lost_between_lookup_and_load_recomputes_or_fails_only_that_request(
    monkeypatch, private_cluster, auth_key_hex, policy, world_size
):
    """The node restarts empty on its port after the HIT: the lease and the value are gone, every
    fetch answers MISS. 0.34: "recompute" recomputes the request; "fail" (vLLM's default) ends
    it with FINISHED_ERROR. Either way no byte of the lost chunk reaches the GPU and the engine
    serves the next request, loading what is still stored byte-exact. TP=2: the ranks whose value
    is on the other node load theirs; the request's job fails because one rank's part failed."""
    from tests.faults.nodeops import restart_empty

    point_at(monkeypatch, private_cluster, auth_key_hex)
    g = dh.Geometry(world_size=world_size)
    _healthy, lossy = private_cluster
    tokens = N_CHUNKS * g.block_size + 3
    config = dh.direct_config(load_retry_s=1.0, blocks_per_op=1, load_guarantee="leased")
    restarted: list = []

    def lose(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        if matched and not restarted:
            restarted.append(restart_empty(lossy))

    try:
        with dh.DirectEngine(g, config, load_failure_policy=policy) as engine:
            tag, first = _tag_with_chunk_on(engine, lossy.address)
            engine.run(tag, tokens)
            engine.before_alloc = lose
            req = engine.add_request(tag, tokens)
            engine.run_until(lambda: req.is_finished(), timeout_s=60, what="the failing load")
            engine.before_alloc = None
            assert restarted and engine.failed_loads == [req.request_id]
            assert req.matched_tokens == N_CHUNKS * g.block_size
            owners = _owned_by_rank(engine, tag, first)
            lost_ranks = [r for r, o in enumerate(owners) if o == lossy.address]
            assert _zero_blocks(engine, req, range(first, first + 1), lost_ranks), (
                "bytes of a lost value reached the GPU"
            )
            if policy == "recompute":
                assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens == 1
            else:
                assert req.status == RequestStatus.FINISHED_ERROR and req.num_output_tokens == 0
            again = engine.run(tag, tokens, timeout_s=60)  # the lost chunk was stored again or misses
            assert again.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert again.matched_tokens >= first * g.block_size
            assert again.loaded_blocks == again.matched_tokens // g.gpu_block_size  # byte-exact (harness)
            assert engine.failed_loads == [req.request_id]
    finally:
        for node in restarted:
            node.stop()


def test_stalled_node_back_within_the_retry_window_loads_byte_exact(
    monkeypatch, private_cluster, auth_key_hex, tmp_path
):
    point_at(monkeypatch, private_cluster, auth_key_hex)
    cfg = tmp_path / "memkv.yaml"
    cfg.write_text("io_timeout_s: 0.5\ndown_for_s: 0.2\n")
    monkeypatch.setenv("MEMKV_CONFIG", str(cfg))
    g = dh.Geometry()
    _healthy, stalled = private_cluster
    tokens = N_CHUNKS * g.block_size + 3
    resumed = threading.Event()

    def stall(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        if matched and not resumed.is_set() and not stall.timer:
            _sigstop(stalled)
            stall.timer = threading.Timer(1.5, lambda: (stalled.signal(signal.SIGCONT), resumed.set()))
            stall.timer.start()

    stall.timer = None
    with dh.DirectEngine(g, dh.direct_config(load_retry_s=30.0, load_guarantee="leased")) as engine:
        tag, _ = _tag_with_chunk_on(engine, stalled.address)
        engine.run(tag, tokens)
        engine.before_alloc = stall
        try:
            again = engine.run(tag, tokens, timeout_s=60)
        finally:
            if stall.timer is not None:
                stall.timer.join(10)
            stalled.signal(signal.SIGCONT)
        assert resumed.is_set()
        assert again.matched_tokens == N_CHUNKS * g.block_size
        assert again.loaded_blocks == N_CHUNKS * g.blocks_per_chunk  # byte-exact (harness)
        assert engine.workers[0].connector_worker.worker._streams.retries >= 1


def test_corrupt_value_never_reaches_the_gpu_fails_the_load_and_is_purged(monkeypatch, start_node, auth_key_hex):
    node = start_node(capacity="64MiB", extra_args=[NO_LOCAL_SOCKET])
    plan = FlipNextPut(offset=100)  # a byte of the frame's first value

    g = dh.Geometry()
    tag = uuid.uuid4().hex
    tokens = N_CHUNKS * g.block_size + 3
    config = dh.direct_config(blocks_per_op=1, load_retry_s=0.5, load_guarantee="leased")
    with FaultProxy((node.host, node.port), plan, name="flip") as proxy:
        point_at(monkeypatch, [proxy], auth_key_hex)
        with dh.DirectEngine(g, config) as engine:
            plan.arm()
            engine.run(tag, tokens)
            flipped = [a for a in proxy.applied if a.fault.kind == "flip" and a.keys]
            assert len(flipped) == 1, proxy.applied
            m = engine.manager
            value_keys = [m.keys.value_key(k, 0) for k in dh.prompt_keys(tag, N_CHUNKS, g)]
            bad = value_keys.index(flipped[0].keys[0])
            req = engine.add_request(tag, tokens)
            message = _fails_then_engine_goes_on(engine, req, "the failing load")
            if message is not None:
                assert repr(flipped[0].keys[0]) in message
            assert _zero_blocks(engine, req, range(bad, bad + 1)), "a corrupt value reached the GPU"
        with dh.DirectEngine(g, config) as restarted:  # the first engine's leases were released
            assert not restarted.manager.client.exists([flipped[0].keys[0]])[0], "the corrupt value was not purged"
            third = restarted.run(tag, tokens)
            assert third.matched_tokens == bad * g.block_size  # recomputed from the purged chunk on


def test_reset_cache_with_a_leased_load_in_flight_loads_byte_exact_and_releases_every_lease(
    monkeypatch, private_cluster, auth_key_hex, tmp_path
):
    """vLLM's reset_prefix_cache(reset_connector=True) while a load streams: the connector flushes
    the job to the workers (wait(): the load is waited for, vllm-spec-api.md 4.3) and ignores its
    report, so the manager fences the job's leases instead of releasing them under the stream
    (0.33: until on_reset_flushed; earlier: RESET_FENCE_STEPS steps, which end after the flush's
    wait returned). Asserted: every lease of the load is still held on the healthy node after the
    reset, the flushed load's bytes are exact on every rank (harness), and no lease is left on
    either node afterwards. 0.26+: the request goes on, the same engine loads the prompt again
    byte-exact, and every value can then be deleted at once (a DELETE succeeds at once only for
    a value nobody leases, docs/protocol.md section 12). 0.25: vLLM's own connector raises at the
    next step of a request that lived across a reset (its stale job ids, whatever the spec;
    docs/compatibility.md); the leases are released before that."""
    import vllm

    point_at(monkeypatch, private_cluster, auth_key_hex)
    cfg = tmp_path / "memkv.yaml"
    cfg.write_text("io_timeout_s: 0.5\ndown_for_s: 0.2\n")
    monkeypatch.setenv("MEMKV_CONFIG", str(cfg))
    g = dh.Geometry(world_size=2)
    healthy, stalled = private_cluster
    tokens = N_CHUNKS * g.block_size + 3
    timer: list[threading.Timer] = []

    def stall(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        if matched and not timer:  # after the HIT, before the load job: the load will be in flight
            _sigstop(stalled)
            timer.append(threading.Timer(1.5, stalled.signal, (signal.SIGCONT,)))

    def leases() -> float:
        return sum(metric_value(metrics_of(n), "memkv_node_leases") for n in private_cluster)

    def controls_done(m) -> None:
        for _ in range(500):  # bounded: the control thread runs the releases and renewals queued
            if all(f.done() for f in m._ctl_futures):
                return
            time.sleep(0.01)
        raise AssertionError("lease control still running after 5 s")

    with dh.DirectEngine(g, dh.direct_config(load_retry_s=30.0, load_guarantee="leased")) as engine:
        m = engine.manager
        tag, _ = _tag_with_chunk_on(engine, stalled.address)
        engine.run(tag, tokens)
        value_keys = [vk for k in dh.prompt_keys(tag, N_CHUNKS, g) for vk in m.keys.value_keys(k)]
        engine.before_alloc = stall
        req = engine.add_request(tag, tokens)
        try:
            engine.run_until(lambda: engine.load_jobs >= 1, what="the load job")
            engine.before_alloc = None
            assert timer, "the lookup should have matched"
            workers = [w.connector_worker.worker for w in engine.workers]
            assert all(w._jobs for w in workers), "the load should be in flight at the reset"
            assert req.status.name == "WAITING_FOR_REMOTE_KVS"
            assert engine.connector.reset_cache() in (True, None)
            assert not m._held and m._lease_fence, "the in-flight load's leases should be fenced, not released"
            controls_done(m)
            ours = sum(m.client.owner(vk).name == healthy.address for vk in value_keys)
            assert metric_value(metrics_of(healthy), "memkv_node_leases") == ours, "a lease ended under the load"
            timer[0].start()  # the node comes back within load_retry_s: the flushed load completes
            engine.run_until(
                lambda: req.status.name == "WAITING", timeout_s=60, what="the flushed load"
            )  # its bytes are checked on every rank by the harness
        finally:
            for t in timer:
                t.cancel() if not t.is_alive() else t.join(10)
            stalled.signal(signal.SIGCONT)
        assert req.loaded_blocks == N_CHUNKS * g.blocks_per_chunk
        assert not any(w._jobs for w in workers)
        if vllm.__version__.startswith("0.25."):
            with pytest.raises(KeyError):  # vLLM 0.25: the request's job ids died with the reset
                engine.step()  # ... after on_schedule_end ended the fence
            assert not m._lease_fence and not m._held
            controls_done(m)
            assert leases() == 0, f"{leases():g} lease(s) left on the nodes"
            return
        engine.run_until(lambda: req.is_finished(), timeout_s=60, what="the request after its load")
        engine.run_until_idle(timeout_s=60)
        engine.run_until(lambda: not m._lease_fence, what="the fenced leases")
        assert not m._held
        controls_done(m)
        assert leases() == 0, f"{leases():g} lease(s) of the flushed load left on the nodes"
        again = engine.run(tag, tokens, timeout_s=60)
        assert again.matched_tokens == N_CHUNKS * g.block_size
        assert again.loaded_blocks == N_CHUNKS * g.blocks_per_chunk  # byte-exact on every rank (harness)
        engine.run_until_idle(timeout_s=60)
        assert not m._held and not m._lease_fence
        controls_done(m)
        deleted = m.client.delete(value_keys)
        assert all(deleted), f"{deleted.count(False)} of {len(deleted)} values still leased (or gone)"


@pytest.mark.parametrize(
    "guarantee, putters, fetchers",
    [("leased", "memkv-direct-put-", "memkv-direct-fetch-"), ("staged", "memkv-store-", "memkv-load-")],
)
def test_threads_that_put_run_at_store_nice_and_fetches_at_the_engines(
    monkeypatch, cluster, auth_key_hex, guarantee, putters, fetchers
):
    """Direct mode's `store_nice` reaches the threads that put (leased: the worker's put threads;
    staged: the engine core's write threads); the fetching threads keep the engine's nice; the
    prompt is stored and loaded whole through them."""
    import os

    point_at(monkeypatch, cluster, auth_key_hex)
    g = dh.Geometry()
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    config = dh.direct_config(load_guarantee=guarantee, store_nice=3)
    tag, tokens = uuid.uuid4().hex, N_CHUNKS * g.block_size + 3
    with dh.DirectEngine(g, config) as engine:
        engine.run(tag, tokens, timeout_s=60)
    with dh.DirectEngine(g, config) as restarted:
        again = restarted.run(tag, tokens, timeout_s=60)
        assert again.loaded_blocks == N_CHUNKS * g.blocks_per_chunk  # byte-exact (harness)

        def nices(prefix: str) -> set[int]:
            return {
                os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in threading.enumerate()
                if t.name.startswith(prefix) and t.native_id is not None
            }

        assert nices(putters) == {min(19, engine_nice + 3)}
        assert nices(fetchers) == {engine_nice}
