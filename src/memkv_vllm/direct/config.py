"""Direct-mode keys: the `"memkv"` object inside `kv_connector_extra_config`.

    {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.direct",
     "block_size": 256, "memkv": {"staging_mb": 1024}}

vLLM reads the top-level keys (`block_size`, `offload_prompt_only`, ...) itself; ours live in
one nested object so that neither can shadow the other. Values arrive as parsed from JSON. A
key we do not know, or a value of the wrong type or range, is a startup error naming the key
(in every process that builds the spec: the API server, the engine core and each worker).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from memkv.errors import ConfigError
from memkv_vllm.config import check_common_keys

EXTRA_CONFIG_KEY = "memkv"
# 1 GiB: on an H200 a 32k revisit took a median 0.45 / 0.47 s (engine that stored it / restarted)
# against 0.47 / 0.58 s with 512 MiB, 64k 0.90 / 0.84 s against 1.04 / 1.08 s (docs/direct-mode.md)
DEFAULT_STAGING_MB = 1024
DEFAULT_COPY_SCRATCH_MB = 128
SCRATCH, PIECES = "scratch", "pieces"  # copy_method values
LEASED, STAGED = "leased", "staged"  # load_guarantee values (docs/direct-mode.md, "Two load guarantees")


def default_load_guarantee() -> str:
    """ "leased" where vLLM can take a failed load (0.34+: the request recomputes, the engine goes
    on), so a prompt of any length is reused with the default staging_mb; "staged" before, where
    a worker cannot report a failed load and a leased load that fails stops the engine."""
    from memkv_vllm import compat

    return LEASED if compat.load_failure_reportable() else STAGED


@dataclasses.dataclass(frozen=True)
class DirectSettings:
    prefix: str = ""  # key namespace, e.g. one per fleet
    staging_mb: int = DEFAULT_STAGING_MB  # the shared staging region: every chunk in flight, both directions
    # GPU memory per copy direction through which a batch of chunks moves between staging and
    # the KV cache (copies.SectionCopier); 0: one copy_ per (chunk, tensor) run, no GPU memory
    copy_scratch_mb: int = DEFAULT_COPY_SCRATCH_MB
    # How a batch of chunks moves between staging and the KV cache: "pieces" (copies.PieceCopier:
    # one call into C per batch without the GIL: one cudaMemcpyBatchAsync, or a cudaMemcpyAsync per
    # run where the runtime is older than 12.8; no GPU memory; on an
    # H100 a 32k load 5-9x faster than "scratch", docs/direct-mode.md) or "scratch"
    # (copies.SectionCopier, through copy_scratch_mb of GPU memory; also where pieces cannot run)
    copy_method: str = PIECES
    n_read_threads: int = 8  # prefetch (load) priority threads
    n_write_threads: int = 8  # put (store) priority threads
    blocks_per_op: int = 8  # chunks per batched request
    lookup_timeout_s: float = 5.0  # an exists probe or prefetch unresolved this long answers MISS; <= 0 disables
    load_failure_grace_s: float = 60.0  # RDMA: a failed prefetch's slot stays quarantined this long
    step_yield_ms: float = 1.0  # switch interval (memkv_vllm/gil.py) while a lookup or load is open; 0: left alone
    store_nice: int = 10  # the put threads' nice above the engine's (memkv_vllm/priority.py); 0: the engine's
    # "leased": HIT = every rank's value exists and is leased on its node; workers stream it
    # through staging (any prompt length). "staged": HIT = already in staging and verified (a
    # prompt reuses at most staging_mb's worth of chunks). Default: default_load_guarantee().
    load_guarantee: str = dataclasses.field(default_factory=lambda: default_load_guarantee())
    lease_ttl_s: float = 60.0  # leased: a lookup's lease, renewed every third of it while needed
    load_retry_s: float = 30.0  # leased: how long a worker retries a fetch before the load fails

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> DirectSettings:
        raw = (extra_config or {}).get(EXTRA_CONFIG_KEY, {})
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"MemKV direct mode: kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] must be an "
                f"object, got {type(raw).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"MemKV direct mode: unknown key(s) {unknown} in kv_connector_extra_config"
                f"[{EXTRA_CONFIG_KEY!r}]; known keys: {sorted(known)}"
            )
        settings = cls(**raw)
        settings._validate()
        return settings

    def _validate(self) -> None:
        def fail(key: str, want: str) -> None:
            raise ConfigError(f"MemKV direct mode: {EXTRA_CONFIG_KEY}.{key} must be {want}, got {getattr(self, key)!r}")

        check_common_keys(self, fail, (("staging_mb", 1, 1 << 20), ("copy_scratch_mb", 0, 1 << 16)))
        if self.copy_method not in (SCRATCH, PIECES):
            fail("copy_method", f'"{SCRATCH}" or "{PIECES}"')
        if self.load_guarantee not in (LEASED, STAGED):
            fail("load_guarantee", f'"{LEASED}" or "{STAGED}"')
        for key, hi in (("lease_ttl_s", 3600.0), ("load_retry_s", 3600.0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
                fail(key, f"a number in (0, {hi:g}]")

    @property
    def leased(self) -> bool:
        return self.load_guarantee == LEASED

    @property
    def staging_bytes(self) -> int:
        return self.staging_mb << 20

    @property
    def copy_scratch_bytes(self) -> int:
        return self.copy_scratch_mb << 20

    @property
    def deadline_s(self) -> float | None:
        return self.lookup_timeout_s if self.lookup_timeout_s > 0 else None
