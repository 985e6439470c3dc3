"""Direct mode's default load guarantee, per vLLM release, through vLLM's real connector.

The ready line names the vLLM release (qualified: every release the suite runs on).

* vLLM 0.34+ (a failed load is recomputed): the default is "leased", with a staging region of at
  most 1 GiB; a prompt whose KV is 8x the staging region, everything else at its default, is
  reused whole by a restarted engine, byte-exact, and the ready line says so.
* Before 0.34 (a failed load would stop the engine): the default stays "staged", and the ready
  line says how many tokens of a prompt the configuration reuses (staging slots x tokens per
  chunk); that is exactly what a restarted engine reuses of the long prompt, byte-exact.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from memkv_vllm.direct.config import DirectSettings
from tests.conformance import direct_harness as dh
from tests.conformance import harness_compat as hc
from tests.conformance.conftest import point_at

pytestmark = pytest.mark.conformance

BIG = 256  # tokens per chunk: 16 GPU blocks, one value is 128 KiB; a 1 MiB region holds 8 chunks at TP=1
NEWEST = hc.vllm_version() >= (0, 34, 0)


def test_default_guarantee_is_leased_from_034_and_staged_before_with_at_most_1_gib_of_staging():
    s = DirectSettings.from_extra_config({"spec_name": "MemKVOffloadingSpec"})
    assert s.load_guarantee == ("leased" if NEWEST else "staged")
    assert 0 < s.staging_bytes <= 1 << 30


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def ready_lines():
    handler = _Lines()
    logger = logging.getLogger("vllm.memkv_vllm.direct")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_default_configuration_with_a_prompt_8x_the_staging_region(monkeypatch, cluster, auth_key_hex, ready_lines):
    point_at(monkeypatch, cluster, auth_key_hex)
    g = dh.Geometry(block_size=BIG, num_gpu_blocks=1100)
    n_chunks = 64  # 8 MiB of KV through a 1 MiB region: the default's 512 MiB against a ~4 GiB prompt
    tokens = n_chunks * BIG + 7
    config = dh.direct_config(staging_mb=1, block_size=BIG)  # load_guarantee left at its default
    with dh.DirectEngine(g, config, token_budget=4096) as engine:
        engine.run(tag := uuid.uuid4().hex, tokens, timeout_s=120)
    del ready_lines[:]
    with dh.DirectEngine(g, config, token_budget=4096) as restarted:
        layout = restarted.manager.layout
        ready = [line for line in ready_lines if "direct mode ready" in line]
        assert len(ready) == 1, ready_lines
        assert f"vllm={'.'.join(map(str, hc.vllm_version()))} (qualified)" in ready[0]
        again = restarted.run(tag, tokens, timeout_s=120)
        assert again.loaded_blocks == again.matched_tokens // g.gpu_block_size  # byte-exact (harness)
        if NEWEST:
            assert "load_guarantee=leased" in ready[0] and "reuses a prompt of any length" in ready[0]
            assert again.matched_tokens == n_chunks * BIG
        else:
            reusable = layout.num_slots * BIG
            assert layout.staged_prompt_tokens == reusable == 8 * BIG
            assert "load_guarantee=staged" in ready[0] and f"reuses at most {reusable} tokens of a prompt" in ready[0]
            assert again.matched_tokens == reusable
            # 0.25 and 0.33 tell the spec max_model_len (the harness's is 1M tokens): startup warns.
            cut = [line for line in ready_lines if "reuses at most" in line and "max_model_len" in line]
            assert len(cut) == (1 if layout.max_model_len else 0), ready_lines
            if cut:
                assert f"at most {reusable} of max_model_len {layout.max_model_len}" in cut[0]
