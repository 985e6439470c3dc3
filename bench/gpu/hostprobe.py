#!/usr/bin/env python3
"""Host dependency probe for `vllm serve` (bench/gpu/stage.md, call 1): which third-party modules
of vLLM 0.25.0's API-server import path the host image lacks, and whether the staged wheels
(c2: the bundle's wheels and serve-wheels, listed by import name in MANIFEST.json) bring them.
Needs neither vLLM nor c2 on the host: it only asks importlib for each module (nothing is
imported), with PYTHONPATH as given (run it with none: the image alone).

The module list: every top-level module loaded by importing vllm.entrypoints.cli.main,
vllm.entrypoints.openai.api_server, the completions route and vllm.v1.engine.async_llm, then
build_app(args, ("generate",)), and uvicorn.Config(...).load() (its runtime protocol: h11),
recorded against vLLM 0.25.0 on 2026-12-01 (stdlib, vLLM itself and memkv left out).

Usage: python3 bench/gpu/hostprobe.py [MANIFEST.json]   (exit 0 always: it informs)
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys

SERVE_PATH_MODULES = """
PIL aiohappyeyeballs aiohttp aiosignal annotated_doc annotated_types anyio attr cachetools cbor2 certifi
charset_normalizer click cloudpickle cpuinfo dill fastapi filelock frozenlist h11 httpcore2 httpx2
huggingface_hub idna jinja2 jmespath llguidance markupsafe model_hosting_container_standards mpmath msgspec
multidict networkx numpy openai openai_harmony packaging partial_json_parser prometheus_client
prometheus_fastapi_instrumentator propcache psutil pybase64 pydantic pydantic_core regex requests safetensors
setuptools sniffio starlette sympy tokenizers torch tqdm transformers triton truststore tvm_ffi typing_extensions
typing_inspection urllib3 uvicorn uvloop watchfiles xgrammar xxhash yaml yarl zmq jwt blake3 diskcache depyf
astor lark gguf pythonjsonlogger ijson setproctitle distro
""".split()  # noqa: SIM905 (a whitespace-separated block reads and diffs easier than a list literal)


def main() -> int:
    staged: dict[str, str] = {}
    if len(sys.argv) > 1:
        try:
            with open(sys.argv[1]) as f:
                for whl, mods in json.load(f).items():
                    for m in mods:
                        staged.setdefault(m, whl)
        except OSError as exc:
            print(f"hostprobe: no manifest ({exc}); reporting the host alone")
    missing, present = [], []
    for mod in SERVE_PATH_MODULES:
        try:
            found = importlib.util.find_spec(mod) is not None
        except Exception:
            found = False
        (present if found else missing).append(mod)
    print(
        f"hostprobe: python {platform.python_version()}, {len(present)} of {len(SERVE_PATH_MODULES)} "
        f"serve-path modules on the host image"
    )
    covered = [m for m in missing if m in staged]
    uncovered = [m for m in missing if m not in staged]
    print(f"hostprobe: missing on the host, staged in c2: {' '.join(covered) or '-'}")
    if uncovered:
        print(f"hostprobe: MISSING AND NOT STAGED (vllm serve will fail to import): {' '.join(uncovered)}")
    else:
        print("hostprobe: every serve-path module is on the host or in c2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
