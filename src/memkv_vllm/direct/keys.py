"""Direct-mode MemKV keys: one value per rank per chunk.

    <tier namespace: prefix><model>_<layout hash>/b<value bytes>/  d<world size>v<vLLM major.minor>/<group>/<block hash hex>/r<rank>

The namespace is memkv_vllm.keys.KeyNamespace (the tier's: model, dtype, block sizes and
parallel layout from vLLM's FileMapper) with the *value* size in place of the tier's row size,
followed by `d<world size>v<major.minor>/`: a direct value is one rank's bytes of one chunk,
laid out by memkv_vllm.direct.worker, which is not a tier row (all ranks plus padding), so the
two modes never read each other's values, engines with another TP size never read a shard of
the wrong width, and engines of another vLLM release (which may lay out GPU pages differently)
never read bytes of another layout. Everything in a key is content or layout: a restarted engine, or another engine
with the same model and layout (and the same PYTHONHASHSEED, see compat.block_hash_reuse_problem),
finds the same keys.
"""

from __future__ import annotations

from memkv_vllm import compat
from memkv_vllm.keys import KeyNamespace


class DirectKeys:
    def __init__(self, prefix: str, offloading_spec, value_bytes: int, world_size: int) -> None:
        self._base = KeyNamespace(prefix, offloading_spec, value_bytes)
        self.world_size = world_size
        self.namespace = self._base.namespace + f"d{world_size}{compat.vllm_release_tag()}/"
        self._ns = self.namespace.encode()
        self.record = {
            **self._base.record,
            "mode": "direct",
            "world_size": world_size,
            "value_bytes": value_bytes,
            "key_format": "memkv_vllm/direct/1",
        }

    def chunk_prefix(self, offload_key: bytes) -> bytes:
        block_hash, group = compat.block_hash_and_group(offload_key)
        return self._ns + b"%d/" % group + block_hash.hex().encode()

    def value_key(self, offload_key: bytes, rank: int) -> bytes:
        return self.chunk_prefix(offload_key) + b"/r%d" % rank

    def value_keys(self, offload_key: bytes) -> list[bytes]:
        """The chunk's values, rank 0 first."""
        base = self.chunk_prefix(offload_key)
        return [base + b"/r%d" % r for r in range(self.world_size)]

    def probe_keys(self, offload_keys: list[bytes]) -> list[bytes]:
        """What a lookup asks `exists` about: one value per chunk (the last rank's). A HIT is
        only answered after the prefetch has received and verified every rank's value."""
        last = self.world_size - 1
        return [self.value_key(k, last) for k in offload_keys]

    @property
    def config_key(self) -> bytes:
        return self._ns + b"config"

    def config_record(self) -> bytes:
        import json

        return json.dumps(self.record, sort_keys=True, default=str).encode()
