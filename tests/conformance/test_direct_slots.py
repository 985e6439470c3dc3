"""The staging slot table's quarantine rule and the direct-mode keys, as plain logic.

A slot is handed out again only when its owner released it *and* no transfer can still touch
it; released-while-busy is "quarantined". (In tests/conformance because importing
memkv_vllm.direct imports vLLM.)"""

from __future__ import annotations

import pytest

from memkv.errors import ConfigError
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.staging import SlotTable

pytestmark = pytest.mark.conformance


def test_a_released_slot_whose_transfer_is_running_is_quarantined_until_the_transfer_ends():
    t = SlotTable(2)
    a, b = t.take(2)
    assert t.take(1) is None and t.free == 0
    t.mark_busy(a)
    t.release(a)  # abandoned by a deadline while its transfer runs
    assert t.quarantined == 1 and t.free == 0 and t.take(1) is None
    t.transfer_done(a)
    assert t.quarantined == 0 and t.free == 1 and t.take(1) == [a]
    t.release(b)
    t.release(b)  # idempotent: never handed out twice
    assert t.free == 1


def test_a_finished_transfer_keeps_an_owned_slot_owned():
    t = SlotTable(1)
    (a,) = t.take(1)
    t.mark_busy(a)
    t.transfer_done(a)
    assert t.free == 0 and t.in_use == 1
    t.release(a)
    assert t.free == 1


def test_take_is_all_or_nothing():
    t = SlotTable(3)
    assert t.take(4) is None and t.free == 3
    assert len(t.take(3)) == 3


@pytest.mark.parametrize("raw, name", [
    ({"memkv": {"stagingmb": 1}}, "stagingmb"),
    ({"memkv": {"staging_mb": -1}}, "staging_mb"),
    ({"memkv": {"step_yield_ms": 100}}, "step_yield_ms"),
    ({"memkv": []}, "'memkv'"),
])
def test_bad_settings_name_the_key(raw, name):
    with pytest.raises(ConfigError) as info:
        DirectSettings.from_extra_config(raw)
    assert name in str(info.value)


def test_defaults_without_a_memkv_object():
    s = DirectSettings.from_extra_config({"spec_name": "MemKVOffloadingSpec"})
    assert s.staging_bytes == 512 << 20 and s.deadline_s == 5.0
