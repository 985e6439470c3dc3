"""Scale knob and figure recording shared by tests/faults and tests/security.

* `MEMKV_FAULT_SCALE` (default 1, the CI size) multiplies every fault-loop count and window:
  `scaled(100)` is 100 in CI and 2000 with MEMKV_FAULT_SCALE=20. Every loop stays bounded by
  both its scaled count and a scaled wall-clock budget.
* `MEMKV_FAULT_REPORT` names a JSON-lines file; `record(test_id, **figures)` appends one line
  per call there (and does nothing without it). scripts/reliability_report.py runs the suite
  with it set and turns the lines into docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import threading
import time

SCALE = max(0.05, float(os.environ.get("MEMKV_FAULT_SCALE", "1") or "1"))
REPORT_PATH = os.environ.get("MEMKV_FAULT_REPORT", "")
_lock = threading.Lock()


def scaled(n: float, minimum: int = 1) -> int:
    """`n` times MEMKV_FAULT_SCALE, at least `minimum`."""
    return max(minimum, round(n * SCALE))


def scaled_s(seconds: float) -> float:
    return seconds * SCALE


def record(test_id: str, **figures) -> None:
    """Append `figures` (JSON-serialisable) for `test_id` to MEMKV_FAULT_REPORT, if set."""
    if not REPORT_PATH:
        return
    line = json.dumps({"test": test_id, "time": time.time(), "scale": SCALE, **figures}, sort_keys=True, default=str)
    with _lock, open(REPORT_PATH, "a") as f:
        f.write(line + "\n")
