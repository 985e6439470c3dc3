"""vLLM plugin: registers the `memkv` secondary tier for TieringOffloadingSpec.

vLLM calls `register()` through the `vllm.general_plugins` entry point `memkv_tier` in every
process it starts (API server, engine core, workers), possibly more than once. Registration is
lazy (vLLM imports `memkv_vllm.tier` only when a `memkv` tier is configured), idempotent, and
never raises: a broken registration must not stop an engine that does not use the tier.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.memkv_vllm")

TIER_TYPE = "memkv"
TIER_MODULE = "memkv_vllm.tier"
TIER_CLASS = "MemKVSecondaryTierManager"


def register() -> None:
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except Exception as exc:  # vLLM absent, or a release without the tiering framework
        log.debug("memkv tier not registered: vLLM tiering unavailable (%s)", exc)
        return
    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, TIER_MODULE, TIER_CLASS)
    except ValueError:
        pass  # already registered in this process
    except Exception as exc:
        log.warning("memkv tier registration failed: %s", exc)
