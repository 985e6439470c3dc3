"""Direct offload mode: MemKV as vLLM's offload medium, with no CPU residency tier in between.

`MemKVOffloadingSpec` (spec.py) is selected by `spec_name` + `spec_module_path:
"memkv_vllm.direct"` in `kv_connector_extra_config`; vLLM imports this package only then.
Scheduler side: manager.py (load_guarantee "staged": lookups, prefetch-and-verify, stores),
leased.py ("leased": lookups that lease), base.py (what both share); worker side: worker.py
(GPU <-> staging copies); staging.py and layout.py: the shared staging region; keys.py: the
rank-qualified MemKV keys; config.py: the `"memkv"` keys. See docs/direct-mode.md.
"""

from memkv_vllm.direct.layout import MemKVLoadStoreSpec
from memkv_vllm.direct.spec import MemKVOffloadingSpec

__all__ = ["MemKVLoadStoreSpec", "MemKVOffloadingSpec"]
