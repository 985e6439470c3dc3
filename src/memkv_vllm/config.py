"""Tier keys of `{"type": "memkv", ...}` in `secondary_tiers`: defaults and validation.

Values arrive as parsed from JSON (no coercion by vLLM). A key this tier does not know, or a
value of the wrong type or range, is a startup error naming the key: a typo must not silently
fall back to a default on a production fleet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from memkv.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TierSettings:
    prefix: str = ""  # key namespace, e.g. one per fleet (and a lane on the nodes)
    n_read_threads: int = 8  # load (promotion) priority threads
    n_write_threads: int = 8  # store (cascade) priority threads
    blocks_per_op: int = 8  # blocks per batched request
    load_failure_grace_s: float = 60.0  # withhold a failed load's report while a transfer could land
    max_store_backlog_mb: int | None = (
        None  # store jobs queued or in flight above this are shed; None: half the CPU pool
    )
    lookup_timeout_s: float = 5.0  # a lookup unresolved this long answers MISS; <= 0 disables
    step_yield_ms: float = 1.0  # switch interval (gil.py) while a lookup or promotion is in flight; 0: left alone
    store_nice: int = 10  # the store threads' nice above the engine's (priority.py); 0: the engine's
    locality: str | None = None

    @classmethod
    def from_tier_config(cls, config: Mapping[str, Any]) -> TierSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ConfigError(f"memkv tier: unknown key(s) {unknown}; known keys: {sorted(known - {'locality'})}")
        settings = cls(**config)
        settings._validate()
        return settings

    def _validate(self) -> None:
        def fail(key: str, want: str) -> None:
            raise ConfigError(f"memkv tier: {key} must be {want}, got {getattr(self, key)!r}")

        check_common_keys(self, fail, (("max_store_backlog_mb", 1, 1 << 30),), optional=("max_store_backlog_mb",))
        if self.locality not in (None, "LOCAL", "REMOTE"):
            fail("locality", '"LOCAL" or "REMOTE"')

    def store_backlog_bytes(self, pool_bytes: int) -> int:
        """The backlog bound: `max_store_backlog_mb`, or by default half of the CPU pool (the
        seed's rule for the key: stores in flight pin pool rows, so they may hold at most half)."""
        if self.max_store_backlog_mb is not None:
            return self.max_store_backlog_mb << 20
        return max(1, pool_bytes // 2)

    @property
    def lookup_deadline_s(self) -> float | None:
        return self.lookup_timeout_s if self.lookup_timeout_s > 0 else None


def check_common_keys(
    settings: Any,
    fail: Callable[[str, str], None],
    int_ranges: tuple[tuple[str, int, int], ...] = (),
    optional: tuple[str, ...] = (),
) -> None:
    """The checks the tier's keys and direct mode's keys share (prefix, threads, blocks_per_op,
    store_nice, deadlines, step_yield_ms), plus `int_ranges` of the caller's own; `optional` keys may be None.
    `fail(key, want)` raises the caller's ConfigError naming the key."""
    if not isinstance(settings.prefix, str) or len(settings.prefix.encode()) > 128:
        fail("prefix", "a string of at most 128 bytes")
    for key, lo, hi in (
        ("n_read_threads", 1, 256),
        ("n_write_threads", 1, 256),
        ("blocks_per_op", 1, 4096),
        ("store_nice", 0, 19),
        *int_ranges,
    ):
        v = getattr(settings, key)
        if key in optional and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            fail(key, f"an integer in {lo}..{hi}")
    for key in ("load_failure_grace_s", "lookup_timeout_s"):
        v = getattr(settings, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            fail(key, "a number")
    if settings.load_failure_grace_s < 0:
        fail("load_failure_grace_s", ">= 0")
    v = settings.step_yield_ms
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 50:
        fail("step_yield_ms", "a number in 0..50")
