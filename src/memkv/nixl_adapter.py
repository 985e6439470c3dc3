"""Every call MemKV makes into NIXL, in one module (nixl-cu12 1.5.1, UCX backend).

A leaf: it imports nothing of MemKV but memkv.errors, so the node's side of RDMA
(memkv/server/rdma.py) and the client's (memkv/transport/rdma.py) both use it without the
node loading any client or transport code.

NIXL is the RDMA library under `memkv.transport` (docs/rdma.md says why: it installs from PyPI
without a GPU, has exactly the one-sided API needed -- register a region once, hand ~300 bytes
of metadata to the peer, WRITE from a local descriptor to a remote `(address, length)` with a
notification -- and vLLM's own NixlConnector uses it). Its Python API is young, so nothing
outside this file imports it: when it changes, this file changes.

Install: `pip install --no-deps nixl-cu12==1.5.1 numpy` (the wheel's declared dependencies pull
a CUDA torch, 5.7 GB; without them it imports and moves DRAM fine). The meta package `nixl` and
`nixl-cu13` work too: `_import_api` tries `nixl`, `nixl_cu12`, `nixl_cu13`.

Traps handled here (measured on this project's machines; docs/rdma.md has the figures):

* **Progress thread busy-poll.** `nixl_agent_config` hard-codes the progress thread's delay to
  0 us: every agent then spins one core even when idle (two agents starve a 2-core box). The
  field exists in the bindings' `nixlAgentConfig` but not in the Python config, so
  `_tamed_agent` substitutes a config subclass that pins `pthrDelay` to
  `MEMKV_NIXL_PROGRESS_DELAY_US` (default 100 us: ~0.02 core idle) while the agent is built.
* **No timeouts.** NIXL has none. `Write.state()` is a non-blocking poll; callers poll it
  against their own deadline. `Write.release()` asks NIXL to cancel an active write and says
  whether it could (a write it cannot cancel must keep its source memory alive).
* **Its own exception classes** (`nixlNotFoundError`, `nixlRemoteDisconnectError`, ...): every
  call is wrapped by `_translate`, the one place they become `RdmaError`.
* **Device selection.** `MEMKV_RDMA_DEVICES=mlx5_0,mlx5_1` becomes `UCX_NET_DEVICES=mlx5_0:1,
  mlx5_1:1` unless UCX_NET_DEVICES is already set (an operator's UCX setting wins). Tests set
  `UCX_NET_DEVICES=lo` and `UCX_TLS=tcp` or `cma,tcp,self` themselves.
* **Logging.** NIXL logs INFO lines to stdout; quieted to WARNING unless NIXL_LOG_LEVEL is set.
* **Reasons in its own log.** When the UCX backend cannot come up, NIXL raises a bare
  `NIXL_ERR_BACKEND` and writes the reason (UCX's and its own log lines) to the process's
  stderr, where a vLLM deployment rarely looks. Agent creation therefore captures the native
  stdout/stderr (`_native_output`) and puts those lines into the RdmaError (on success they are
  passed on unchanged). On a host with NVIDIA GPUs NIXL refuses a `UCX_TLS` without `cuda_copy`
  (measured on the H200 host); the error then says so too (`_ucx_tls_hint`).
* **Exit-time SIGSEGV** when Debian's `ibverbs-providers` is installed next to the wheel's own
  libibverbs (the UCX `efa` module loads the system libefa). Not something code can fix here;
  docs/rdma.md has the workaround.

Threading: a `NixlAgent` is shared by every thread of its process. NIXL's thread-sync mode
is `MEMKV_NIXL_SYNC`: `rw` (default) lets transfers of different threads run concurrently and
makes registrations and peer changes exclusive; `strict` serialises every call into the agent.
Over UCX cma the copy itself (process_vm_writev) runs inside the call that posts a WRITE, so
under `strict` a node copied one value at a time, whatever the number of connections. The UCX
backend gets `MEMKV_NIXL_WORKERS` workers (default 8; NIXL binds each thread to one), so posts
of different threads do not share one UCX worker either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from memkv.errors import ConfigError, RdmaError

log = logging.getLogger("memkv.transport")

ENV_PROGRESS_DELAY_US = "MEMKV_NIXL_PROGRESS_DELAY_US"
DEFAULT_PROGRESS_DELAY_US = 100
ENV_WORKERS = "MEMKV_NIXL_WORKERS"
DEFAULT_WORKERS = 8
ENV_SYNC = "MEMKV_NIXL_SYNC"
DEFAULT_SYNC = "rw"
_SYNC_MODES = {"rw": "NIXL_THREAD_SYNC_RW", "strict": "NIXL_THREAD_SYNC_STRICT"}
_IB_SYSFS = Path("/sys/class/infiniband")
INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 numpy"

# NIXL ships no type information: its objects are `Any` here, and this module is the boundary
# where they become typed values (Registration, Write, str, bytes).
_api: Any = None  # the imported nixl._api module, once
_api_error: str | None = None
_import_lock = threading.Lock()
_build_lock = threading.Lock()  # `_tamed_agent` swaps a module global while an agent is built


def _import_api() -> Any:
    """NIXL's `_api` module, or raise RdmaError saying how to install it."""
    global _api, _api_error
    with _import_lock:
        if _api is None and _api_error is None:
            errors: list[str] = []
            for name in ("nixl", "nixl_cu12", "nixl_cu13"):
                try:
                    mod = __import__(f"{name}._api", fromlist=["nixl_agent"])
                except Exception as exc:  # ImportError, or a broken install raising anything
                    errors.append(f"{name}: {exc}")
                    continue
                if not os.environ.get("NIXL_LOG_LEVEL"):
                    logging.getLogger("nixl").setLevel(logging.WARNING)
                _api = mod
                break
            else:
                _api_error = "; ".join(errors)
        if _api is None:
            raise RdmaError(f"NIXL is not installed ({INSTALL_HINT}): {_api_error}")
        return _api


def nixl_available() -> tuple[bool, str]:
    """(True, version string) when NIXL imports, else (False, why). Never raises."""
    try:
        api = _import_api()
    except RdmaError as exc:
        return False, str(exc)
    pkg = api.__name__.rsplit(".", 1)[0]
    try:
        from importlib.metadata import version

        return True, f"{pkg} {version(pkg.replace('_', '-'))}"
    except Exception:
        return True, pkg


def rdma_devices(configured: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(RDMA devices present on this host, configured names that are not present).

    Present means listed in /sys/class/infiniband (mlx5_*, efa_*, irdma*, rxe*...). With
    `configured` (MEMKV_RDMA_DEVICES), only those names count; a `name:port` entry is checked by
    its name."""
    try:
        present = sorted(p.name for p in _IB_SYSFS.iterdir())
    except OSError:
        present = []
    if not configured:
        return present, []
    names = [d.split(":", 1)[0] for d in configured]
    return [d for d in names if d in present], [d for d in names if d not in present]


def progress_delay_us() -> int:
    """MEMKV_NIXL_PROGRESS_DELAY_US, checked (0 = NIXL's own busy-polling default)."""
    text = os.environ.get(ENV_PROGRESS_DELAY_US, "").strip()
    if not text:
        return DEFAULT_PROGRESS_DELAY_US
    if not text.isdigit() or int(text) > 1_000_000:
        raise ConfigError(f"{ENV_PROGRESS_DELAY_US}: expected microseconds in 0..1000000, got {text!r}")
    return int(text)


def ucx_workers() -> int:
    """MEMKV_NIXL_WORKERS, checked: UCX workers per agent (writes of different threads run in parallel)."""
    text = os.environ.get(ENV_WORKERS, "").strip()
    if not text:
        return DEFAULT_WORKERS
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise ConfigError(f"{ENV_WORKERS}: expected a number of UCX workers in 1..64, got {text!r}")
    return int(text)


def thread_sync() -> str:
    """MEMKV_NIXL_SYNC, checked: `rw` (transfers run concurrently, registrations exclusive) or
    `strict` (every call into the agent serialised)."""
    text = os.environ.get(ENV_SYNC, "").strip() or DEFAULT_SYNC
    if text not in _SYNC_MODES:
        raise ConfigError(f"{ENV_SYNC}: expected one of {sorted(_SYNC_MODES)}, got {text!r}")
    return text


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (no copy; the view stays the caller's)."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


_NATIVE_REASON_LINES = 6  # of NIXL's and UCX's own log, the last lines that say what went wrong
_NATIVE_REASON_CHARS = 1200


@contextlib.contextmanager
def _native_output() -> Iterator[list[str]]:
    """Capture what native code writes to fds 1 and 2 inside the block; yields a list that holds
    the captured lines once the block is left. The bytes are written on to the real fds
    afterwards, so nothing disappears from the process's logs (other threads' output of the same
    moment is delayed, not lost)."""
    import tempfile

    lines: list[str] = []
    for stream in (sys.stdout, sys.stderr):  # Python's own buffered text is not NIXL's
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.ExitStack() as stack:
        saved: list[tuple[int, int, Any]] = []
        try:
            for fd in (1, 2):
                tmp = stack.enter_context(tempfile.TemporaryFile())
                saved.append((fd, os.dup(fd), tmp))
                os.dup2(tmp.fileno(), fd)
        except OSError:  # no fds to capture (closed stdio): run uncaptured
            for fd, copy, _ in saved:
                os.dup2(copy, fd)
                os.close(copy)
            saved = []
        try:
            yield lines
        finally:
            for fd, copy, tmp in saved:
                os.dup2(copy, fd)
                os.close(copy)
                tmp.seek(0)
                data = tmp.read()
                if data:
                    with contextlib.suppress(OSError):
                        os.write(fd, data)
                    lines.extend(line for line in data.decode(errors="replace").splitlines() if line.strip())


def _reason(lines: Sequence[str]) -> str:
    """The lines of NIXL's/UCX's own output that carry a reason, shortened for an error message."""
    keep = [line.strip() for line in lines if any(w in line for w in ("ERROR", "WARN", "Invalid", "Failed", "failed"))]
    keep = (keep or [line.strip() for line in lines])[-_NATIVE_REASON_LINES:]
    text = " | ".join(keep)
    return text if len(text) <= _NATIVE_REASON_CHARS else "..." + text[-_NATIVE_REASON_CHARS:]


NVIDIA_DEVICE_PATHS = ("/dev/nvidia0", "/proc/driver/nvidia/gpus")


def has_nvidia_gpu(paths: Sequence[str] = NVIDIA_DEVICE_PATHS) -> bool:
    return any(os.path.exists(p) for p in paths)


def ucx_tls_for_host(tls: str, paths: Sequence[str] = NVIDIA_DEVICE_PATHS) -> str:
    """`tls` with cuda_copy added on a host with NVIDIA GPUs (NIXL refuses it otherwise)."""
    if tls and not tls.startswith("^") and "cuda" not in tls and has_nvidia_gpu(paths):
        return f"{tls},cuda_copy"
    return tls


def _ucx_tls_hint(nvidia_paths: Sequence[str] = NVIDIA_DEVICE_PATHS) -> str:
    """What to change in UCX_TLS when NIXL would refuse it on an NVIDIA GPU host, else ''."""
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls or tls.startswith("^") or "all" in tls.split(",") or "cuda" in tls:
        return ""
    if not has_nvidia_gpu(nvidia_paths):
        return ""
    return (
        f" -- this host has NVIDIA GPUs, where NIXL's UCX backend refuses UCX_TLS={tls} without CUDA memory "
        f"support: add cuda_copy (e.g. UCX_TLS={tls},cuda_copy)"
    )


@contextlib.contextmanager
def _translate(what: str) -> Iterator[None]:
    """The one place NIXL's exceptions become RdmaError."""
    try:
        yield
    except RdmaError:
        raise
    except Exception as exc:  # NIXL raises nixl*Error (Exception subclasses) and RuntimeError
        raise RdmaError(f"NIXL: cannot {what}: {type(exc).__name__}: {exc}") from exc


def _text(name: object) -> str:
    """Agent names come back as bytes from some NIXL calls and str from others."""
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def _apply_devices(devices: Sequence[str]) -> None:
    if devices and not os.environ.get("UCX_NET_DEVICES"):
        os.environ["UCX_NET_DEVICES"] = ",".join(d if ":" in d else f"{d}:1" for d in devices)


class _BindingsWithTamedConfig:
    """Stands in for `_api.nixlBind` while an agent is built: everything is the real bindings
    module except `nixlAgentConfig`, whose `pthrDelay` assignment is replaced."""

    def __init__(self, real: Any, config_cls: type) -> None:
        self._real = real
        self.nixlAgentConfig = config_cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _tamed_agent(api: Any, name: str, delay_us: int, workers: int, sync: str) -> Any:
    real = api.nixlBind
    base: Any = real.nixlAgentConfig

    class TamedConfig(base):  # type: ignore[misc]  # NIXL's config class is untyped
        def __setattr__(self, field: str, value: object) -> None:
            if field == "pthrDelay":
                value = delay_us
            super().__setattr__(field, value)

    config = api.nixl_agent_config(
        enable_prog_thread=True,  # UCX over tcp needs the *target's* thread to land a WRITE
        enable_listen_thread=False,  # metadata goes over MemKV's authenticated connection
        backends=[],
        sync_mode=getattr(api.nixl_thread_sync_t, _SYNC_MODES[sync]),
    )
    with _build_lock:
        api.nixlBind = _BindingsWithTamedConfig(real, TamedConfig)
        try:
            agent = api.nixl_agent(name, config)
        finally:
            api.nixlBind = real
    # UCX's params are strings; num_workers UCX workers, each thread sticks to one (NIXL picks).
    with _translate("create the UCX backend"):
        agent.create_backend("UCX", {"num_workers": str(workers)})
    return agent


class Registration:
    """One registered region: `address`, `length` and NIXL's descriptor list."""

    __slots__ = ("_descs", "address", "length")

    def __init__(self, address: int, length: int, descs: Any) -> None:
        self.address = address
        self.length = length
        self._descs = descs

    def covers(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length


class Write:
    """One posted WRITE. Poll `state()`; call `release()` exactly once when done with it."""

    __slots__ = ("_agent", "_handle", "posted")

    def __init__(self, agent: Any, handle: Any, posted: str) -> None:
        self._agent = agent
        self._handle = handle
        self.posted = posted  # the state `transfer()` returned

    def state(self) -> str:
        """ "DONE", "PROC" (in flight) or "ERR". Never blocks."""
        if self.posted != "PROC":
            return self.posted
        with _translate("check a write's state"):
            self.posted = self._agent.check_xfer_state(self._handle)
        return self.posted

    def release(self) -> bool:
        """Free the handle; an active write is cancelled first. False when NIXL could not cancel
        it (the write may still read its source and land: keep both alive, retry later)."""
        try:
            self._agent.release_xfer_handle(self._handle)
        except Exception as exc:  # NIXL: "if it cannot be canceled, an error will be returned"
            log.debug("NIXL could not release an active write: %s", exc)
            return False
        return True


class NixlAgent:
    """One NIXL agent with the UCX backend and a tamed progress thread.

    `role` ("client" or "node") goes into the agent's name with a random suffix; peers learn the
    name from the metadata. Raises RdmaError when NIXL is missing or UCX does not come up.
    """

    def __init__(self, role: str, devices: Sequence[str] = ()) -> None:
        api = _import_api()
        delay_us = progress_delay_us()
        workers = ucx_workers()
        sync = thread_sync()  # bad values fail here, before NIXL starts
        _apply_devices(devices)
        self.name = f"memkv-{role}-{uuid.uuid4().hex[:16]}"
        try:
            with _native_output() as native, _translate("create an agent with the UCX backend"):
                self._agent = _tamed_agent(api, self.name, delay_us, workers, sync)
        except RdmaError as exc:
            reason = _reason(native)
            raise RdmaError(f"{exc}{' -- NIXL/UCX said: ' + reason if reason else ''}{_ucx_tls_hint()}") from exc
        if "UCX" not in self._agent.backends:
            raise RdmaError(f"NIXL: the UCX backend did not load (plugins: {self._agent.plugin_list})")
        self.progress_delay_us = delay_us
        self.thread_sync = sync
        with _translate("read the UCX backend's parameters"):  # what NIXL took, not what we asked
            self.ucx_workers = int(self._agent.get_backend_params("UCX").get("num_workers", "0"))
        log.debug(
            "NIXL agent %s up (UCX, %d workers, sync %s, progress delay %d us, UCX_TLS=%s, UCX_NET_DEVICES=%s)",
            self.name,
            self.ucx_workers,
            self.thread_sync,
            delay_us,
            os.environ.get("UCX_TLS", "(default)"),
            os.environ.get("UCX_NET_DEVICES", "(all)"),
        )

    # -- memory ---------------------------------------------------------------------------------

    def register(self, address: int, length: int) -> Registration:
        with _translate(f"register {length} bytes of DRAM"):
            descs = self._agent.register_memory([(address, length, 0, "")], "DRAM")
        return Registration(address, length, descs)

    def deregister(self, reg: Registration) -> None:
        with _translate("deregister memory"):
            self._agent.deregister_memory(reg._descs)

    # -- peers ----------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's connection info and registrations (~300 bytes with one region)."""
        with _translate("export the agent metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Loading the same metadata twice is
        allowed (NIXL 1.5.1 accepts it)."""
        with _translate("load a peer's metadata"):
            return _text(self._agent.add_remote_agent(metadata))

    def remove_peer(self, name: str) -> None:
        """Forget a peer: no transfer towards it can be created after this."""
        with _translate(f"remove peer {name}"):
            self._agent.remove_remote_agent(name)

    # -- transfers ------------------------------------------------------------------------------

    def write(
        self, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], peer: str, notif: bytes
    ) -> Write:
        """Post one WRITE of the local (address, length) pieces into the peer's remote pieces,
        in order; the peer gets `notif` once the data is placed. Descriptors outside the peer's
        registered regions fail here (NIXL checks them against the peer's metadata)."""
        with _translate("post a write"):
            ldescs = self._agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            rdescs = self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            handle = self._agent.initialize_xfer("WRITE", ldescs, rdescs, peer, notif)
        try:
            with _translate("start a write"):
                posted = self._agent.transfer(handle)
        except RdmaError:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)
            raise
        return Write(self._agent, handle, posted)

    def take_notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call: {peer agent name: [message, ...]}."""
        with _translate("read notifications"):
            return {_text(k): [bytes(m) for m in v] for k, v in self._agent.get_new_notifs().items()}

    def close(self) -> None:
        """Drop the agent (its destructor stops the progress thread and closes UCX)."""
        self._agent = None
