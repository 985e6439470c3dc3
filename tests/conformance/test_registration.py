"""The `memkv_tier` entry point: found by vLLM's plugin loader, registers tier type `memkv`
lazily (memkv_vllm.tier is not imported until a tier is built) and idempotently, and never
raises, even when vLLM's tiering module cannot be imported. Each case runs in a fresh process,
as vLLM runs plugins in each of its processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.conformance


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_entry_point_is_declared_in_the_vllm_plugin_group():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("memkv_tier") == "memkv_vllm:register"


def test_vllm_plugin_loader_registers_memkv_lazily_and_idempotently():
    out = run_python("""
        import sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        load_general_plugins()  # vLLM may call it more than once per process
        import memkv_vllm
        memkv_vllm.register()
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        print("registered", "memkv" in SecondaryTierFactory._registry)
        print("tier imported", "memkv_vllm.tier" in sys.modules)
        cls = SecondaryTierFactory.get_tier_class({"type": "memkv"})
        print("class", cls.__name__)
    """)
    assert "registered True" in out
    assert "tier imported False" in out  # registration adds no imports
    assert "class MemKVSecondaryTierManager" in out


def test_register_never_raises_when_vllm_tiering_is_broken():
    out = run_python("""
        import sys
        sys.modules["vllm.v1.kv_offload.tiering.factory"] = None  # import now raises ImportError
        import memkv_vllm
        memkv_vllm.register()
        print("survived")
    """)
    assert "survived" in out
