"""MemKV keys for offloaded blocks: vLLM's content hashes, namespaced by model and KV layout.

    <prefix><model>_<layout hash>/b<row bytes>/<group>/<block hash hex>

`<model>_<layout hash>` is the directory name vLLM's FileMapper gives the fs tier (the model
name plus a hash of dtype, block sizes and parallel layout), so two engines with the same model
and layout share keys and a different layout never collides. The row size is added because a
row holds every tensor-parallel rank's slice plus padding: engines whose rows differ could not
load each other's values anyway. `<namespace>config` holds a JSON record of what the namespace
means (written once per namespace).
"""

from __future__ import annotations

import hashlib
import json
import os

from memkv_vllm import compat

MAX_NAMESPACE_BYTES = 320  # keeps keys under the node's 480-byte limit with a 64-hex hash


class KeyNamespace:
    def __init__(self, prefix: str, offloading_spec, row_bytes: int) -> None:
        mapper = compat.file_mapper_for(offloading_spec, "memkv")
        base = os.path.basename(os.path.dirname(mapper.get_config_file_path()))  # <model>_<hash12>
        namespace = f"{prefix}{base}/b{row_bytes}/"
        if len(namespace.encode()) > MAX_NAMESPACE_BYTES:  # a very long model path: hash it
            digest = hashlib.sha256(base.encode()).hexdigest()[:24]
            namespace = f"{prefix}{digest}/b{row_bytes}/"
        self.namespace = namespace
        self._ns = namespace.encode()
        self.record = {**mapper.get_run_config(), "row_bytes": row_bytes, "key_format": "memkv_vllm/1"}

    def key(self, offload_key: bytes) -> bytes:
        block_hash, group = compat.block_hash_and_group(offload_key)
        return self._ns + b"%d/" % group + block_hash.hex().encode()

    def keys(self, offload_keys) -> list[bytes]:
        return [self.key(k) for k in offload_keys]

    @property
    def config_key(self) -> bytes:
        return self._ns + b"config"

    def config_record(self) -> bytes:
        return json.dumps(self.record, sort_keys=True, default=str).encode()
