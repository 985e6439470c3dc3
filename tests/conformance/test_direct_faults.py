"""Direct mode with load_guarantee "staged" under the tier suite's fault cases, through vLLM's real
connector (both sides). (The default, "leased", has its own: test_direct_leased.py.)

vLLM's worker cannot report a failed load (it asserts success), so in direct mode every fault
must surface *before* the connector commits to a load: as a MISS at lookup time, after which
the request recomputes from that chunk on. Asserted here, with real `memkv serve` nodes:

* a killed node: its chunks answer MISS; the prefix before the first of them loads byte-exact;
* a stalled node (SIGSTOP): lookups of its chunks resolve MISS within lookup_timeout_s, and a
  prefetch stuck on it keeps its staging slot quarantined until the transfer returns;
* a value evicted between the exists probe and the prefetch: MISS from that chunk, and the
  chunk is purged; evicted after the HIT: the load is still served, byte-exact, from staging;
* a corrupt value (a byte flipped on its way into the node): the checksum fails the prefetch,
  MISS from that chunk, and the value is purged.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from memkv_vllm import metrics as tm
from tests.conformance import direct_harness as dh
from tests.conformance.conftest import point_at
from tests.conformance.test_memkv_tier import _sigstop
from tests.faults.nodeops import NO_LOCAL_SOCKET
from tests.faults.proxy import FaultProxy, FlipNextPut

pytestmark = pytest.mark.conformance

N_CHUNKS = 8


def _tokens(g: dh.Geometry, n_chunks: int = N_CHUNKS) -> int:
    return n_chunks * g.block_size + 3


def _owner_of_chunks(engine: dh.DirectEngine, tag: str, n_chunks: int) -> list[set[str]]:
    """The servers holding each chunk's values (one per rank)."""
    m = engine.manager
    return [{m.client.owner(vk).name for vk in m.keys.value_keys(k)} for k in dh.prompt_keys(tag, n_chunks, engine.g)]


def _tag_with_prefix_on(engine: dh.DirectEngine, healthy: str, n_chunks: int = N_CHUNKS) -> tuple[str, int]:
    """A prompt whose first chunks live only on `healthy` and some later chunk does not: returns
    (tag, index of the first chunk with a value elsewhere). Bounded search over random tags."""
    for _ in range(500):
        tag = uuid.uuid4().hex
        owners = _owner_of_chunks(engine, tag, n_chunks)
        first_bad = next((c for c, o in enumerate(owners) if o != {healthy}), None)
        if first_bad is not None and 2 <= first_bad <= n_chunks - 2:
            return tag, first_bad
    raise AssertionError("no suitable prompt found in 500 tags")


def _wait_probes_answered(engine: dh.DirectEngine, timeout_s: float = 10.0) -> None:
    """Until the exists round flushed by the last step is answered (a bounded poll)."""
    deadline = time.monotonic() + timeout_s
    lookups = engine.manager._lookup
    while lookups.flush() or lookups.pending():  # flush() takes in the answers (scheduler side: this thread)
        assert time.monotonic() < deadline, "exists probes unanswered"
        time.sleep(0.005)


@pytest.mark.parametrize("world_size", [1, 2])
def test_killed_node_chunks_miss_and_the_prefix_before_them_loads(
    monkeypatch, private_cluster, auth_key_hex, world_size
):
    point_at(monkeypatch, private_cluster, auth_key_hex)
    healthy, doomed = private_cluster
    g = dh.Geometry(world_size=world_size)
    with dh.DirectEngine(g, dh.direct_config(load_guarantee="staged")) as engine:
        tag, first_bad = _tag_with_prefix_on(engine, healthy.address)
        engine.run(tag, _tokens(g))
        doomed.kill()
        again = engine.run(tag, _tokens(g))
        assert again.matched_tokens == first_bad * g.block_size
        assert again.loaded_blocks == first_bad * g.blocks_per_chunk  # byte-exact (harness)
        assert engine.manager.slots.free == engine.manager.slots.num_slots


def test_stalled_node_resolves_miss_within_deadline_and_quarantines_a_stuck_prefetch(
    monkeypatch, private_cluster, auth_key_hex, tmp_path
):
    point_at(monkeypatch, private_cluster, auth_key_hex)
    config = tmp_path / "memkv.yaml"
    config.write_text("io_timeout_s: 120\n")  # the stuck prefetch outlives the lookup deadline by far
    monkeypatch.setenv("MEMKV_CONFIG", str(config))
    healthy, stalled = private_cluster
    g = dh.Geometry()
    deadline_s = 0.5
    with dh.DirectEngine(g, dh.direct_config(lookup_timeout_s=deadline_s, load_guarantee="staged")) as engine:
        tag, first_bad = _tag_with_prefix_on(engine, healthy.address)
        engine.run(tag, _tokens(g))
        req = engine.add_request(tag, _tokens(g))
        engine.step()  # the lookups start: one exists round for every chunk
        _wait_probes_answered(engine)
        _sigstop(stalled)  # every chunk exists; its prefetch now hangs on the stopped node
        try:
            # Without the deadline the stuck prefetch would answer RETRY until the client's 120 s
            # io timeout, past this bound (TimeoutError); with it, the lookup resolves.
            engine.run_until(lambda: req.matched_tokens is not None, timeout_s=20, what="lookup")
            assert req.matched_tokens == first_bad * g.block_size
            m = engine.manager
            assert m.slots.quarantined >= 1, "an abandoned prefetch's slot must stay out of use"
            engine.run_until(lambda: req.is_finished(), timeout_s=20, what="request")
            assert req.loaded_blocks == first_bad * g.blocks_per_chunk
            engine._collect_stats()
            assert engine.stat(tm.LOOKUPS, ("timeout", "direct")) >= 1
            assert engine.gauges.get((tm.STAGING_BYTES, ("quarantine", "direct")), 0) > 0
        finally:
            stalled.signal(signal.SIGCONT)
        engine.run_until(lambda: engine.manager.slots.quarantined == 0, timeout_s=40, what="quarantine")
        engine.run_until_idle(timeout_s=40)
        assert engine.manager.slots.free == engine.manager.slots.num_slots


def test_value_evicted_between_probe_and_prefetch_is_a_miss_from_that_chunk_and_purged(direct_env_tp2):
    g = dh.Geometry(world_size=2)
    tag = uuid.uuid4().hex
    gone = 3
    with dh.DirectEngine(g, dh.direct_config(load_guarantee="staged")) as engine:
        engine.run(tag, _tokens(g))
        m = engine.manager
        key = dh.prompt_keys(tag, N_CHUNKS, g)[gone]
        req = engine.add_request(tag, _tokens(g))
        engine.step()
        _wait_probes_answered(engine)
        m.client.delete([m.keys.value_key(key, 0)])  # the node evicts rank 0's value; exists said yes
        engine.run_until(lambda: req.is_finished(), timeout_s=20, what="request")
        engine.run_until_idle()
        assert req.matched_tokens == gone * g.block_size
        assert req.loaded_blocks == gone * g.blocks_per_chunk
        assert engine.stat(tm.JOBS_FAILED, ("load", "direct")) >= 1
        # rank 1's value of the broken chunk was purged (then stored again by the recompute).
        assert m.client.get(m.keys.value_key(key, 0)) == dh.expected_value(tag, gone, 0, g)


def test_values_evicted_after_the_hit_are_still_loaded_byte_exact_from_staging(direct_env_tp2):
    g = dh.Geometry(world_size=2)
    tag = uuid.uuid4().hex
    evicted = []

    def evict_all(engine: dh.DirectEngine, req: dh.Request, matched: int) -> None:
        m = engine.manager
        keys = [vk for k in dh.prompt_keys(tag, N_CHUNKS, g) for vk in m.keys.value_keys(k)]
        evicted.append(sum(m.client.delete(keys)))

    with dh.DirectEngine(g, dh.direct_config(load_guarantee="staged")) as engine:
        engine.run(tag, _tokens(g))
        engine.before_alloc = evict_all
        again = engine.run(tag, _tokens(g))
        assert evicted == [N_CHUNKS * g.world_size], "the values were not there to evict"
        assert again.matched_tokens == N_CHUNKS * g.block_size
        assert again.loaded_blocks == N_CHUNKS * g.blocks_per_chunk  # byte-exact, from staging


def test_corrupt_value_is_a_miss_from_that_chunk_and_is_purged(monkeypatch, start_node, auth_key_hex):
    node = start_node(capacity="64MiB", extra_args=[NO_LOCAL_SOCKET])
    plan = FlipNextPut(offset=100)  # a byte of the frame's first value

    g = dh.Geometry()
    tag = uuid.uuid4().hex
    with FaultProxy((node.host, node.port), plan, name="flip") as proxy:
        point_at(monkeypatch, [proxy], auth_key_hex)
        with dh.DirectEngine(g, dh.direct_config(blocks_per_op=1, load_guarantee="staged")) as engine:
            m = engine.manager
            plan.arm()
            engine.run(tag, _tokens(g))
            flipped = [a for a in proxy.applied if a.fault.kind == "flip" and a.keys]
            assert len(flipped) == 1, proxy.applied
            value_keys = [m.keys.value_key(k, 0) for k in dh.prompt_keys(tag, N_CHUNKS, g)]
            bad = value_keys.index(flipped[0].keys[0])
            again = engine.run(tag, _tokens(g))
            assert again.matched_tokens == bad * g.block_size
            assert again.loaded_blocks == bad * g.blocks_per_chunk
            assert engine.stat(tm.JOBS_FAILED, ("load", "direct")) >= 1
            if m.client.has_rdma():  # a node may still WRITE after a failed RDMA fetch: slot kept out
                assert m.slots.quarantined == 1
            # Purged, then stored again (clean) by the recompute: a third visit loads everything.
            third = engine.run(tag, _tokens(g))
            assert third.matched_tokens == N_CHUNKS * g.block_size


@pytest.fixture
def direct_env_tp2(monkeypatch, cluster, auth_key_hex):
    point_at(monkeypatch, cluster, auth_key_hex)
    return cluster
