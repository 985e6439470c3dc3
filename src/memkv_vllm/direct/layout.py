"""Where a chunk's bytes sit in the staging region, shared by the scheduler and every worker.

Both sides compute it from the spec alone (same extra_config, same KV geometry), so nothing
about it travels in the job: a job names staging slots, the layout says where rank r's bytes of
a slot are. See memkv_vllm.direct.staging for the region and memkv_vllm.direct.worker for the
byte order inside one rank's section.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from vllm.v1.kv_offload.base import LoadStoreSpec

from memkv_vllm import compat
from memkv_vllm.direct.staging import PAGE_BYTES, round_up

STAGING_DIR = "/dev/shm"


@dataclasses.dataclass(frozen=True)
class StagingLayout:
    rank: int
    world_size: int
    blocks_per_chunk: int
    value_bytes: int  # one rank's bytes of one chunk: one MemKV value
    section_bytes: int  # value_bytes rounded up to a page: rank r's section starts at r * section_bytes
    num_slots: int
    path: str
    tokens_per_chunk: int = 0  # prompt tokens per chunk (one key of one KV group)
    num_groups: int = 1  # offloaded KV groups: each span of the prompt takes one chunk per group
    max_model_len: int = 0  # 0: unknown (vLLM < 0.33 does not tell the spec)

    @property
    def staged_prompt_tokens(self) -> int:
        """load_guarantee "staged": the most prompt tokens one request can reuse (its HIT chunks
        must all sit in staging at once; the rest of the prompt is recomputed)."""
        return self.num_slots // self.num_groups * self.tokens_per_chunk

    @property
    def slot_bytes(self) -> int:
        return self.world_size * self.section_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def section_offset(self, slot: int, rank: int) -> int:
        return slot * self.slot_bytes + rank * self.section_bytes

    @classmethod
    def for_spec(cls, spec, staging_bytes: int) -> StagingLayout:
        g = compat.spec_geometry(spec)
        value_bytes = g.worker_bytes_per_block * g.blocks_per_chunk
        if value_bytes <= 0:
            raise ValueError(f"MemKV direct mode: a chunk holds {value_bytes} bytes per worker")
        section = round_up(value_bytes, PAGE_BYTES)
        slot_bytes = g.world_size * section
        num_slots = staging_bytes // slot_bytes
        if num_slots < 1:
            from memkv.errors import ConfigError

            raise ConfigError(
                f"MemKV direct mode: memkv.staging_mb ({staging_bytes >> 20} MiB) holds no chunk: one "
                f"chunk is {slot_bytes} bytes over {g.world_size} rank(s); raise staging_mb to at "
                f"least {-(-slot_bytes // (1 << 20))} or use a smaller block_size"
            )
        # engine_id is unique per engine (per DP rank) and the same in its scheduler and workers.
        digest = hashlib.sha256(g.engine_id.encode()).hexdigest()[:16]
        path = os.path.join(STAGING_DIR, f"memkv_direct_{digest}.staging")
        return cls(
            g.rank,
            g.world_size,
            g.blocks_per_chunk,
            value_bytes,
            section,
            num_slots,
            path,
            g.tokens_per_chunk,
            g.num_groups,
            g.max_model_len,
        )


class MemKVLoadStoreSpec(LoadStoreSpec):
    """The MemKV side of one job, as the manager returns it from prepare_store / prepare_load, in
    the job's key order: load_guarantee "staged": the staging slot of each chunk (`slots`);
    "leased": each chunk's MemKV key without its rank suffix (`keys`: the worker appends
    `/r<rank>` and moves the value itself). Pickled to every worker unchanged, so plain
    attributes only."""

    def __init__(self, slots: list[int], keys: list[bytes] | None = None) -> None:
        self.slots = [int(s) for s in slots]
        self.keys = None if keys is None else [bytes(k) for k in keys]

    @staticmethod
    def medium() -> str:  # abstract on 0.25 (never called for this spec); a plain attribute later
        return "MEMKV"

    def __repr__(self) -> str:
        if self.keys is not None:
            return f"MemKVLoadStoreSpec(keys={len(self.keys)})"
        return f"MemKVLoadStoreSpec(slots={self.slots})"
