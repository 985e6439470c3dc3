"""What the tier and direct mode do before their first step, written once for both.

The config chain (MEMKV_CONFIG, then MEMKV_* through `ClientConfig.from_env`, and the license
line), the probe of every configured server, the namespace record, the RDMA registration and
the ready line. Each mode passes its label ("MemKV tier", "MemKV direct mode"), its logger and
what one of its values is; the messages and the ready line's common fields are the same.
"""

from __future__ import annotations

import logging
from typing import Any

from memkv import __version__ as memkv_version
from memkv.client.cluster import Client
from memkv.config import ClientConfig
from memkv.errors import AuthError, ConnectError, MemKVError, MemKVTimeout, ProtocolError, ServerError
from memkv.license import check_license
from memkv.sockio import COMPILED_RECEIVE
from memkv_vllm import compat, release


class StartupError(RuntimeError):
    """An integration cannot start: the message names the server or setting and the likely cause."""


def explain_probe_failure(exc: MemKVError) -> str:
    """A startup message with the likely cause, for each way a server can fail the probe."""
    if isinstance(exc, AuthError):
        return f"{exc} -- check that MEMKV_AUTH_KEY matches the key the node was started with"
    if isinstance(exc, (ConnectError, MemKVTimeout)):
        return f"{exc} -- check the address in MEMKV_SERVERS and that `memkv serve` runs there and is reachable"
    if isinstance(exc, ProtocolError):
        return f"{exc} -- is this the node's data port (not its admin port), and is the node the same protocol version?"
    if isinstance(exc, ServerError):
        return f"{exc} -- the node refused the connection"
    return str(exc)


class Startup:
    """The startup steps of one mode: `label` starts every message, `log` says them."""

    def __init__(self, label: str, log: logging.Logger) -> None:
        self.label = label
        self.log = log

    def open_client(self) -> Client:
        config = ClientConfig.from_env()  # MEMKV_CONFIG, then MEMKV_* (memkv.config)
        status = check_license(config.license, config.license_public_key)
        if status is not None:
            self.log.info(status.log_line())
        return Client(config)

    def probe(self, client: Client, value_bytes: int, value_name: str) -> None:
        """Every configured server, not just one: with HRW a bad entry would silently lose its
        share of the keys at runtime. `value_name` says what one value is ("a CPU-pool row")."""
        for node in client._nodes:  # per node, so that the message names the one that failed
            try:
                node.ping()
            except MemKVError as exc:
                raise StartupError(
                    f"{self.label} cannot start: server {node.name}: {explain_probe_failure(exc)}"
                ) from exc
            limit = node.limits.max_value_bytes if node.limits else 0
            if limit < value_bytes:
                raise StartupError(
                    f"{self.label} cannot start: server {node.name} accepts values up to {limit} bytes but "
                    f"{value_name} is {value_bytes} bytes -- start the node with --max-value-size >= {value_bytes} "
                    "or use a smaller block_size"
                )

    def write_config_record(self, client: Client, key: bytes, record: bytes) -> None:
        if not client.exists([key])[0] and not client.batch_put_views([(key, record)])[0]:
            self.log.warning("%s: could not write the namespace record %r", self.label, key)

    def register_pool(self, client: Client, pool: memoryview) -> None:
        """RDMA (docs/rdma.md): nodes WRITE loads straight into `pool`. MEMKV_TRANSPORT=rdma
        refuses to start without it; `auto` and `tcp` go on over TCP."""
        try:
            client.register_pool(pool)
        except MemKVError as exc:
            raise StartupError(f"{self.label} cannot start: {exc}") from exc

    def ready(self, client: Client, details: str, *args: Any) -> None:
        """The ready line: servers and how they are reached, then the mode's `details` (a
        %-format with `args`), then the receive loop and the releases; and the startup warnings."""
        servers = client.servers()
        n = len(servers)
        self.log.info(
            "%s ready (servers=%s, rdma=%s, same_host=%d/%d, shared_memory=%d/%d, "
            + details
            + ", receive=%s, memkv=%s, %s)",
            self.label,
            [a.name for a in servers],
            client.has_rdma(),
            len(client.local_servers()),
            n,
            len(client.shared_memory_servers()),
            n,
            *args,
            "compiled" if COMPILED_RECEIVE else "python",
            memkv_version,
            release.vllm_field(),
        )
        release.warn_if_unqualified()

    def warn_block_hashes(self, what: str) -> None:
        problem = compat.block_hash_reuse_problem()
        if problem:
            self.log.warning(
                "%s: %s: %s stored by this engine cannot be reused by a restarted or another engine. "
                "Set PYTHONHASHSEED (e.g. 0) on every instance that should share KV.",
                self.label,
                problem,
                what,
            )
