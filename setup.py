"""The compiled pieces, both optional: memkv._recv_verify (csrc/recv_verify.c, csrc/xxh3_avx2.c), the
client's receive and copy loops, and memkv_vllm._copy_pieces (csrc/copy_pieces.c), direct mode's batched
staging <-> KV-cache copies.

Everything else is in pyproject.toml. memkv._recv_verify is built when a C compiler, Python's
headers and xxHash's header are there (Debian/Ubuntu: `apt-get install gcc libxxhash-dev`; xxHash
is inlined from its header, nothing links against it); memkv_vllm._copy_pieces needs only the
first two. When one is missing, `pip install .` still succeeds (optional=True): the client uses
its pure-Python loops (memkv/sockio.py, memkv/client/shared.py), which stay the reference, and
direct mode copies through its GPU scratch (SectionCopier). Both use the stable ABI (abi3,
Python 3.11+), so one build loads on every later Python.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.version_info >= (3, 11) and sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "memkv._recv_verify",
            # xxh3_avx2.c compiles to nothing off x86-64; recv_verify.c then keeps the baseline loop.
            sources=["csrc/recv_verify.c", "csrc/xxh3_avx2.c"],
            extra_compile_args=["-O2"],
            py_limited_api=True,
            optional=True,
        )
    )
    # Direct mode's batched staging <-> KV-cache copies (memkv_vllm/direct/copies.py PieceCopier).
    ext_modules.append(
        Extension(
            "memkv_vllm._copy_pieces",
            sources=["csrc/copy_pieces.c"],
            extra_compile_args=["-O2"],
            py_limited_api=True,
            optional=True,
        )
    )

setup(ext_modules=ext_modules, options={"bdist_wheel": {"py_limited_api": "cp311"}} if ext_modules else {})
