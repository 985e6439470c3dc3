"""A tier whose server list changes loses only cache: moved chunks miss, the rest promote exactly.

Behaviour under test, with vLLM's real TieringOffloadingManager and the memkv tier: an engine
configured with three nodes stores 48 chunks; an engine configured with those three plus a fourth
looks them up: exactly the chunks rendezvous hashing moves to the new node are misses, every
other chunk promotes byte-exact; once the second engine has stored the moved chunks (as it would
after recomputing them) they promote too, and the first engine, still on its old list, keeps
promoting everything it stored, byte-exact.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="tier fault tests need vLLM (run them in a nox venv)")

from tests.conformance import vllm_harness as h
from tests.faults import tier_sim as ts

pytestmark = [pytest.mark.faults, pytest.mark.conformance]  # conformance: runs in each nox vLLM session

GEOMETRY = h.Geometry(num_rows=64)


def promote(engine, keys, expected) -> ts.Scheduler:
    engine.reset_cache()
    sched = ts.Scheduler(engine, expected)
    for key in keys:
        sched.submit([key])
    sched.run(30)
    assert not sched.waiting and not sched.mismatches, sched.mismatches[:3]
    return sched


def test_added_node_moves_only_its_chunks_and_the_rest_promote_exactly(monkeypatch, start_node, auth_key_hex, figures):
    nodes = start_node.many(4, capacity="64MiB")
    three, four = [n.address for n in nodes[:3]], [n.address for n in nodes]
    keys = h.make_keys(48)
    ts.point_tier_at(monkeypatch, three, auth_key_hex)
    with h.HeadlessEngine([ts.memkv_tier()], GEOMETRY) as old:
        payloads = ts.store_all(old, keys)
        old_owner = {k: ts.tier_of(old).client.owner(ts.tier_of(old).namespace.key(k)).name for k in keys}
        ts.point_tier_at(monkeypatch, four, auth_key_hex)
        with h.HeadlessEngine([ts.memkv_tier()], GEOMETRY) as new:
            tier = ts.tier_of(new)
            moved = {k for k in keys if tier.client.owner(tier.namespace.key(k)).name != old_owner[k]}
            assert moved and all(tier.client.owner(tier.namespace.key(k)).name == four[3] for k in moved)
            sched = promote(new, keys, payloads)
            hit = {s.keys[0] for s in sched.done if s.hits}
            assert hit == set(keys) - moved, "exactly the moved chunks are lost, nothing else"
            assert all(s.bytes_ok for s in sched.done if s.hits)
            ts.store_all(new, sorted(moved))  # recomputed and stored again: on the new owner
            again = promote(new, keys, payloads)
            assert sum(s.hits for s in again.done) == len(keys)
        ts.point_tier_at(monkeypatch, three, auth_key_hex)
        still = promote(old, keys, payloads)  # the old list still finds everything it stored
        assert sum(s.hits for s in still.done) == len(keys)
    figures(tier_chunks=len(keys), tier_moved_to_added_node=len(moved), tier_kept=len(keys) - len(moved))
