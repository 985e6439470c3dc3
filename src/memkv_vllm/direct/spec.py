"""`MemKVOffloadingSpec`: vLLM's OffloadingConnector with MemKV as the offload medium.

Selected in `kv_connector_extra_config` (vllm-spec-api.md 2.1):

    {"spec_name": "MemKVOffloadingSpec", "spec_module_path": "memkv_vllm.direct",
     "block_size": 256, "memkv": {"staging_mb": 1024}}

(`spec_module_path` may be left out where the `memkv_tier` plugin entry point is loaded:
it registers the name with OffloadingSpecFactory in every vLLM process.)

vLLM builds the spec in the engine core (scheduler side: `get_manager`) and in every worker
(`get_worker`), with the same extra_config, and resolves the class in the API server for its
metrics. So the constructor only validates (a bad key fails every process at startup, naming
it) and computes the staging layout; the cluster connection and the staging region are made
by the manager, the worker maps the region on its first job.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingSpec

from memkv_vllm import metrics as tm
from memkv_vllm.direct.config import DirectSettings
from memkv_vllm.direct.layout import StagingLayout


class MemKVOffloadingSpec(OffloadingSpec):
    def __init__(self, *args: Any) -> None:
        # 0.25: (vllm_config, kv_cache_config); 0.26+: (config: OffloadingConfig). The base sets
        # the attributes the connector reads, in both shapes.
        super().__init__(*args)
        self.settings = DirectSettings.from_extra_config(self.extra_config)
        self.layout = StagingLayout.for_spec(self, self.settings.staging_bytes)
        if self.settings.leased and self.layout.num_slots < 2:
            from memkv.errors import ConfigError

            raise ConfigError(
                f"MemKV direct mode: memkv.staging_mb ({self.settings.staging_mb} MiB) holds "
                f'{self.layout.num_slots} chunk(s); load_guarantee "leased" streams through at least 2 '
                f"(one per direction): raise staging_mb to {-(-2 * self.layout.slot_bytes // (1 << 20))}"
            )
        self._manager = None
        self._worker = None

    def get_manager(self):
        if self._manager is None:
            if self.settings.leased:
                from memkv_vllm.direct.leased import LeasedDirectManager

                self._manager = LeasedDirectManager(self, self.settings, self.layout)
            else:
                from memkv_vllm.direct.manager import MemKVDirectManager

                self._manager = MemKVDirectManager(self, self.settings, self.layout)
        return self._manager

    def get_worker(self, kv_caches):
        if self._worker is None:
            from memkv_vllm.direct.worker import MemKVDirectWorker

            self._worker = MemKVDirectWorker(kv_caches, self.layout, self.settings)
        return self._worker

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return tm.direct_metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:  # 0.33 only
        return ("memkv_mode", "memkv_servers", "memkv_prefix", "memkv_staging_mb")


__all__ = ["MemKVOffloadingSpec"]
