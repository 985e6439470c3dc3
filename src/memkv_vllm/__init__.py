"""vLLM plugin: registers the `memkv` secondary tier and the direct-mode `MemKVOffloadingSpec`.

vLLM calls `register()` through the `vllm.general_plugins` entry point `memkv_tier` in every
process it starts (API server, engine core, workers), possibly more than once. Registration is
lazy (vLLM imports `memkv_vllm.tier` only when a `memkv` tier is configured, and
`memkv_vllm.direct` only when `spec_name` is `MemKVOffloadingSpec`), idempotent, and never
raises: a broken registration must not stop an engine that uses neither.

The direct spec needs no registration where `spec_module_path: "memkv_vllm.direct"` is given
(every release 0.25-0.33 imports the module by path); registering the name lets a config that
names only `spec_name` work too, in processes that load the plugin.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.memkv_vllm")

TIER_TYPE = "memkv"
TIER_MODULE = "memkv_vllm.tier"
TIER_CLASS = "MemKVSecondaryTierManager"

DIRECT_SPEC_NAME = "MemKVOffloadingSpec"
DIRECT_SPEC_MODULE = "memkv_vllm.direct"


def register() -> None:
    _register_tier()
    _register_direct_spec()


def _register_tier() -> None:
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


def _register_direct_spec() -> None:
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except Exception as exc:
        log.debug("memkv direct spec not registered: vLLM offloading unavailable (%s)", exc)
        return
    if not hasattr(OffloadingSpecFactory, "register_spec"):
        return  # spec_module_path still works
    try:
        # Lazy: the factory stores a loader that imports the module on first use (0.25-0.33).
        OffloadingSpecFactory.register_spec(DIRECT_SPEC_NAME, DIRECT_SPEC_MODULE, DIRECT_SPEC_NAME)
    except ValueError:
        pass  # already registered in this process
    except Exception as exc:
        log.warning("memkv direct spec registration failed: %s", exc)
