"""The public surface of `memkv` is exactly what `memkv.__all__` names, and nothing moves by accident.

Behaviour under test (httpx's tests/test_exported_members.py):
* `memkv.__all__` equals the pinned list below: adding or removing a public name is a
  deliberate change to this file;
* every name in it exists, and every public name the package binds is in it or is a submodule;
* every exception class of memkv.errors is exported, so callers catch what they can name.
"""

from __future__ import annotations

import inspect
import types

import pytest

import memkv
from memkv import errors

pytestmark = pytest.mark.unit

PUBLIC = [
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


def test_all_is_exactly_the_pinned_public_surface() -> None:
    assert memkv.__all__ == PUBLIC


def test_every_exported_name_exists() -> None:
    missing = [name for name in memkv.__all__ if not hasattr(memkv, name)]
    assert missing == []


def test_every_public_name_the_package_binds_is_exported_or_a_submodule() -> None:
    bound = {
        name
        for name, value in vars(memkv).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert bound - set(memkv.__all__) == set()


def test_every_exception_class_of_memkv_errors_is_exported_from_memkv() -> None:
    classes = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    assert classes <= set(memkv.__all__)
    assert set(errors.__all__) == classes | {"map_os_error"}


def test_errors_of_the_tree_are_memkv_errors_and_usage_errors_are_not() -> None:
    tree = [getattr(memkv, n) for n in PUBLIC if n.endswith("Error") or n in ("NodeUnavailable", "MemKVTimeout")]
    assert all(issubclass(cls, memkv.MemKVError) for cls in tree)
    assert issubclass(memkv.RdmaError, memkv.MemKVError) and not issubclass(memkv.RdmaError, memkv.TransportError)
    assert issubclass(memkv.ClientClosed, RuntimeError) and not issubclass(memkv.ClientClosed, memkv.MemKVError)


def test_rdma_error_has_one_class_wherever_it_is_imported_from() -> None:
    from memkv import transport

    assert transport.RdmaError is errors.RdmaError is memkv.RdmaError
