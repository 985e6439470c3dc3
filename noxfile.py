"""Conformance matrix: the memkv tier against vLLM's real tiering classes, per release.

One session per vLLM release, named ``conformance-<release>`` and tagged ``conformance``:

    nox -s conformance-0.25.0               # one release
    nox -s conformance-0.25.0 -- -k fs -x   # arguments after -- go to pytest
    nox -t conformance                      # the full matrix, one release after another
    nox -R -s conformance-0.34.0            # rerun on the existing venv, skip installs
    nox -R -s conformance-0.34.0 -- -k "tls and not plain"   # only the runs against TLS nodes
    nox -l                                  # list the sessions

Each venv is ~2 GB and takes ~1 min to build (torch + vLLM + the import-time dependencies).
Delete the ones you no longer need with ``rm -rf .nox/conformance-0-25-0``.

Install recipe (see the vLLM tier API reference, section 9):

* ``torch==2.13.0``: on the project's CPU machines pip's constraints resolve this to the local
  ``+cpu`` wheel. It runs the scheduler-side tiering code of every release, including those
  whose METADATA pins torch 2.11.0 or 2.14.0; the session refuses a CUDA build.
* the vLLM wheel with ``--no-deps``: its METADATA pins CUDA-only packages and another torch.
* ``VLLM_IMPORT_DEPS[release]``: exactly what ``import vllm.v1.kv_offload.tiering.manager``
  needs on that release (found by trial import, not from METADATA), with ``xgrammar`` split
  off to a ``--no-deps`` install because its dependencies pull in triton (~1 GB).
"""

from __future__ import annotations

import glob
import os

import nox

VLLM_RELEASES = [
    "0.25.0",
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
]

# What each release needs to import its tiering code on a CPU box, beyond torch and vLLM:
# "deps" go to one pip call, "no_deps" to a second one with --no-deps. Requirement strings
# follow the wheel's own Requires-Dist. 0.27-0.29's tiering code imports less than the others,
# but the offloading connector (tests/conformance/connector_harness.py) needs the engine and
# structured-output set on every release (vllm-connector-api.md section 1), hence one list.
# fmt: off
_COMMON = [
    "numpy", "packaging", "regex", "psutil", "pyzmq>=25.0.0", "urllib3", "cbor2",
    "prometheus_client>=0.18.0",
]
_ENGINE = ["pybase64", "cachetools", "msgspec", "cloudpickle", "uvloop", "py-cpuinfo"]
_STRUCTURED_OUTPUT = ["llguidance<1.8.0,>=1.7.0", "apache-tvm-ffi", "pydantic"]
_API_SERVER = ["fastapi<0.137.0,>=0.133.0", "partial-json-parser"]
_HTTP_OLD = ["aiohttp>=3.13.3", "requests>=2.26.0"]
_HARMONY_OLD = ["openai-harmony>=0.0.3", "openai>=2.0.0"]

_DEPS_0_25 = {
    "deps": _COMMON + _HTTP_OLD + _HARMONY_OLD + ["transformers>=5.5.3", "pillow"]
    + _ENGINE + _STRUCTURED_OUTPUT,
    "no_deps": ["xgrammar<1.0.0,>=0.2.1"],
}

VLLM_IMPORT_DEPS: dict[str, dict[str, list[str]]] = {
    "0.25.0": _DEPS_0_25,
    "0.25.1": _DEPS_0_25,
    "0.26.0": _DEPS_0_25,
    "0.27.0": _DEPS_0_25,
    "0.27.1": _DEPS_0_25,
    "0.28.0": _DEPS_0_25,
    "0.29.0": {
        "deps": _COMMON + _HTTP_OLD + _HARMONY_OLD + ["transformers>=5.10.4", "pillow"]
        + _ENGINE + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar<1.0.0,>=0.2.1"],
    },
    "0.30.0": {
        "deps": _COMMON + _HTTP_OLD + ["openai-harmony>=0.0.3", "openai>=2.25.0"]
        + ["transformers>=5.10.4", "pillow"] + _ENGINE + _API_SERVER + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar<1.0.0,>=0.2.1"],
    },
    "0.31.0": {
        "deps": _COMMON + _HTTP_OLD + ["oss-harmony>=0.0.11", "openai>=2.25.0"]
        + ["transformers<5.18.0,>=5.10.4", "pillow"] + _ENGINE + _API_SERVER
        + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar==0.2.7"],
    },
    "0.32.0": {
        "deps": _COMMON + ["aiohttp>=3.14.3", "requests>=2.33.0"]
        + ["oss-harmony>=0.0.11", "openai>=2.25.0"] + ["transformers<5.20.0,>=5.16.1"]
        + ["pillow>=12.3.0"] + _ENGINE + _API_SERVER + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar==0.2.8"],
    },
    "0.33.0": {
        "deps": _COMMON + ["aiohttp>=3.14.4", "requests>=2.33.0"]
        + ["oss-harmony>=0.0.11", "openai>=2.25.0"] + ["transformers<5.21.0,>=5.16.1"]
        + ["pillow>=13.0.0"] + _ENGINE + _API_SERVER + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar==0.2.8"],
    },
    "0.34.0": {
        "deps": _COMMON + ["aiohttp>=3.14.4", "requests>=2.33.0"]
        + ["oss-harmony>=0.0.11", "openai>=2.25.0"] + ["transformers<5.23.0,>=5.16.1"]
        + ["pillow>=13.0.0"] + _ENGINE + _API_SERVER + _STRUCTURED_OUTPUT,
        "no_deps": ["xgrammar==0.2.8"],
    },
}
# fmt: on

TORCH = "torch==2.13.0"

_REFUSE_CUDA_TORCH = (
    "import sys, torch; "
    "sys.exit(f'refusing CUDA torch {torch.__version__}: expected the local CPU wheel') "
    "if torch.version.cuda else None"
)


NIXL = "nixl-cu12==1.5.1"  # the RDMA transport; its metadata pulls a CUDA torch, so --no-deps


def conformance(session: nox.Session, vllm: str, env: dict[str, str] | None = None,
                paths: list[str] | None = None) -> None:
    """Install torch, vLLM ``vllm`` and its import deps, the project; run tests/conformance and the
    tier's fault tests (or ``paths``)."""
    deps = VLLM_IMPORT_DEPS[vllm]
    session.install(TORCH)
    session.run_install("python", "-c", _REFUSE_CUDA_TORCH, silent=True)
    session.install("--no-deps", f"vllm=={vllm}")
    session.install(*deps["deps"])
    if deps["no_deps"]:
        session.install("--no-deps", *deps["no_deps"])
    session.install("-e", ".[test]")
    # The tier's fault tests (tests/faults/test_tier_*.py) need vLLM too, so they run here.
    if env and env.get("MEMKV_TEST_TRANSPORT") == "rdma":
        session.install("--no-deps", NIXL)
    paths = paths or ["-m", "conformance or faults", "tests/conformance", *sorted(glob.glob("tests/faults/test_tier_*.py"))]
    session.run(
        "pytest", *paths,
        *session.posargs,
        env={"PYTHONHASHSEED": "0", **(env or {})},
    )  # fmt: skip


# Explicit names (conformance-0.25.0) rather than nox.parametrize, whose names read
# "conformance(0.25.0)" and need quoting in a shell.
def _register(release: str) -> None:
    def session_fn(session: nox.Session) -> None:
        conformance(session, release)

    session_fn.__doc__ = f"tests/conformance against vLLM {release}"
    nox.session(name=f"conformance-{release}", tags=["conformance"], reuse_venv=True)(
        session_fn
    )


for _release in VLLM_RELEASES:
    _register(_release)


@nox.session(name="conformance-rdma", tags=["conformance"], reuse_venv=True)
def conformance_rdma(session: nox.Session) -> None:
    """tests/conformance on the newest vLLM with loads over RDMA (NIXL, UCX cma on loopback)."""
    # On a host with NVIDIA GPUs NIXL's UCX backend refuses a UCX_TLS without cuda_copy (docs/rdma.md).
    tls = "cma,tcp,self" + (",cuda_copy" if any(os.path.exists(p) for p in ("/dev/nvidia0", "/proc/driver/nvidia/gpus")) else "")
    conformance(session, VLLM_RELEASES[-1], env={"MEMKV_TEST_TRANSPORT": "rdma", "UCX_TLS": tls, "UCX_NET_DEVICES": "lo"})


# The scenarios that matter across hosts, against nodes in network namespaces of their own (tests/netns.py):
# no same-host socket, no shared memory, TCP over a veth pair, as a node on another host is reached.
REMOTE_SCENARIOS = [
    "tests/integration/test_topology.py",  # the topology is what it claims: via=tcp, same_host=0/N
    "tests/faults",  # the client's fault suite and the tier's (killed, stalled, black-holed node; TLS)
    "tests/conformance/test_connector_prefix.py",  # README config: a long prompt whole, restart; backlog prefix
    "tests/conformance/test_memkv_tier.py::test_cascade_then_promotion_after_pool_eviction_is_byte_exact",  # + TLS
    "tests/conformance/test_memkv_tier.py::test_restarted_engine_hits_the_blocks_its_predecessor_stored",
    "tests/conformance/test_memkv_tier.py::test_killed_node_degrades_its_keys_to_miss_and_the_rest_still_promote",
    "tests/conformance/test_memkv_tier.py::test_stalled_node_lookups_resolve_miss_within_lookup_timeout",
    "tests/conformance/test_memkv_tier.py::test_ready_line_says_the_settings_in_force_and_which_receive_loop_runs",
]


@nox.session(name="conformance-remote", tags=["conformance"], reuse_venv=True)
def conformance_remote(session: nox.Session) -> None:
    """The newest vLLM, every node on another host (its own network namespace, MEMKV_TEST_TOPOLOGY=remote):
    the tier's cross-host scenarios and the client's fault suite over TCP only. Needs root and iproute2."""
    conformance(session, VLLM_RELEASES[-1], env={"MEMKV_TEST_TOPOLOGY": "remote"}, paths=REMOTE_SCENARIOS)


@nox.session(name="tests", reuse_venv=True)
def tests(session: nox.Session) -> None:
    """Unit, integration, deployment, fault, security and RDMA tests: real `memkv serve` nodes,
    no vLLM (the tier's fault tests run in the conformance sessions)."""
    session.install("-e", ".[test,ops]")
    session.install("--no-deps", NIXL)  # tests/rdma runs NIXL over UCX tcp and cma on loopback
    session.install("numpy>=1.26")
    session.run("pytest", "tests/unit", "tests/integration", "tests/ops", "tests/faults", "tests/security",
                "tests/rdma", *session.posargs)


@nox.session(name="lint", reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) on both parts (src/memkv, src/memkv_vllm), the tests and bench,
    and mypy --strict on src/memkv, at the versions pinned in pyproject.toml's `lint` extra; the
    per-module exceptions are in pyproject.toml."""
    session.install("-e", ".[lint]")
    session.run("ruff", "check", "src/memkv", "src/memkv_vllm", "tests", "bench")
    session.run("ruff", "format", "--check", "src/memkv", "src/memkv_vllm", "tests", "bench")
    session.run("mypy", "--strict", "src/memkv")
