"""An RDMA agent that cannot start says why: NIXL's and UCX's own reason, and the GPU-host rule.

Claims: when the UCX backend cannot come up, the RdmaError carries the lines NIXL and UCX wrote
to the process's stderr (NIXL itself raises only NIXL_ERR_BACKEND); what native code writes while
an agent is built is still passed on to the real stdout/stderr; on a host with NVIDIA GPUs a
UCX_TLS without CUDA memory support gets the fix named (add cuda_copy), and nowhere else.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memkv import nixl_adapter
from tests.rdma.conftest import requires_nixl

_SCRIPT = """
from memkv.nixl_adapter import NixlAgent
from memkv.errors import RdmaError
try:
    NixlAgent("client")
except RdmaError as exc:
    print("RDMAERROR", exc)
else:
    print("STARTED")
"""


@requires_nixl
def test_an_agent_that_cannot_start_carries_ucx_and_nixl_reasons():
    env = {**os.environ, "UCX_TLS": "no_such_transport", "UCX_NET_DEVICES": "lo", "MEMKV_NIXL_PROGRESS_DELAY_US": "100"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith(("RDMAERROR", "STARTED"))]
    assert line.startswith("RDMAERROR"), line
    assert "NIXL_ERR_BACKEND" in line
    assert "NIXL/UCX said:" in line and "no_such_transport" in line, line
    # ... and the same lines still reached the process's own output (UCX logs to stdout, NIXL to stderr)
    passed_on = [ln for ln in (out.stdout + out.stderr).splitlines() if not ln.startswith("RDMAERROR")]
    assert any("no_such_transport" in ln for ln in passed_on)
    assert any("backend creation failed" in ln for ln in passed_on)


def test_native_output_is_captured_and_passed_on(capfd):
    with nixl_adapter._native_output() as lines:
        os.write(2, b"UCX  ERROR something native went wrong\n")
        os.write(1, b"an INFO line on stdout\n")
    assert lines == ["an INFO line on stdout", "UCX  ERROR something native went wrong"]
    out, err = capfd.readouterr()
    assert "an INFO line on stdout" in out and "something native went wrong" in err
    assert nixl_adapter._reason(lines) == "UCX  ERROR something native went wrong"


@pytest.mark.parametrize(
    ("tls", "gpu", "hint"),
    [
        ("cma,tcp,self", True, "add cuda_copy (e.g. UCX_TLS=cma,tcp,self,cuda_copy)"),
        ("cma,tcp,self,cuda_copy", True, ""),
        ("^ib", True, ""),  # an exclusion list keeps cuda_copy
        ("all", True, ""),
        ("", True, ""),  # unset: UCX picks, cuda_copy included
        ("cma,tcp,self", False, ""),  # no GPU: nothing to add
    ],
)
def test_the_gpu_host_rule_names_cuda_copy_only_where_nixl_needs_it(monkeypatch, tmp_path, tls, gpu, hint):
    monkeypatch.setenv("UCX_TLS", tls)
    device = tmp_path / "nvidia0"
    if gpu:
        device.touch()
    text = nixl_adapter._ucx_tls_hint((str(device),))
    assert (hint in text) if hint else text == ""
