"""Configuration as frozen value objects: environment -> MEMKV_CONFIG yaml -> defaults.

Client settings come from, in order of precedence:
  1. the `MEMKV_*` environment variables,
  2. the client.yaml named by `MEMKV_CONFIG`,
  3. the defaults below.
Every bad value raises ConfigError naming the variable (or yaml key) and never echoing a secret.
A variable that is empty or only whitespace counts as unset (`env_value`).
docs/configuration.md lists every setting; tests/ops/test_docs_options.py keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from memkv.errors import ConfigError
from memkv.protocol import KEY_BYTES

DEFAULT_PORT = 9900
DEFAULT_HOST = "127.0.0.1"

ENV_CONFIG = "MEMKV_CONFIG"
ENV_SERVERS = "MEMKV_SERVERS"
ENV_AUTH_KEY = "MEMKV_AUTH_KEY"
ENV_LICENSE = "MEMKV_LICENSE"
ENV_LICENSE_PUBLIC_KEY = "MEMKV_LICENSE_PUBLIC_KEY"
ENV_RDMA_DEVICES = "MEMKV_RDMA_DEVICES"
ENV_PROMETHEUS_BIND = "MEMKV_PROMETHEUS_BIND"
ENV_TRANSPORT = "MEMKV_TRANSPORT"
ENV_INTEGRITY = "MEMKV_INTEGRITY"
ENV_LOCAL_SOCKET = "MEMKV_LOCAL_SOCKET"
ENV_SHARED_MEMORY = "MEMKV_SHARED_MEMORY"
# TLS (memkv/tls.py): any of them set turns TLS on for every server.
ENV_TLS_CA = "MEMKV_TLS_CA"
ENV_TLS_CERT = "MEMKV_TLS_CERT"
ENV_TLS_KEY = "MEMKV_TLS_KEY"
ENV_TLS_SERVER_NAME = "MEMKV_TLS_SERVER_NAME"
TLS_ENV = {"ca": ENV_TLS_CA, "cert": ENV_TLS_CERT, "key": ENV_TLS_KEY, "server_name": ENV_TLS_SERVER_NAME}

CLIENT_ENV_VARS = (
    ENV_CONFIG,
    ENV_SERVERS,
    ENV_AUTH_KEY,
    ENV_LICENSE,
    ENV_LICENSE_PUBLIC_KEY,
    ENV_RDMA_DEVICES,
    ENV_PROMETHEUS_BIND,
    ENV_TRANSPORT,
    ENV_INTEGRITY,
    ENV_LOCAL_SOCKET,
    ENV_SHARED_MEMORY,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TLS_SERVER_NAME,
)

# Units are case-sensitive and spelled out, so that none is ambiguous: KiB/MiB/GiB/TiB are binary
# (1024), KB/MB/GB/TB decimal (1000; kB too). "512mb", "8g" or "10k" are refused: it cannot be
# told whether 2^20 or 10^6 was meant (docs/configuration.md, "Sizes").
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_UNITS_HELP = "KiB, MiB, GiB, TiB (binary: 1024) or KB, MB, GB, TB (decimal: 1000); case-sensitive"


def parse_size(text: str | int, setting: str) -> int:
    """'512MiB' -> 536870912. Plain integers are bytes. Raises ConfigError naming `setting`."""
    if isinstance(text, bool):
        raise ConfigError(f"{setting}: expected a size like 512MiB or 8GiB, got {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ConfigError(f"{setting}: size must be positive, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{setting}: expected a size like 512MiB or 8GiB, got {text!r}")
    number, unit = m.groups()
    if unit not in _SIZE_UNITS:
        binary = {u.lower(): u for u in _SIZE_UNITS if "i" in u}.get(unit.lower())
        if binary:
            hint = f"write {number}{binary}"
        elif unit.lower().rstrip("b") in ("k", "m", "g", "t"):
            prefix = unit[0].upper()
            hint = f"write {number}{prefix}iB (binary) or {number}{prefix}B (decimal)"
        else:
            raise ConfigError(f"{setting}: expected a size like 512MiB or 8GiB, got {text!r}")
        raise ConfigError(
            f"{setting}: ambiguous or unknown unit {unit!r} in {text!r}: {hint} (units: {SIZE_UNITS_HELP})"
        )
    value = int(float(number) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{setting}: size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


# --------------------------------------------------------------------------------------------
# Addresses
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerAddress:
    """One node: host, port and an HRW weight (default 1.0)."""

    host: str
    port: int
    weight: float = 1.0

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def name(self) -> str:
        return str(self)


def parse_address(text: str, setting: str, default_port: int | None = None) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    text = text.strip()
    if "://" in text:
        raise ConfigError(f"{setting}: no scheme: write host:port (as in 127.0.0.1:9900), not {text!r}")
    if ";" in text:
        raise ConfigError(
            f"{setting}: servers are separated by ',' (as in 10.0.0.17:9900,10.0.0.18:9900), not ';'; got {text!r}"
        )
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(f"{setting}: unclosed '[' in {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{setting}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ConfigError(f"{setting}: expected [addr]:port, got {text!r}")
    else:
        if text.count(":") > 1:
            raise ConfigError(f"{setting}: IPv6 addresses need brackets, as in [::1]:9900; got {text!r}")
        host, _, port_text = text.partition(":")
        port_text = port_text or None
    if not host:
        raise ConfigError(f"{setting}: missing host in {text!r}")
    if port_text is None:
        if default_port is None:
            raise ConfigError(f"{setting}: missing port in {text!r} (expected host:port)")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{setting}: bad port {port_text!r} in {text!r}")
    return host, int(port_text)


def parse_server(entry: Any, setting: str) -> ServerAddress:
    """'host:port', 'host:port=WEIGHT', or a yaml mapping {address: host:port, weight: W}."""
    weight: Any = 1.0
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"address", "weight"}
        if unknown:
            raise ConfigError(f"{setting}: unknown keys {sorted(unknown)} (allowed: address, weight)")
        if "address" not in entry:
            raise ConfigError(f"{setting}: a server entry needs 'address'")
        text, weight = str(entry["address"]), entry.get("weight", 1.0)
    elif isinstance(entry, str):
        text = entry
        if "=" in entry:
            text, _, weight = entry.rpartition("=")
    else:
        raise ConfigError(f"{setting}: expected host:port, got {entry!r}")
    host, port = parse_address(text, setting)
    if port == 0:
        raise ConfigError(f"{setting}: port 0 is not a server port in {text!r}")
    try:
        weight = float(weight)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: weight must be a number, got {weight!r}") from None
    if not weight > 0:
        raise ConfigError(f"{setting}: weight must be > 0, got {weight}")
    return ServerAddress(host, port, weight)


def parse_servers(value: Any, setting: str) -> tuple[ServerAddress, ...]:
    if isinstance(value, str):
        entries: list[Any] = [e for e in re.split(r"[,\s]+", value) if e]
    elif isinstance(value, (list, tuple)):
        entries = list(value)
    else:
        raise ConfigError(f"{setting}: expected a list of host:port, got {type(value).__name__}")
    if not entries:
        raise ConfigError(f"{setting}: no servers listed")
    servers = tuple(parse_server(e, setting) for e in entries)
    seen: set[str] = set()
    for s in servers:
        if s.name in seen:
            raise ConfigError(f"{setting}: server {s.name} is listed twice")
        seen.add(s.name)
    return servers


# --------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------


class AuthKey:
    """The 32-byte shared key. Its repr and str never show the bytes."""

    __slots__ = ("_raw", "source")

    def __init__(self, raw: bytes, source: str) -> None:
        if len(raw) != KEY_BYTES:
            raise ConfigError(f"{source}: the auth key must be {KEY_BYTES} bytes")
        self._raw = raw
        self.source = source

    @classmethod
    def from_hex(cls, text: str, source: str) -> AuthKey:
        text = text.strip()
        if len(text) != 2 * KEY_BYTES or not re.fullmatch(r"[0-9a-fA-F]+", text):
            # Never echo the value: it may be a real key with a typo.
            raise ConfigError(
                f"{source}: expected {2 * KEY_BYTES} hex characters (got {len(text)} characters); "
                "create one with `memkv keygen`"
            )
        return cls(bytes.fromhex(text), source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], source: str) -> AuthKey:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read key file {path}: {exc.strerror}") from None
        return cls.from_hex(text, f"{source} ({path})")

    @property
    def raw(self) -> bytes:
        return self._raw

    def __repr__(self) -> str:
        return f"AuthKey(source={self.source!r}, value=********)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AuthKey) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)


def default_key_path() -> Path:
    """Where `memkv serve` writes a generated key when none is configured."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "memkv" / "auth.key"


# --------------------------------------------------------------------------------------------
# Client configuration
# --------------------------------------------------------------------------------------------

TRANSPORTS = ("auto", "tcp", "rdma")
SPARES_MODES = ("auto", "on", "off")
STORES_MODES = ("auto", "client", "node")  # --shared-memory-stores: memkv/server/shm.py

YAML_KEYS = {
    "servers": "host:port list (or {address, weight} mappings)",
    "auth_key": "64 hex characters",
    "auth_key_file": "path of a file holding the key",
    "license": "inline JWT or a path",
    "license_public_key": "PEM public key (or its path) that verifies the license signature",
    "rdma_devices": "RDMA NIC names",
    "prometheus_bind": "host:port of the client metrics exporter",
    "transport": "auto | tcp | rdma",
    "integrity": "xxh3 | blake3",
    "local_socket": "on | off: same-host nodes over their Unix socket",
    "shared_memory": "on | off: copy same-host nodes' values from their shared memory",
    "connect_timeout_s": "seconds",
    "io_timeout_s": "seconds",
    "pool_size": "connections per server",
    "down_for_s": "seconds a failed server is skipped",
    "tls": "mapping: ca, cert, key, server_name (TLS on; docs/configuration.md)",
}


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """A client's TLS settings (MEMKV_TLS_* or client.yaml's `tls:` block). `ca`: PEM file of
    the CA(s) that sign the nodes' certificates (None: the system's trust store). `cert` and
    `key`: the client's certificate for nodes that require one (mutual TLS). `server_name`:
    the name checked against the node's certificate (None: the host of each server address)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("MEMKV_TLS_CERT and MEMKV_TLS_KEY (tls.cert, tls.key) must be set together")
        for name in ("ca", "cert", "key", "server_name"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(f"tls.{name}: expected a non-empty string, got {v!r}")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Everything a Client needs. Build with `ClientConfig.from_env()` or directly."""

    servers: tuple[ServerAddress, ...]
    auth_key: AuthKey
    license: str | None = None  # inline JWT or path, as given
    license_public_key: str | None = None
    rdma_devices: tuple[str, ...] = ()
    prometheus_bind: tuple[str, int] | None = None
    transport: str = "auto"
    integrity: str = "xxh3"
    connect_timeout_s: float = 2.0
    io_timeout_s: float = 10.0
    pool_size: int = 8
    down_for_s: float = 2.0
    tls: ClientTls | None = None  # None: plain TCP
    # Same-host nodes over the abstract Unix socket they name in HELLO_OK (memkv/client/node.py);
    # never with TLS (TLS was asked for). MEMKV_LOCAL_SOCKET=off keeps every connection on TCP.
    local_socket: bool = True
    # On the same-host socket, store values of 1 MiB and more into memfds the node passes and load
    # them from those memfds when it offers it (memkv/client/shared.py): one copy per byte instead
    # of two. Loads read the memfd (no mapping, so no page-table fill); the values this process
    # stored are copied from the read-only mappings it kept. Values stored over the socket come
    # over the socket.
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.local_socket, bool):
            raise ConfigError(f"local_socket: expected on or off, got {self.local_socket!r}")
        if not isinstance(self.shared_memory, bool):
            raise ConfigError(f"shared_memory: expected on or off, got {self.shared_memory!r}")
        if not self.servers:
            raise ConfigError("servers: at least one server is required")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"{ENV_TRANSPORT}: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        from memkv.integrity import parse_integrity

        parse_integrity(self.integrity, ENV_INTEGRITY)
        for name in ("connect_timeout_s", "io_timeout_s", "down_for_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{name}: must be a number > 0, got {v!r}")
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int) or not 1 <= self.pool_size <= 1024:
            raise ConfigError(f"pool_size: must be an integer in 1..1024, got {self.pool_size!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        env = os.environ if env is None else env
        doc: dict[str, Any] = {}
        path = env.get(ENV_CONFIG)
        if path:
            doc = _load_yaml(path)
        fields: dict[str, Any] = {}

        def pick(env_name: str | None, key: str) -> tuple[Any, str] | None:
            if env_name and env_value(env, env_name) is not None:
                return env[env_name], env_name
            if key in doc and doc[key] is not None:
                return doc[key], f"{ENV_CONFIG} ({path}): {key}"
            return None

        if got := pick(ENV_SERVERS, "servers"):
            fields["servers"] = parse_servers(got[0], got[1])
        else:
            fields["servers"] = (ServerAddress(DEFAULT_HOST, DEFAULT_PORT),)
        fields["auth_key"] = _resolve_key(env, doc, path)
        if got := pick(ENV_LICENSE, "license"):
            fields["license"] = str(got[0]).strip()
        if got := pick(ENV_LICENSE_PUBLIC_KEY, "license_public_key"):
            fields["license_public_key"] = str(got[0])
        if got := pick(ENV_RDMA_DEVICES, "rdma_devices"):
            value, source = got
            devices = value if isinstance(value, (list, tuple)) else re.split(r"[,\s]+", str(value))
            devices = tuple(str(d) for d in devices if d)
            for d in devices:
                if not re.fullmatch(r"[A-Za-z0-9_.:-]+", d):
                    raise ConfigError(f"{source}: bad RDMA device name {d!r}")
            fields["rdma_devices"] = devices
        if got := pick(ENV_PROMETHEUS_BIND, "prometheus_bind"):
            fields["prometheus_bind"] = parse_address(str(got[0]), got[1])
        if got := pick(ENV_TRANSPORT, "transport"):
            fields["transport"] = str(got[0]).strip().lower()
        if got := pick(ENV_INTEGRITY, "integrity"):
            fields["integrity"] = str(got[0]).strip().lower()
        if got := pick(ENV_LOCAL_SOCKET, "local_socket"):
            fields["local_socket"] = parse_switch(got[0], got[1])
        if got := pick(ENV_SHARED_MEMORY, "shared_memory"):
            fields["shared_memory"] = parse_switch(got[0], got[1])
        for key in ("connect_timeout_s", "io_timeout_s", "down_for_s", "pool_size"):
            if key in doc:
                fields[key] = doc[key]
        fields["tls"] = _client_tls(env, doc, path)
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ConfigError(f"{path + ': ' if path else ''}{exc}") from None


def _client_tls(env: Mapping[str, str], doc: Mapping[str, Any], path: str | None) -> ClientTls | None:
    """MEMKV_TLS_* over client.yaml's `tls:` block, setting by setting; TLS is on when either
    names anything (an empty `tls: {}` block too: the system's CAs, hostname checked)."""
    block = doc.get("tls")
    if block is not None and not isinstance(block, dict):
        raise ConfigError(f"{ENV_CONFIG} ({path}): tls must be a mapping with keys {sorted(TLS_ENV)}")
    block = block or {}
    unknown = set(block) - set(TLS_ENV)
    if unknown:
        raise ConfigError(f"{ENV_CONFIG} ({path}): tls has unknown keys {sorted(unknown)}; known: {sorted(TLS_ENV)}")
    values: dict[str, str | None] = {}
    for name, env_name in TLS_ENV.items():
        value = env_value(env, env_name)
        if value is None and block.get(name) is not None:
            value = str(block[name])
        values[name] = value.strip() if value is not None else None
    if "tls" not in doc and all(v is None for v in values.values()):
        return None
    return ClientTls(**values)


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"{ENV_CONFIG}: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{ENV_CONFIG}: {path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{ENV_CONFIG}: {path} must hold a mapping of settings")
    unknown = set(doc) - set(YAML_KEYS)
    if unknown:
        raise ConfigError(f"{ENV_CONFIG}: {path} has unknown keys {sorted(unknown)}; known keys: {sorted(YAML_KEYS)}")
    return doc


_SWITCH_WORDS = {
    "on": True,
    "off": False,
    "true": True,
    "false": False,
    "1": True,
    "0": False,
    "yes": True,
    "no": False,
}


def parse_switch(value: object, source: str) -> bool:
    """An on/off setting from the environment or YAML (YAML's own true/false included)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word not in _SWITCH_WORDS:
        raise ConfigError(f"{source}: expected on or off, got {value!r}")
    return _SWITCH_WORDS[word]


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """A MEMKV_* variable's value, or None when it is unset, empty or only whitespace: all three
    mean "not set here, use the next source" (MEMKV_SERVERS='' and ' ' both mean the default)."""
    value = env.get(name)
    return value if value is not None and value.strip() else None


def _resolve_key(env: Mapping[str, str], doc: Mapping[str, Any], path: str | None) -> AuthKey:
    if env_value(env, ENV_AUTH_KEY) is not None:
        return AuthKey.from_hex(env[ENV_AUTH_KEY], ENV_AUTH_KEY)
    if doc.get("auth_key"):
        return AuthKey.from_hex(str(doc["auth_key"]), f"{ENV_CONFIG} ({path}): auth_key")
    if doc.get("auth_key_file"):
        return AuthKey.from_file(str(doc["auth_key_file"]), f"{ENV_CONFIG} ({path}): auth_key_file")
    default = default_key_path()
    if default.exists():
        return AuthKey.from_file(default, "default key file")
    raise ConfigError(
        f"{ENV_AUTH_KEY} is not set and no key file exists at {default}: "
        "export the node's key (it prints how) or create one with `memkv keygen`"
    )


# --------------------------------------------------------------------------------------------
# Server configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaneSpec:
    """An eviction domain: keys starting with `prefix` share `share` of the capacity."""

    name: str
    prefix: bytes
    share: float

    @classmethod
    def parse(cls, text: str) -> LaneSpec:
        """'NAME:PREFIX:SHARE', e.g. 'fleet-a:llama/:0.5'."""
        parts = text.split(":")
        if len(parts) != 3:
            raise ConfigError(f"--lane: expected NAME:PREFIX:SHARE, got {text!r}")
        name, prefix, share_text = parts
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"--lane: bad lane name {name!r} (letters, digits, _ . - only)")
        try:
            share = float(share_text)
        except ValueError:
            raise ConfigError(f"--lane {name}: share must be a number in (0, 1], got {share_text!r}") from None
        if not 0 < share <= 1:
            raise ConfigError(f"--lane {name}: share must be in (0, 1], got {share}")
        return cls(name, prefix.encode(), share)


# Where a container's memory limit is visible from inside it: cgroup v2, then cgroup v1.
CGROUP_MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_memory_limit_bytes(paths: Sequence[str | Path] = CGROUP_MEMORY_LIMIT_FILES) -> int | None:
    """The cgroup memory limit of this process's container, or None when there is none.

    The first of `paths` that exists decides: "max" (v2) means no limit; v1 writes "no limit" as
    a number near 2**63, which the caller's min() with the host's RAM absorbs. A file that
    cannot be read or parsed is skipped: the default capacity must never stop a node starting.
    """
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        if limit > 0:
            return limit
    return None


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def default_capacity_bytes(cgroup_paths: Sequence[str | Path] = CGROUP_MEMORY_LIMIT_FILES) -> int:
    """A quarter of the memory this node may use: leaves room for the OS, vLLM's pinned pool and
    page cache. Inside a container that is the cgroup memory limit when it is below the host's
    RAM (the host's RAM would get the node OOM-killed long before its capacity is reached)."""
    total = host_memory_bytes()
    limit = cgroup_memory_limit_bytes(cgroup_paths)
    if limit is not None:
        total = min(total, limit)
    return max(64 << 20, total // 4)


def memory_limit_bytes(cgroup_paths: Sequence[str | Path] = CGROUP_MEMORY_LIMIT_FILES) -> int:
    """The memory this process may use: the host's RAM, or the container's limit when lower."""
    limit = cgroup_memory_limit_bytes(cgroup_paths)
    total = host_memory_bytes()
    return total if limit is None else min(total, limit)


def capacity_warning(capacity_bytes: int, cgroup_paths: Sequence[str | Path] = CGROUP_MEMORY_LIMIT_FILES) -> str | None:
    """A warning when --capacity exceeds the memory this node may use (it would be OOM-killed
    before the cache fills), else None."""
    limit = memory_limit_bytes(cgroup_paths)
    if capacity_bytes <= limit:
        return None
    return (
        f"--capacity {format_size(capacity_bytes)} exceeds this machine's memory ({format_size(limit)}, "
        "RAM or the container's limit, whichever is lower): the node will be killed for memory before it is full"
    )


def node_transport_from_env(env: Mapping[str, str] | None = None) -> str:
    """A node's MEMKV_TRANSPORT: "tcp" refuses RDMA attaches; "rdma" brings NIXL up at start
    (so buffers are registered as PUTs make them); "auto" or unset loads NIXL on the first
    attach. Another value fails ServerConfig's check, naming the variable."""
    return (os.environ if env is None else env).get(ENV_TRANSPORT, "").strip().lower() or "auto"


def node_rdma_devices_from_env(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """A node's MEMKV_RDMA_DEVICES: NIC names, comma- or space-separated."""
    value = (os.environ if env is None else env).get(ENV_RDMA_DEVICES, "")
    return tuple(d for d in re.split(r"[,\s]+", value) if d)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    admin_port: int | None = None  # None: port + 1 (or an ephemeral port when port is 0)
    capacity_bytes: int = dataclasses.field(default_factory=default_capacity_bytes)
    lanes: tuple[LaneSpec, ...] = ()
    max_value_bytes: int = 64 << 20
    max_connections: int = 1024
    idle_timeout_s: float = 300.0
    io_timeout_s: float = 30.0
    node_id: str = ""
    # Leases (docs/protocol.md section 11, memkv/server/store.py): ttl cap, count and byte bounds.
    max_lease_s: float = 300.0
    max_leases: int = 65536
    max_lease_bytes: int | None = None  # None: half the capacity
    max_lease_share: float = 0.5  # of max_leases and max_lease_bytes, per holder (lease token)
    # RDMA (memkv/server/rdma.py, docs/rdma.md); by default from the node's environment.
    # transport "tcp": refuse attaches; "rdma": NIXL at start; "auto": NIXL at first attach.
    transport: str = dataclasses.field(default_factory=node_transport_from_env)
    rdma_devices: tuple[str, ...] = dataclasses.field(default_factory=node_rdma_devices_from_env)
    # TLS (memkv/tls.py): with cert and key, the data port speaks TLS only, unless tls_listen
    # names a second port for it (the data port then stays plain). tls_ca: mutual TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_listen: tuple[str, int] | None = None
    # Same-host clients over an abstract AF_UNIX socket named in HELLO_OK (memkv/server/node.py);
    # off with TLS on the data port. `memkv serve --no-local-socket` turns it off.
    local_socket: bool = True
    # Values of 1 MiB and more that same-host clients store and load as sealed memfds
    # (memkv/server/shm.py); needs the same-host socket. `--no-shared-memory` turns it off.
    shared_memory: bool = True
    # Besides peers of the node's own uid, peers in this group (a gid) get shared memory too.
    shared_memory_group: int | None = None
    # Spares (memkv/server/shm.py): "on", "off", or "auto" (on where the node has cores to spare).
    shared_memory_spares: str = "auto"
    # Where same-host clients' stores go (memkv/server/shm.py): "client" (fresh memfds they write),
    # "node" (over the socket into memfds the node writes), "auto" (client where shared memory
    # gets huge pages on advice).
    shared_memory_stores: str = "auto"

    def __post_init__(self) -> None:
        self._check_tls()
        if self.shared_memory_stores not in STORES_MODES:
            raise ConfigError(
                f"--shared-memory-stores: expected one of {', '.join(STORES_MODES)}, got {self.shared_memory_stores!r}"
            )
        if self.shared_memory_spares not in SPARES_MODES:
            raise ConfigError(
                f"--shared-memory-spares: expected one of {', '.join(SPARES_MODES)}, got {self.shared_memory_spares!r}"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"{ENV_TRANSPORT}: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.max_value_bytes > self.capacity_bytes:
            raise ConfigError(
                f"--max-value-size ({format_size(self.max_value_bytes)}) exceeds --capacity "
                f"({format_size(self.capacity_bytes)})"
            )
        if not 0 < self.max_lease_s <= 3600:
            raise ConfigError(f"--max-lease-ttl must be in (0, 3600] seconds, got {self.max_lease_s}")
        if self.max_leases < 0:
            raise ConfigError(f"--max-leases must be >= 0, got {self.max_leases}")
        if self.max_lease_bytes is not None and not 0 <= self.max_lease_bytes <= self.capacity_bytes:
            raise ConfigError(
                f"--max-lease-bytes ({format_size(self.max_lease_bytes)}) must be 0..--capacity "
                f"({format_size(self.capacity_bytes)})"
            )
        if not 0 < self.max_lease_share <= 1:
            raise ConfigError(f"--max-lease-share must be in (0, 1], got {self.max_lease_share}")
        total = sum(lane.share for lane in self.lanes)
        if total > 1.0 + 1e-9:
            raise ConfigError(f"--lane: shares add up to {total:.3f}, more than 1")
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names) or "default" in names:
            raise ConfigError("--lane: lane names must be unique and not 'default'")

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key must be given together")
        if self.tls_cert is None and (self.tls_ca is not None or self.tls_listen is not None):
            raise ConfigError("--tls-ca and --tls-listen need --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
