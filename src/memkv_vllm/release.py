"""Which vLLM release runs, and whether it is one the project qualified (docs/compatibility.md).

The tier and direct mode both name it in their ready line (`vllm_field()`) and call
`warn_if_unqualified()` once they are up: a release outside the list logs one WARNING per
process that names scripts/compat_matrix.py, the script that qualifies a release. It never
refuses to start: the shims in compat.py detect features, not version numbers, so a newer
release usually works; it has just not been run through the matrix.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("vllm.memkv_vllm")

# Every release scripts/compat_matrix.py ran green at both layers (manager and connector, tier
# and direct mode). Add a release here only with its matrix row in docs/compatibility.md.
QUALIFIED_RELEASES = (
    "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
    "0.32.0", "0.33.0", "0.34.0",
)  # fmt: skip

_warned = False
_warned_lock = threading.Lock()


def running_release() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_qualified(release: str) -> bool:
    return release in QUALIFIED_RELEASES


def vllm_field() -> str:
    """The ready line's field, e.g. `vllm=0.34.0 (qualified)`."""
    release = running_release()
    return f"vllm={release} ({'qualified' if is_qualified(release) else 'not qualified'})"


def warn_if_unqualified() -> bool:
    """Log the WARNING for a release outside QUALIFIED_RELEASES, once per process; returns
    whether this call logged it."""
    global _warned
    release = running_release()
    if is_qualified(release):
        return False
    with _warned_lock:
        if _warned:
            return False
        _warned = True
    log.warning(
        "MemKV: vLLM %s is not one of the qualified releases (%s-%s); MemKV adapts to vLLM's API "
        "by feature and starts anyway. Run `scripts/compat_matrix.py %s` to qualify it "
        "(docs/compatibility.md).",
        release,
        QUALIFIED_RELEASES[0],
        QUALIFIED_RELEASES[-1],
        release,
    )
    return True
