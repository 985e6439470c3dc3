"""MemKV: an in-memory KV-cache block store for LLM inference.

Public surface (pinned by tests/unit/test_exported_members.py):
    Client, ClientState, ClientConfig, ServerAddress  -- the cluster client, its lifecycle, its configuration
    ProbeResult, KeyListing, ListedKey                -- what probe() and list_keys() return
    LoadResult                                        -- what batch_load_into() returns
    the exception classes of memkv.errors (the tree is drawn in its docstring)
"""

__version__ = "0.1.0"

from memkv.client.cluster import Client, ClientState, KeyListing, ListedKey, ProbeResult
from memkv.config import ClientConfig, ServerAddress
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
from memkv.transport.base import LoadResult

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
