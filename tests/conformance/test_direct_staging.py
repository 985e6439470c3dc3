"""Direct mode: the bounded staging region, configuration, startup, metrics and registration.

* With load_guarantee "staged", staging is bounded by `memkv.staging_mb`: a store job larger than the whole region keeps its
  leading chunks and sheds the rest of the request (what MemKV holds is a usable prefix); a job
  that fits the region but not its free slots waits a step (prepare_store -> None) and is stored
  whole; a lookup that finds no free slot answers MISS from that chunk on (the connector never
  commits to a load whose bytes are not staged).
* Bad keys fail construction naming the key; an unreachable server fails startup naming it.
* Every metric emitted is declared with its label arity, `mode="direct"` included.
* Registration: the `memkv_tier` entry point registers `MemKVOffloadingSpec` lazily (no import of
  memkv_vllm.direct until a spec is built), and `spec_module_path` works without it.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import textwrap
import uuid

import pytest

from memkv_vllm import metrics as tm
from memkv_vllm.direct import MemKVOffloadingSpec
from tests.conformance import direct_harness as dh
from tests.conformance.conftest import PluginLog, point_at

pytestmark = pytest.mark.conformance

BIG = dh.Geometry(block_size=256)  # 16 GPU blocks per chunk: one value is 128 KiB, 1 MiB holds 8 slots


@pytest.fixture
def direct_env(monkeypatch, cluster, auth_key_hex):
    point_at(monkeypatch, cluster, auth_key_hex)
    return cluster


def test_store_job_larger_than_staging_keeps_its_leading_chunks_and_sheds_the_rest(direct_env):
    g, tag = BIG, uuid.uuid4().hex
    tokens = 12 * g.block_size + 3
    with dh.DirectEngine(
        g, dh.direct_config(staging_mb=1, block_size=g.block_size, load_guarantee="staged"), token_budget=4096
    ) as engine:
        assert engine.manager.slots.num_slots == 8
        with PluginLog() as log:
            engine.run(tag, tokens)  # one store job of 12 chunks
        assert engine.stat(tm.SHEDS, ("direct",)) == 4
        warned = [line for line in log.lines if "needs more staging" in line]
        assert warned and "kept its first 8 chunk(s), shed 4" in warned[0]
        assert "staging_mb" in warned[0] and '"leased"' in warned[0]  # both ways out are named
        again = engine.run(tag, tokens)
        assert again.matched_tokens == 8 * g.block_size  # the prefix that was kept, byte-exact
        assert again.loaded_blocks == 8 * g.blocks_per_chunk


def test_lookup_with_no_free_slot_is_a_miss_from_that_chunk(direct_env):
    g, tag = BIG, uuid.uuid4().hex
    tokens = 12 * g.block_size + 3
    with dh.DirectEngine(
        g, dh.direct_config(staging_mb=2, block_size=g.block_size, load_guarantee="staged"), token_budget=4096
    ) as big:
        big.run(tag, tokens)  # all 12 stored
    with dh.DirectEngine(
        g, dh.direct_config(staging_mb=1, block_size=g.block_size, load_guarantee="staged"), token_budget=4096
    ) as small:
        again = small.run(tag, tokens)
        assert again.matched_tokens == 8 * g.block_size
        assert again.loaded_blocks == 8 * g.blocks_per_chunk
        assert small.stat(tm.STAGING_FULL, ("load", "direct")) >= 1


def test_store_job_that_fits_the_region_but_not_its_free_slots_waits_a_step_and_is_stored_whole(direct_env):
    g = BIG
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    tokens = 6 * g.block_size + 3  # 6 chunks each; 8 slots: the second job cannot have its 6 at once
    with dh.DirectEngine(
        g, dh.direct_config(staging_mb=1, block_size=g.block_size, load_guarantee="staged"), token_budget=8192
    ) as engine:
        ra = engine.add_request(a, tokens, max_tokens=20)
        rb = engine.add_request(b, tokens, max_tokens=20)  # still running while its chunks are re-offered
        engine.run_until(lambda: ra.is_finished() and rb.is_finished(), what="requests")
        engine.run_until_idle()
        assert engine.stat(tm.STAGING_FULL, ("store", "direct")) >= 6
        assert engine.stat(tm.SHEDS, ("direct",)) == 0
        for tag in (a, b):
            again = engine.run(tag, tokens)
            assert again.matched_tokens == 6 * g.block_size, (tag == a, engine.store_jobs)


def test_every_emitted_metric_is_declared_with_its_label_arity(direct_env):
    definitions = MemKVOffloadingSpec.build_metric_definitions({})
    assert {tm.STORE_BYTES, tm.LOAD_BYTES, tm.LOOKUPS, tm.STAGING_BYTES, tm.STAGING_FULL} <= set(definitions)
    assert all(d.labelnames[-1] == "mode" for d in definitions.values())
    with dh.DirectEngine(dh.Geometry(world_size=2), dh.direct_config(load_guarantee="staged")) as engine:
        tag = uuid.uuid4().hex
        engine.run(tag, 4 * engine.g.block_size + 1)
        engine.run(tag, 4 * engine.g.block_size + 1)
        engine.run(uuid.uuid4().hex, 2 * engine.g.block_size)
    emitted = set(engine.stats) | set(engine.gauges)
    assert {tm.STORE_BYTES, tm.LOAD_BYTES, tm.LOOKUPS, tm.STAGING_BYTES} <= {n for n, _ in emitted}
    for name, labels in emitted:
        if not name.startswith("vllm:kv_offload_memkv_"):
            continue  # the connector's own series
        assert name in definitions, f"{name} emitted but not declared"
        assert len(labels) == len(definitions[name].labelnames), f"{name}{labels} vs {definitions[name].labelnames}"
        assert labels[-1] == "direct"
    # 4 chunks x 2 ranks stored, and loaded again, one value per rank per chunk.
    assert engine.stat(tm.STORE_BYTES, ("direct",)) == (4 + 2) * 2 * engine.g.value_bytes
    assert engine.stat(tm.LOAD_BYTES, ("direct",)) == 4 * 2 * engine.g.value_bytes


@pytest.mark.parametrize(
    "memkv, name",
    [
        ({"staging_mbb": 8}, "staging_mbb"),
        ({"staging_mb": 0}, "staging_mb"),
        ({"lookup_timeout_s": "5"}, "lookup_timeout_s"),
        ({"blocks_per_op": True}, "blocks_per_op"),
        ({"load_guarantee": "pinned"}, "load_guarantee"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"load_retry_s": "30"}, "load_retry_s"),
    ],
)
def test_bad_key_fails_construction_naming_it(direct_env, memkv, name):
    config = dh.direct_config()
    config["memkv"] = memkv
    with pytest.raises(Exception) as info:
        dh.DirectEngine(dh.Geometry(), config)
    assert name in str(info.value)


def test_staging_smaller_than_one_chunk_fails_naming_the_key(direct_env):
    g = dh.Geometry(block_size=4096)  # 2 MiB per rank per chunk
    with pytest.raises(Exception) as info:
        dh.DirectEngine(g, dh.direct_config(staging_mb=1, block_size=4096))
    assert "staging_mb" in str(info.value)


def test_unreachable_server_fails_startup_naming_it(monkeypatch, auth_key_hex):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MEMKV_SERVERS", f"127.0.0.1:{port}")
    monkeypatch.setenv("MEMKV_AUTH_KEY", auth_key_hex)
    monkeypatch.delenv("MEMKV_CONFIG", raising=False)
    before = set(glob.glob("/dev/shm/memkv_direct_*"))
    with pytest.raises(Exception) as info:
        dh.DirectEngine(dh.Geometry())
    assert f"127.0.0.1:{port}" in str(info.value) and "MEMKV_SERVERS" in str(info.value)
    assert set(glob.glob("/dev/shm/memkv_direct_*")) == before, "a failed startup left its staging file"


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_plugin_registers_the_spec_name_lazily_and_module_path_needs_no_registration():
    out = run_python("""
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        load_general_plugins()
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        print("registered", "MemKVOffloadingSpec" in OffloadingSpecFactory._registry)
        print("imported", "memkv_vllm.direct" in sys.modules)
    """)
    assert "registered True" in out
    assert "imported False" in out
    for extra in (
        {"spec_name": "MemKVOffloadingSpec"},
        {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.direct"},
    ):
        out = run_python(f"""
            import inspect, sys
            from types import SimpleNamespace
            from vllm.plugins import load_general_plugins
            from vllm.v1.kv_offload.factory import OffloadingSpecFactory
            if "spec_module_path" not in {extra!r}:
                load_general_plugins()
            extra = {extra!r}
            params = inspect.signature(OffloadingSpecFactory.get_spec_cls).parameters
            arg = extra if "extra_config" in params else SimpleNamespace(
                kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
            print("class", OffloadingSpecFactory.get_spec_cls(arg).__name__)
        """)
        assert "class MemKVOffloadingSpec" in out, out
