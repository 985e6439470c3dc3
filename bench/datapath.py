"""Data path ceiling: values through memkv.Client vs a raw Python socket and Redis, same run.

    python bench/datapath.py                       # 16 MiB values, 2 threads, 1 node
    python bench/datapath.py --value-size 4MiB --threads 4 --nodes 2
    python bench/datapath.py --sweep               # sizes, threads, nodes: scaling.json + PNG

Baselines, measured in every repetition next to MemKV (the host drifts between a fast and a
slow state, so only same-repetition ratios mean anything):
  * raw: the fastest plain Python design on this machine (measured by the team beforehand): a blocking
    socket per thread, `sendall` of a slot of a pre-faulted pool into `recv_into` a slot of the
    server's pre-faulted pool, one ack byte per value. No framing, authentication, checksums or
    store: what MemKV adds costs the difference.
  * raw-unix: the same raw design over an abstract Unix socket: the kernel path MemKV's
    same-host clients take by default (docs/protocol.md section 2.6). "memkv" is the client over
    the node's Unix socket with shared_memory off, "memkv-tcp" the same client with
    local_socket off (loopback TCP), "memkv-shm" the client as configured by default, shared_memory
    on (docs/protocol.md section 13: its PUTs of values of 1 MiB and more write each into a sealed
    memfd of its own, SHM_PUT/SHM_COMMIT, and its GETs copy them back from there). Each MemKV client reads back its own keys. Same-family pairs (memkv/raw-unix, memkv-tcp/raw) price what
    MemKV adds; memkv/raw is what a user gets against the raw TCP design.
  * redis: a real `redis-server` started by the bench (skipped if not installed; `apt-get
    install redis-server`), driven by redis-py with SET/GET of the same values.
The systems take turns on blocks of `--block-values` batches of `--blocks-per-op` values per
thread (order reversed every other block), and "block-median" is memkv/raw from each block's
pair of timings, the median over the blocks of a repetition; CPU seconds per GB (client and
server process) come with it. Targets (16 MiB): memkv >= 0.9 x raw, >= 2 x Redis. Results:
bench/out/datapath.json (`--out` names another file).

    python bench/datapath.py --src ../main/src     # another revision's memkv (client and nodes)

`--src DIR` measures the memkv package under DIR instead of this checkout's (the nodes it starts
get the same PYTHONPATH): run it alternating with a plain invocation for a before/after.

    python bench/datapath.py --tls                 # TLS: bench/out/datapath_tls.json

--tls measures, in each repetition: a raw `ssl` socket moving the same bytes (the raw design
above inside TLS 1.3, same certificate and cipher), MemKV over TLS (`--tls-cert`, the client
with MEMKV_TLS_CA), and plain MemKV, interleaved: the three take turns on blocks of
`--block-values` values per thread (order reversed every other block), so that the host's
drift within a repetition hits them alike; "block-median" is memkv-tls/raw-tls from each
block's pair of timings, the median over the blocks (a burst of other work on the host spoils
a block, not the repetition). Target: memkv-tls >= 0.9 x raw-tls. It also reports CPU
seconds per GB moved (client and server processes together: user + system time), i.e. how many
cores one GB/s costs. `--ktls` asks OpenSSL for kernel TLS (OP_ENABLE_KTLS) on both sides and
says whether the kernel offers it (the `tls` ULP).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import errno
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _src_argument(argv: list[str]) -> Path | None:
    """`--src DIR` (read before the imports below: it picks the memkv they import)."""
    for i, arg in enumerate(argv):
        if arg == "--src" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if arg.startswith("--src="):
            return Path(arg.split("=", 1)[1]).resolve()
    return None


# The memkv measured: this checkout's src/, or another revision's (--src) for a before/after run;
# the nodes the bench starts run the same code (PYTHONPATH).
SRC = _src_argument(sys.argv) or Path(__file__).resolve().parents[1] / "src"
if not (SRC / "memkv" / "__init__.py").is_file():
    sys.exit(f"--src {SRC}: no memkv package there (give the src/ directory of a MemKV checkout)")
sys.path.insert(0, str(SRC))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/tlscerts.py for --tls
# Ahead of the caller's PYTHONPATH, which may hold the dependencies (a staged host: bench/gpu).
NODE_ARGS: list[str] = []  # --node-args: more `memkv serve` flags for the MemKV nodes of measure()
NODE_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}

from memkv.benchmark import fill_pattern, prefaulted_pool  # noqa: E402
from memkv.client.cluster import Client  # noqa: E402
from memkv.config import AuthKey, ClientConfig, format_size, parse_servers, parse_size  # noqa: E402
from memkv.local import LocalNode, new_key_hex  # noqa: E402
from memkv.memfd import shmem_huge_pages  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
_REQ = struct.Struct(">cI")  # op b"P"/b"G", slot


# -- raw baseline --------------------------------------------------------------------------------------


def raw_server(
    port_file: str, value_bytes: int, slots: int, tls: list[str] | None = None, host: str = "127.0.0.1"
) -> None:
    """`tls`: [cert, key, ktls(0/1)]: the same server inside TLS 1.3 (no MSG_WAITALL there).
    `host`: the address to listen on (bench/fleet.py: a node's address in a network namespace)."""
    pool = memoryview(prefaulted_pool(value_bytes * slots))
    lsock = socket.create_server((host, 0))
    # The same server on an abstract Unix socket too (not with TLS): the raw design on the kernel
    # path MemKV's same-host clients take, so each family has its own baseline.
    unix_name = f"memkv-bench-raw-{os.getpid()}"
    usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    usock.bind("\0" + unix_name)
    usock.listen(64)
    Path(port_file).write_text(f"{lsock.getsockname()[1]} {unix_name}")
    ctx = None
    if tls:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(tls[0], tls[1])
        if tls[2] == "1":
            ctx.options |= OP_ENABLE_KTLS

    def serve_tls(conn) -> None:
        hdr = bytearray(_REQ.size)
        with conn:
            while True:
                got = 0
                while got < len(hdr):
                    n = conn.recv_into(memoryview(hdr)[got:])
                    if not n:
                        return
                    got += n
                op, slot = _REQ.unpack(hdr)
                view = pool[slot * value_bytes : (slot + 1) * value_bytes]
                if op == b"P":
                    got = 0
                    while got < value_bytes:
                        got += conn.recv_into(view[got:])
                    conn.sendall(b"k")
                else:
                    conn.sendall(view)

    def serve(conn: socket.socket) -> None:
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is not None:
            serve_tls(ctx.wrap_socket(conn, server_side=True))
            return
        hdr = bytearray(_REQ.size)
        with conn:
            while conn.recv_into(hdr, len(hdr), socket.MSG_WAITALL) == len(hdr):
                op, slot = _REQ.unpack(hdr)
                view = pool[slot * value_bytes : (slot + 1) * value_bytes]
                if op == b"P":
                    got = 0
                    while got < value_bytes:
                        got += conn.recv_into(view[got:], value_bytes - got, socket.MSG_WAITALL)
                    conn.sendall(b"k")
                else:
                    conn.sendall(view)

    def accept_loop(listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, args=(usock,), daemon=True).start()
    accept_loop(lsock)


# OpenSSL 3's SSL_OP_ENABLE_KTLS; Python's ssl names it only from 3.12.
OP_ENABLE_KTLS = 1 << 3


class RawClient:
    def __init__(self, port: int, tls_ctx=None, unix_name: str | None = None, host: str = "127.0.0.1") -> None:
        self._local = threading.local()
        self.host, self.port = host, port
        self.unix_name = unix_name  # connect to the raw server's Unix socket instead
        self._socks: list[socket.socket] = []
        self._tls_ctx = tls_ctx

    def _sock(self) -> socket.socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            if self.unix_name is not None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect("\0" + self.unix_name)
            else:
                s = socket.create_connection((self.host, self.port))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls_ctx is not None:
                s = self._tls_ctx.wrap_socket(s, server_hostname="127.0.0.1")
            self._local.sock = s
            self._socks.append(s)
        return s

    def put(self, slot: int, view: memoryview) -> None:
        s = self._sock()
        s.sendall(_REQ.pack(b"P", slot))
        s.sendall(view)
        assert s.recv(1) == b"k"

    def get(self, slot: int, view: memoryview) -> None:
        s = self._sock()
        s.sendall(_REQ.pack(b"G", slot))
        got = 0
        if self._tls_ctx is not None:  # an SSLSocket takes no flags: one record per call
            while got < len(view):
                got += s.recv_into(view[got:])
            return
        while got < len(view):
            got += s.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)

    def close(self) -> None:
        for s in self._socks:
            s.close()


def start_raw(
    value_bytes: int, slots: int, tls: list[str] | None = None, host: str = "127.0.0.1", launcher: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int, str]:
    """The raw server in its own process; `launcher` runs it elsewhere (e.g. `ip netns exec NS`)."""
    port_file = Path(tempfile.mkdtemp()) / "port"
    extra = ["--raw-tls", *tls] if tls else []
    proc = subprocess.Popen(
        [*launcher, sys.executable, __file__, "--value-size", str(value_bytes), "--raw-server", str(port_file),
         str(slots), "--raw-host", host, *extra]
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("raw baseline server did not start")
        time.sleep(0.05)
    port, unix_name = port_file.read_text().split()
    return proc, int(port), unix_name


# -- Redis baseline ------------------------------------------------------------------------------------


def start_redis(max_bytes: int):
    exe = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None, None, "redis-py not installed (pip install '.[bench]')"
    if exe is None:
        return None, None, "redis-server not installed (apt-get install redis-server)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="memkv-bench-redis-")
    proc = subprocess.Popen(
        [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--proto-max-bulk-len",
            str(max(512 << 20, max_bytes)),
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                return None, None, "redis-server did not start"
            time.sleep(0.05)
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "pure-Python parser"
    return proc, client, f"redis-server {client.info()['redis_version']}, redis-py {redis.__version__} ({parser})"


# -- one configuration ---------------------------------------------------------------------------------


def measure(
    value_bytes: int, n: int, threads: int, n_nodes: int, reps: int, bpo: int, with_redis: bool, block_values: int = 1
) -> dict:
    raw, raw_port, raw_unix = start_raw(value_bytes, n)
    key = new_key_hex()
    # Three sets of values: each MemKV client reads back what it stored itself (a shared-memory
    # client then copies from the read-only mappings it kept of them; memkv/client/shared.py).
    capacity = str(int(3 * value_bytes * n * 1.3 / n_nodes) + (64 << 20))
    nodes = [LocalNode(key, capacity=capacity, env=NODE_ENV, extra_args=NODE_ARGS) for _ in range(n_nodes)]
    redis_proc, rclient, redis_note = start_redis(value_bytes) if with_redis else (None, None, "not run")
    rawc, rawu = RawClient(raw_port), RawClient(raw_port, unix_name=raw_unix)
    try:
        config = ClientConfig(
            servers=parse_servers(",".join(x.address for x in nodes), "bench"),
            auth_key=AuthKey.from_hex(key, "bench"),
            pool_size=max(8, threads),
        )
        # Since 3684015 shared memory is on by default: "memkv" turns it off to keep measuring the
        # same-host socket; "memkv-shm" is the default client.
        client = Client(dataclasses.replace(config, shared_memory=False))  # same-host nodes over their Unix socket
        client_tcp = Client(dataclasses.replace(config, local_socket=False))  # loopback TCP, as before it
        client_shm = Client(
            dataclasses.replace(config, shared_memory=True)
        )  # the default: GETs copy from the node's memory
        src = memoryview(prefaulted_pool(value_bytes * n))
        dst = memoryview(prefaulted_pool(value_bytes * n))
        for i in range(n):
            fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
        keys = [f"bench/{i}".encode() for i in range(n)]  # redis
        keys_of = {who: [f"bench/{who}/{i}".encode() for i in range(n)] for who in ("memkv", "memkv-tcp", "memkv-shm")}

        def slot(v, i):
            return v[i * value_bytes : (i + 1) * value_bytes]

        per_thread = [list(range(t, n, threads)) for t in range(threads)]

        def batches(idx):
            return [idx[j : j + bpo] for j in range(0, len(idx), bpo)]

        def redis_get(idx):
            for i in idx:
                v = rclient.get(keys[i])
                assert v is not None and len(v) == value_bytes

        def memkv_put(c, keys):
            return lambda idx: [c.batch_put_views([(keys[i], slot(src, i)) for i in b]) for b in batches(idx)]

        def memkv_get(c, keys):
            return lambda idx: [c.batch_get_into([(keys[i], slot(dst, i)) for i in b]) for b in batches(idx)]

        # "raw"/"memkv-tcp": loopback TCP; "raw-unix"/"memkv": the Unix socket (memkv's default).
        ops = {
            "raw put": lambda idx: [rawc.put(i, slot(src, i)) for i in idx],
            "raw-unix put": lambda idx: [rawu.put(i, slot(src, i)) for i in idx],
            "memkv put": memkv_put(client, keys_of["memkv"]),
            "memkv-tcp put": memkv_put(client_tcp, keys_of["memkv-tcp"]),
            "memkv-shm put": memkv_put(client_shm, keys_of["memkv-shm"]),
            "raw get": lambda idx: [rawc.get(i, slot(dst, i)) for i in idx],
            "raw-unix get": lambda idx: [rawu.get(i, slot(dst, i)) for i in idx],
            "memkv get": memkv_get(client, keys_of["memkv"]),
            "memkv-tcp get": memkv_get(client_tcp, keys_of["memkv-tcp"]),
            "memkv-shm get": memkv_get(client_shm, keys_of["memkv-shm"]),
        }
        if rclient is not None:
            ops["redis put"] = lambda idx: [rclient.set(keys[i], slot(src, i)) for i in idx]
            ops["redis get"] = redis_get
        node_pid = nodes[0].pid if n_nodes == 1 else None
        server_pid = {
            "raw": raw.pid,
            "raw-unix": raw.pid,
            "memkv": node_pid,
            "memkv-tcp": node_pid,
            "memkv-shm": node_pid,
            "redis": redis_proc.pid if redis_proc is not None else None,
        }
        rates: dict[str, list[float]] = {name: [] for name in ops}
        cpu: dict[str, list[float]] = {name: [] for name in ops}  # CPU seconds per GB moved
        pairs = (
            ("memkv", "raw"),
            ("memkv", "raw-unix"),
            ("memkv-tcp", "raw"),
            ("memkv", "memkv-tcp"),
            ("memkv-shm", "raw-unix"),
        )
        block_ratios: dict[str, list[float]] = {f"{a}/{b} {op}": [] for a, b in pairs for op in ("put", "get")}
        # Interleaved: each repetition moves the values in blocks of `block_values` batches per
        # thread, the systems taking turns on every block (order reversed every other block), so
        # a drift of the host's speed within a repetition hits them alike.
        step = bpo * block_values
        blocks = [[idx[b : b + step] for idx in per_thread] for b in range(0, max(map(len, per_thread)), step)]
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for fn in ops.values():  # warm-up: connections, first touch of server memory
                list(ex.map(fn, per_thread))
            for _ in range(reps):
                for op in ("put", "get"):
                    names = [name for name in ops if name.endswith(op)]
                    spent = dict.fromkeys(names, 0.0)
                    used = dict.fromkeys(names, 0.0)
                    per_block: dict[str, list[float]] = {name: [] for name in names}
                    for b, block in enumerate(blocks):
                        for name in names if b % 2 == 0 else names[::-1]:
                            pid = server_pid[name.split()[0]]
                            c0, s0 = cpu_seconds(), cpu_seconds(pid) if pid else 0.0
                            t = time.perf_counter()
                            list(ex.map(ops[name], block))
                            dt = time.perf_counter() - t
                            spent[name] += dt
                            used[name] += cpu_seconds() - c0 + (cpu_seconds(pid) - s0 if pid else 0.0)
                            per_block[name].append(dt)
                            if name in ("memkv get", "memkv-tcp get", "memkv-shm get"):
                                for i in (i for idx in block for i in idx):
                                    assert slot(dst, i) == slot(src, i), "memkv get returned wrong bytes"
                                    dst[i * value_bytes : i * value_bytes + 8] = b"\0" * 8  # must be written again
                    # memkv/raw from each block's pair of timings, median over the blocks: a burst
                    # of another process's work spoils a block or two, not the repetition.
                    for a, b in pairs:
                        block_ratios[f"{a}/{b} {op}"].append(
                            statistics.median(tb / ta for tb, ta in zip(per_block[f"{b} {op}"], per_block[f"{a} {op}"]))
                        )
                    for name, dt in spent.items():
                        rates[name].append(value_bytes * n / dt / 1e9)
                        cpu[name].append(used[name] / (value_bytes * n / 1e9))
        client.close()
        client_tcp.close()
        client_shm.close()
    finally:
        rawc.close()
        rawu.close()
        raw.kill()
        if redis_proc is not None:
            redis_proc.kill()
        for x in nodes:
            x.stop()

    def per_rep(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rates[a], rates[b])]

    ratios = {f"{a}/{b} {op}": per_rep(f"{a} {op}", f"{b} {op}") for a, b in pairs for op in ("put", "get")}
    if rclient is not None:
        ratios.update({f"memkv/redis {op}": per_rep(f"memkv {op}", f"redis {op}") for op in ("put", "get")})
    return {
        "value_bytes": value_bytes,
        "values": n,
        "threads": threads,
        "nodes": n_nodes,
        "blocks_per_op": bpo,
        "reps": reps,
        "interleaved_block_values": block_values,
        "gbps": rates,
        "cpu_s_per_gb": cpu,
        "block_median_ratios": block_ratios,
        "ratios": ratios,
        "redis": redis_note,
        "src": str(SRC),
    }


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of `pid` (from /proc), or of this process."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ktls_available() -> dict:
    """Whether this kernel offers kernel TLS: the `tls` TCP ULP must attach to a socket. Says
    which kernel, and the errno when it does not."""
    out = {"kernel": platform.release(), "available": True, "errno": None, "detail": "yes"}
    with socket.create_server(("127.0.0.1", 0)) as lsock, socket.create_connection(lsock.getsockname()) as c:
        try:
            c.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_ULP", 31), b"tls")
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            out.update(
                available=False,
                errno=name,
                detail=f'no: setsockopt(IPPROTO_TCP, TCP_ULP, "tls") failed with {name} ({exc.strerror}) '
                f"on Linux {platform.release()}: the kernel has no tls module loaded or loadable"
                f"{'' if os.path.exists('/proc/net/tls_stat') else ' (no /proc/net/tls_stat)'}",
            )
    return out


def ulp_of(sock: socket.socket) -> str:
    """The TCP upper-layer protocol attached to `sock` ("tls" once OpenSSL moved it to kernel TLS)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_ULP", 31), 16).rstrip(b"\0").decode() or "none"
    except OSError as exc:
        return f"unknown ({errno.errorcode.get(exc.errno or 0, exc.errno)})"


def measure_tls(value_bytes: int, n: int, threads: int, reps: int, ktls: bool, block_values: int = 1) -> dict:
    """raw-tls vs memkv-tls vs plain memkv, same values, same run (see the module docstring)."""
    import ssl

    from tests.tlscerts import make_pki

    from memkv.config import ClientTls

    pki = make_pki(Path(tempfile.mkdtemp(prefix="memkv-bench-pki-")))
    raw, raw_port, _ = start_raw(value_bytes, n, [pki.server.cert, pki.server.key, "1" if ktls else "0"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(pki.ca)
    if ktls:
        ctx.options |= OP_ENABLE_KTLS
    key = new_key_hex()
    capacity = str(int(value_bytes * n * 1.3) + (64 << 20))
    tls_node = LocalNode(
        key, capacity=capacity, extra_args=["--tls-cert", pki.server.cert, "--tls-key", pki.server.key], env=NODE_ENV
    )
    plain_node = LocalNode(key, capacity=capacity, env=NODE_ENV)
    rawc = RawClient(raw_port, ctx)
    try:
        auth = AuthKey.from_hex(key, "bench")
        tls_client = Client(
            ClientConfig(
                servers=parse_servers(tls_node.address, "bench"),
                auth_key=auth,
                pool_size=max(8, threads),
                tls=ClientTls(ca=pki.ca),
            )
        )
        plain_client = Client(
            ClientConfig(servers=parse_servers(plain_node.address, "bench"), auth_key=auth, pool_size=max(8, threads))
        )
        src = memoryview(prefaulted_pool(value_bytes * n))
        dst = memoryview(prefaulted_pool(value_bytes * n))
        for i in range(n):
            fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
        keys = [f"bench/{i}".encode() for i in range(n)]  # redis

        def slot(v, i):
            return v[i * value_bytes : (i + 1) * value_bytes]

        per_thread = [list(range(t, n, threads)) for t in range(threads)]
        ops = {
            "raw-tls put": (lambda idx: [rawc.put(i, slot(src, i)) for i in idx], raw.pid),
            "memkv-tls put": (
                lambda idx: [tls_client.batch_put_views([(keys[i], slot(src, i))]) for i in idx],
                tls_node.pid,
            ),
            "memkv put": (
                lambda idx: [plain_client.batch_put_views([(keys[i], slot(src, i))]) for i in idx],
                plain_node.pid,
            ),
            "raw-tls get": (lambda idx: [rawc.get(i, slot(dst, i)) for i in idx], raw.pid),
            "memkv-tls get": (
                lambda idx: [tls_client.batch_get_into([(keys[i], slot(dst, i))]) for i in idx],
                tls_node.pid,
            ),
            "memkv get": (
                lambda idx: [plain_client.batch_get_into([(keys[i], slot(dst, i))]) for i in idx],
                plain_node.pid,
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in ops}
        cpu: dict[str, list[float]] = {name: [] for name in ops}  # CPU seconds per GB moved
        block_ratios: dict[str, list[float]] = {f"memkv-tls/raw-tls {op}": [] for op in ("put", "get")}
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for fn, _ in ops.values():
                list(ex.map(fn, per_thread))
            raw_ulp = sorted({ulp_of(sock) for sock in rawc._socks})  # kTLS in use: "tls"
            # Interleaved: each repetition moves the values in blocks of `block_values` per thread,
            # the three systems taking turns on every block (order reversed every other block),
            # so a drift of the host's speed within a repetition hits all three alike.
            blocks = [
                [idx[b : b + block_values] for idx in per_thread]
                for b in range(0, max(len(idx) for idx in per_thread), block_values)
            ]
            for _ in range(reps):
                for op in ("put", "get"):
                    names = [name for name in ops if name.endswith(op)]
                    spent = {name: [0.0, 0.0] for name in names}  # seconds, CPU seconds
                    per_block: dict[str, list[float]] = {name: [] for name in names}
                    for b, block in enumerate(blocks):
                        for name in names if b % 2 == 0 else names[::-1]:
                            fn, pid = ops[name]
                            c0, s0 = cpu_seconds(), cpu_seconds(pid)
                            t = time.perf_counter()
                            list(ex.map(fn, block))
                            dt = time.perf_counter() - t
                            spent[name][0] += dt
                            per_block[name].append(dt)
                            spent[name][1] += cpu_seconds() - c0 + cpu_seconds(pid) - s0
                            if op == "get":
                                for i in (i for idx in block for i in idx):
                                    assert slot(dst, i) == slot(src, i), f"{name} returned wrong bytes"
                                    dst[i * value_bytes : i * value_bytes + 8] = b"\0" * 8
                    # The same ratio from each block's pair of timings, median over the blocks: a
                    # burst of another process's work spoils a block or two, not the repetition.
                    block_ratios[f"memkv-tls/raw-tls {op}"].append(
                        statistics.median(
                            r / m for r, m in zip(per_block[f"raw-tls {op}"], per_block[f"memkv-tls {op}"])
                        )
                    )
                    for name, (dt, used) in spent.items():
                        rates[name].append(value_bytes * n / dt / 1e9)
                        cpu[name].append(used / (value_bytes * n / 1e9))
        tls_client.close()
        plain_client.close()
    finally:
        rawc.close()
        raw.kill()
        tls_node.stop()
        plain_node.stop()

    def per_rep(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rates[a], rates[b])]

    ratios = {}
    for op in ("put", "get"):
        ratios[f"memkv-tls/raw-tls {op}"] = per_rep(f"memkv-tls {op}", f"raw-tls {op}")
        ratios[f"memkv-tls/memkv {op}"] = per_rep(f"memkv-tls {op}", f"memkv {op}")
    return {
        "value_bytes": value_bytes,
        "values": n,
        "threads": threads,
        "nodes": 1,
        "blocks_per_op": 1,
        "reps": reps,
        "interleaved_block_values": block_values,
        "gbps": rates,
        "cpu_s_per_gb": cpu,
        "block_median_ratios": block_ratios,
        "ratios": ratios,
        "openssl": ssl.OPENSSL_VERSION,
        "ktls_requested": ktls,
        "ktls_kernel": ktls_available(),
        "raw_tls_socket_ulp": raw_ulp,
        "redis": "not run",
    }


def print_tls(r: dict) -> None:
    print(
        f"\n{format_size(r['value_bytes'])} values x {r['values']}, {r['threads']} threads, {r['reps']} reps; "
        f"{r['openssl']}; Linux {r['ktls_kernel']['kernel']}"
    )
    print(f"  kernel TLS: {r['ktls_kernel']['detail']}")
    if r["ktls_requested"]:
        used = r["raw_tls_socket_ulp"] == ["tls"]
        print(
            f"  --ktls: OpenSSL asked for kernel TLS; the raw-tls sockets' TCP ULP is {r['raw_tls_socket_ulp']}: "
            + ("kernel TLS measured" if used else "NOT kernel TLS, these figures are user-space TLS")
        )
    print(f"  {'':<11}" + "".join(f"{h:>14}" for h in ("put GB/s", "get GB/s", "put cpu-s/GB", "get cpu-s/GB")))
    for who in ("raw-tls", "memkv-tls", "memkv"):
        med = [statistics.median(r["gbps"][f"{who} {op}"]) for op in ("put", "get")]
        cpu = [statistics.median(r["cpu_s_per_gb"][f"{who} {op}"]) for op in ("put", "get")]
        print(f"  {who:<11}" + "".join(f"{x:>14.2f}" for x in med + cpu))
    for name, vals in r["ratios"].items():
        print(f"  {name:<24} median {statistics.median(vals):.2f}  (per rep {min(vals):.2f}-{max(vals):.2f})")
    for name, vals in r["block_median_ratios"].items():
        print(f"  {name:<24} block-median {statistics.median(vals):.2f}  (per rep {min(vals):.2f}-{max(vals):.2f})")


def print_config(r: dict) -> None:
    print(
        f"\n{format_size(r['value_bytes'])} values x {r['values']}, {r['threads']} threads, {r['nodes']} node(s), "
        f"{r['blocks_per_op']} per batch, {r['reps']} reps; redis: {r['redis']}"
    )
    cols = ("put GB/s", "get GB/s", "put cpu-s/GB", "get cpu-s/GB") if "cpu_s_per_gb" in r else ("put GB/s", "get GB/s")
    print(f"  {'':<11}" + "".join(f"{op:>14}" for op in cols))
    for who in ("raw", "raw-unix", "memkv-tcp", "memkv", "memkv-shm", "redis"):
        if f"{who} put" in r["gbps"]:
            figures = [statistics.median(r["gbps"][f"{who} {op}"]) for op in ("put", "get")]
            if "cpu_s_per_gb" in r:
                figures += [statistics.median(r["cpu_s_per_gb"][f"{who} {op}"]) for op in ("put", "get")]
            print(f"  {who:<11}" + "".join(f"{x:>14.2f}" for x in figures))
    for name, vals in r["ratios"].items():
        print(f"  {name:<22} median {statistics.median(vals):.2f}  (per rep {min(vals):.2f}-{max(vals):.2f})")
    for name, vals in r.get("block_median_ratios", {}).items():
        print(f"  {name:<22} block-median {statistics.median(vals):.2f}  (per rep {min(vals):.2f}-{max(vals):.2f})")


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (axis, label) in zip(
        axes, (("value_bytes", "value size (MiB)"), ("threads", "client threads"), ("nodes", "nodes"))
    ):
        sel = [r for r in rows if r["sweep"] == axis]
        xs = [r[axis] / 2**20 if axis == "value_bytes" else r[axis] for r in sel]
        for who, style in (("raw", "k--"), ("memkv", "b-o"), ("redis", "r-s")):
            for op, alpha in (("get", 1.0), ("put", 0.5)):
                key = f"{who} {op}"
                if all(key in r["gbps"] for r in sel):
                    ax.plot(xs, [statistics.median(r["gbps"][key]) for r in sel], style, alpha=alpha, label=key)
        ax.set_xlabel(label)
        ax.set_ylabel("GB/s")
        if axis == "value_bytes":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("memkv client throughput vs raw socket and Redis (loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--value-size", default="16MiB")
    ap.add_argument("--values", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks-per-op", type=int, default=1, help="values per client batch call")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="sizes 1-64 MiB, threads 1-16, nodes 1-4")
    ap.add_argument("--tls", action="store_true", help="raw ssl socket vs MemKV over TLS vs plain MemKV")
    ap.add_argument("--ktls", action="store_true", help="with --tls: ask OpenSSL for kernel TLS on both sides")
    ap.add_argument("--out", default=None, help="the JSON file's name under bench/out/")
    ap.add_argument(
        "--block-values",
        type=int,
        default=1,
        help="values (with --tls) or batches per thread in each interleaved block (the systems take turns)",
    )
    ap.add_argument(
        "--src",
        default=None,
        metavar="DIR",
        help="measure the memkv under DIR (another revision's src/) instead of this checkout's",
    )
    ap.add_argument(
        "--node-args",
        default="",
        help="more `memkv serve` flags for the MemKV nodes, one string (e.g. '--shared-memory-spares on')",
    )
    ap.add_argument("--raw-server", nargs=2, metavar=("PORT_FILE", "SLOTS"), help=argparse.SUPPRESS)
    ap.add_argument("--raw-tls", nargs=3, metavar=("CERT", "KEY", "KTLS"), help=argparse.SUPPRESS)
    ap.add_argument("--raw-host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    NODE_ARGS[:] = shlex.split(args.node_args)
    value_bytes = parse_size(args.value_size, "--value-size")
    if args.raw_server:
        raw_server(args.raw_server[0], value_bytes, int(args.raw_server[1]), args.raw_tls, args.raw_host)
        return
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    OUT.mkdir(exist_ok=True)
    if args.tls:
        r = measure_tls(value_bytes, args.values, args.threads, args.reps, args.ktls, args.block_values)
        print(f"datapath --tls -- {machine} -- {stamp}")
        print_tls(r)
        name = args.out or ("datapath_ktls.json" if args.ktls else "datapath_tls.json")
        (OUT / name).write_text(
            json.dumps({"benchmark": "datapath-tls", "date": stamp, "machine": machine, **r}, indent=2)
        )
        return
    if not args.sweep:
        r = measure(
            value_bytes,
            args.values,
            args.threads,
            args.nodes,
            args.reps,
            args.blocks_per_op,
            not args.no_redis,
            args.block_values,
        )
        print(f"datapath -- {machine} -- {stamp} -- memkv from {SRC}")
        print_config(r)
        host = {"node_args": NODE_ARGS, "shmem_enabled": shmem_huge_pages()}
        (OUT / (args.out or "datapath.json")).write_text(
            json.dumps({"benchmark": "datapath", "date": stamp, "machine": machine, **host, **r}, indent=2)
        )
        return
    rows = []
    total_bytes = 512 << 20  # per measurement, whatever the value size
    plan = [("value_bytes", dict(value_bytes=s << 20, threads=2, n_nodes=1)) for s in (1, 4, 16, 64)]
    plan += [("threads", dict(value_bytes=16 << 20, threads=t, n_nodes=1)) for t in (1, 2, 4, 8, 16)]
    plan += [("nodes", dict(value_bytes=16 << 20, threads=4, n_nodes=k)) for k in (1, 2, 4)]
    for axis, cfg in plan:
        n = max(cfg["threads"], total_bytes // cfg["value_bytes"])
        r = measure(
            cfg["value_bytes"],
            n,
            cfg["threads"],
            cfg["n_nodes"],
            args.reps,
            args.blocks_per_op,
            not args.no_redis and axis == "value_bytes",
        )
        r["sweep"] = axis
        print_config(r)
        rows.append(r)
    (OUT / "scaling.json").write_text(
        json.dumps({"benchmark": "scaling", "date": stamp, "machine": machine, "rows": rows}, indent=2)
    )
    try:
        plot_sweep(rows, OUT / "scaling.png")
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
