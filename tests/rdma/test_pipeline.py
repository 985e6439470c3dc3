"""A node's share of an RDMA load goes as several pipelined RDMA_GETs (MEMKV_RDMA_PIPELINE_MB).

Behaviour under test:
* `pipeline_parts` cuts a node's values into consecutive ranges that cover every value once,
  in order, each at most the limit or a single value; limit 0 is one range;
* MEMKV_RDMA_PIPELINE_MB is checked when the client starts: a bad value is a ConfigError
  naming it; 0, the default, means one RDMA_GET per node and batch;
* against a real node, a batch cut into 1 MiB parts is served by one RDMA_GET per part, every
  byte lands and verifies, and 0 restores one RDMA_GET per batch;
* a fault in the middle of the pipeline (the node's first write is on time, its second starts
  after that request's window closed) keeps the value already verified; the rest are failures
  that may still land late, and nothing is written after the window: nothing a node did not
  confirm is reported loaded.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memkv import Client, ClientConfig, ConfigError
from memkv.config import AuthKey, ServerAddress
from memkv.transport.rdma import ENV_PIPELINE_MB, pipeline_bytes, pipeline_parts
from tests.rdma.conftest import node_requests, requires_nixl, wait_for

MiB = 1 << 20


@pytest.mark.unit
@given(st.lists(st.integers(1, 40), max_size=40), st.integers(0, 64))
def test_parts_cover_every_value_once_within_the_limit(lengths, limit):
    parts = pipeline_parts(lengths, limit)
    assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(len(lengths)))
    assert all(hi > lo for lo, hi in parts)
    if limit == 0:
        assert len(parts) == (1 if lengths else 0)
    else:
        assert all(hi - lo == 1 or sum(lengths[lo:hi]) <= limit for lo, hi in parts)
        # greedy: a part is cut only where the next value would not fit
        assert all(sum(lengths[lo : hi + 1]) > limit for lo, hi in parts[:-1])


@pytest.mark.unit
def test_an_oversize_value_goes_alone():
    assert pipeline_parts([16, 40, 8, 8, 8], 16) == [(0, 1), (1, 2), (2, 4), (4, 5)]


@pytest.mark.unit
def test_the_setting_is_checked(monkeypatch):
    monkeypatch.delenv(ENV_PIPELINE_MB, raising=False)
    assert pipeline_bytes() == 0  # off by default (docs/performance.md, runs 39-40)
    monkeypatch.setenv(ENV_PIPELINE_MB, "16")
    assert pipeline_bytes() == 16 * MiB
    for bad in ("-1", "1.5", "lots", "70000"):
        monkeypatch.setenv(ENV_PIPELINE_MB, bad)
        with pytest.raises(ConfigError) as info:
            pipeline_bytes()
        assert ENV_PIPELINE_MB in str(info.value) and repr(bad) in str(info.value)


@requires_nixl
@pytest.mark.unit
def test_a_bad_setting_refuses_to_start_an_rdma_client(monkeypatch):
    monkeypatch.setenv(ENV_PIPELINE_MB, "many")
    cfg = ClientConfig(
        servers=(ServerAddress("127.0.0.1", 9),), auth_key=AuthKey.from_hex("ab" * 32, "test"), transport="rdma"
    )
    with pytest.raises(ConfigError, match=ENV_PIPELINE_MB):
        Client(cfg)


def load_into_pool(client, pool, keys, sizes):
    slots, off = [], 0
    for n in sizes:
        slots.append(pool[off : off + n])
        off += n
    pool[:off] = bytes(off)
    return slots, client.batch_load_into(list(zip(keys, slots)))


@requires_nixl
@pytest.mark.integration
@pytest.mark.parametrize(("setting", "requests"), [("1", 6), ("2", 3), ("0", 1)])
def test_a_batch_goes_as_one_rdma_get_per_part(ucx, start_node, make_client, pool, monkeypatch, setting, requests):
    monkeypatch.setenv(ENV_PIPELINE_MB, setting)
    node = start_node()
    client = make_client([node], transport="rdma", io_timeout_s=10.0)
    assert client.register_pool(pool)
    values = [os.urandom(MiB) for _ in range(6)]
    keys = [f"pipe/{setting}/{i}" for i in range(6)]
    assert client.batch_put_views(list(zip(keys, values))) == [True] * 6
    slots, result = load_into_pool(client, pool, keys, [MiB] * 6)
    assert result.ok == [True] * 6 and not result.may_land_late
    assert [bytes(s) for s in slots] == values
    assert node_requests(node, "rdma_get") == requests and node_requests(node, "get") == 0


@requires_nixl
@pytest.mark.integration
@pytest.mark.parametrize(("io_timeout_s", "delay_s"), [(4.0, 3.0), (1.0, 1.5)], ids=["window-closed", "reply-timeout"])
def test_a_fault_mid_pipeline_keeps_what_verified_and_withholds_the_rest(
    ucx, start_late_node, make_client, pool, monkeypatch, io_timeout_s, delay_s
):
    """The node's first write is on time; its second starts `delay_s` after it read that
    request, past the window (half the client's timeout). window-closed: the node answers
    TRANSFER_FAILED before the client's timeout. reply-timeout: the client stops waiting first
    and drops the connection."""
    monkeypatch.setenv(ENV_PIPELINE_MB, "1")
    node = start_late_node(delay_s=delay_s, ignore_window=False, on_time=1)
    client = make_client([node], transport="rdma", io_timeout_s=io_timeout_s)
    assert client.register_pool(pool)
    values = [os.urandom(MiB), os.urandom(MiB)]
    assert client.batch_put_views([("mid/0", values[0]), ("mid/1", values[1])]) == [True, True]
    slots, result = load_into_pool(client, pool, ["mid/0", "mid/1"], [MiB, MiB])
    assert result.ok == [True, False] and result.may_land_late
    assert bytes(slots[0]) == values[0]
    assert not wait_for(lambda: bytes(slots[1]) != bytes(MiB), 2.0), "a node wrote after its window closed"
