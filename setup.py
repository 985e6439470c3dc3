"""The one compiled piece: memkv._recv_verify (csrc/recv_verify.c), optional.

Everything else is in pyproject.toml. The extension is built when a C compiler and Python's
headers are there; when they are not, `pip install .` still succeeds (optional=True) and the
client uses its pure-Python receive loop (memkv/sockio.py), which stays the reference.
It uses the stable ABI (abi3, Python 3.11+), so one build loads on every later Python.
"""

from __future__ import annotations

import platform
import sys

from setuptools import Extension, setup

sources = ["csrc/recv_verify.c", "csrc/xxhash/xxhash.c"]
macros = []
if platform.machine().lower() in ("x86_64", "amd64"):
    # Runtime choice of SSE2 / AVX2 / AVX-512, as python-xxhash builds it.
    sources.append("csrc/xxhash/xxh_x86dispatch.c")
    macros.append(("MEMKV_XXH_X86_DISPATCH", "1"))

ext_modules = []
if sys.version_info >= (3, 11) and sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "memkv._recv_verify",
            sources=sources,
            include_dirs=["csrc/xxhash"],
            define_macros=macros,
            extra_compile_args=["-O2"],
            py_limited_api=True,
            optional=True,
        )
    )

setup(ext_modules=ext_modules, options={"bdist_wheel": {"py_limited_api": "cp311"}} if ext_modules else {})
