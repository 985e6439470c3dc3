"""MemKV: an in-memory KV-cache block store for LLM inference.

Public surface (pinned by tests/unit/test_exported_members.py):
    Client, ClientConfig, ServerAddress  -- the cluster client and its configuration
    ProbeResult, KeyListing, ListedKey   -- what probe() and list_keys() return
    the exception classes of memkv.errors
"""

__version__ = "0.1.0"

from memkv.client.cluster import Client, KeyListing, ListedKey, ProbeResult
from memkv.config import ClientConfig, ServerAddress
from memkv.errors import (
    AuthError,
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
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ServerError,
    TransportError,
    WriteError,
    WriteTimeout,
)

__all__ = [
    "__version__",
    "Client",
    "ClientConfig",
    "ServerAddress",
    "ProbeResult",
    "KeyListing",
    "ListedKey",
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
    "NodeUnavailable",
    "ServerError",
    "IntegrityError",
]
