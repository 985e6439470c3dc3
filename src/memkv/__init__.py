"""MemKV: an in-memory KV-cache block store for LLM inference.

Public surface (pinned by tests/unit/test_exported_members.py):
    Client, ClientState, ClientConfig, ServerAddress  -- the cluster client, its lifecycle, its configuration
    ProbeResult, KeyListing, ListedKey                -- what probe() and list_keys() return
    LoadResult                                        -- what batch_load_into() returns
    the exception classes of memkv.errors (the tree is drawn in its docstring)
"""

import importlib
import typing

from memkv.errors import (
    AuthError,
    ClientClosed,
    ConfigError,
    ConnectError,
    ConnectTimeout,
    IntegrityError,
    LocalProtocolError,
    MemKVError,
    MemKVTimeout,
    NodeUnavailable,
    PoolTimeout,
    ProtocolError,
    RdmaError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ServerError,
    TlsError,
    TransportError,
    WriteError,
    WriteTimeout,
)

if typing.TYPE_CHECKING:
    from memkv.client.cluster import Client, ClientState, KeyListing, ListedKey, ProbeResult
    from memkv.config import ClientConfig, ServerAddress
    from memkv.transport.base import LoadResult

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that a node, which imports memkv.server.*, never loads
# the client: {name: module that defines it}. The TYPE_CHECKING imports above name the same.
_LAZY = {
    "Client": "memkv.client.cluster",
    "ClientState": "memkv.client.cluster",
    "KeyListing": "memkv.client.cluster",
    "ListedKey": "memkv.client.cluster",
    "ProbeResult": "memkv.client.cluster",
    "ClientConfig": "memkv.config",
    "ServerAddress": "memkv.config",
    "LoadResult": "memkv.transport.base",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "__version__",
    "Client",
    "ClientState",
    "ClientConfig",
    "ServerAddress",
    "ProbeResult",
    "KeyListing",
    "ListedKey",
    "LoadResult",
    "MemKVError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "TransportError",
    "MemKVTimeout",
    "ConnectTimeout",
    "ReadTimeout",
    "WriteTimeout",
    "PoolTimeout",
    "ConnectError",
    "ReadError",
    "WriteError",
    "TlsError",
    "NodeUnavailable",
    "ServerError",
    "IntegrityError",
    "RdmaError",
    "ClientClosed",
]
