"""What the conformance harnesses' own stand-ins must do differently per vLLM release (0.25.0-0.34.0).

One module for every harness: vllm_harness (the manager), scheduler_standin (the scheduler
loop under connector_harness, tier mode, and direct_harness, direct mode) and direct_harness
import it, so a release difference in *our stand-ins* (not in the product: that is
src/memkv_vllm/compat.py) is handled once. Each helper
names the releases it serves and detects the feature where vLLM offers one to detect.

For the direct harness (0.34.0): build config dataclasses with ``fill_dataclass`` (it skips
computed fields such as ``KVCacheConfig.needs_kv_cache_zeroing``), give request stand-ins
``request_fields()`` and VllmConfig stand-ins ``vllm_config_fields()``. 0.34 removed
``vllm.v1.worker.kv_connector_model_runner_mixin`` (the engine's connector calls moved to
``vllm/v1/worker/gpu/kv_connector.py``, same call order); no harness imports either module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import vllm


def vllm_version() -> tuple[int, int, int]:
    """The running vLLM as (major, minor, patch); a dev or local suffix is ignored."""
    parts = []
    for piece in str(vllm.__version__).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def fill_dataclass(cls: type, values: Mapping[str, Any]) -> Any:
    """Build (frozen) config dataclass ``cls`` from whichever of ``values`` it has fields for.

    0.26+: OffloadingConfig and its parts gain fields release by release (group_id 0.30,
    data_parallel_size 0.28, max_model_len 0.33, ...); fields it lacks are left out. 0.34:
    ``KVCacheConfig.needs_kv_cache_zeroing`` is computed in ``__post_init__`` (``init=False``),
    so fields that are not constructor arguments are never passed nor required. A required
    field we have no value for is a harness bug, reported by name.
    """
    fields = [f for f in dataclasses.fields(cls) if f.init]
    missing = [
        f.name
        for f in fields
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise TypeError(f"harness has no value for required {cls.__name__} fields {missing}")
    return cls(**{f.name: values[f.name] for f in fields if f.name in values})


def request_fields() -> dict[str, Any]:
    """The attributes of vllm.v1.request.Request that the offloading connector reads, beyond
    ids, tokens, status and hashes, at their values for a plain request:

    * ``skip_reading_prefix_cache`` (0.25-0.33), renamed ``skip_reading_external_kv`` in 0.34;
      both are set so that either connector finds its name;
    * ``shared_prefix_boundary`` (0.30+), ``kv_hints`` (0.31+);
    * ``resumable`` (0.34: a streaming-input session; only with lookahead hashes),
      ``num_in_flight_tokens`` and ``num_stale_output_tokens`` (0.34: async scheduling's
      tokens not yet sampled; 0 without it), ``lora_request`` (0.34's events read it).
    """
    return {
        "skip_reading_prefix_cache": False,
        "skip_reading_external_kv": False,
        "shared_prefix_boundary": 0,
        "kv_hints": None,
        "resumable": False,
        "num_in_flight_tokens": 0,
        "num_stale_output_tokens": 0,
        "lora_request": None,
    }


def vllm_config_fields() -> dict[str, Any]:
    """Top-level VllmConfig attributes a stand-in needs beyond the sub-configs: 0.34 reads
    ``num_hash_lookahead_tokens`` (tokens each block hash covers ahead of the block, > 0 only
    with speculative decoding, whose keys then differ); no release before reads it."""
    return {"num_hash_lookahead_tokens": 0}


# 0.25-0.33: the connector hands a store job's keys to the manager (and the manager to a tier)
# as a *set*, in hash order. 0.34: a tuple in prompt order (TransferJobStatus.keys). A test of
# the job shape asserts the running release's real shape; this is that release's expectation,
# from the release number and not from what the harness observed.
STORE_JOB_KEYS_IN_PROMPT_ORDER = vllm_version() >= (0, 34, 0)
