"""A hypothesis fuzzer against a live node: hostile bytes never crash it, leak, or starve others.

Behaviour under test: for a bounded time (and a bounded number of inputs, both scaled by
MEMKV_FAULT_SCALE) the fuzzer sends a live `memkv serve` node, one connection per input:

* before the handshake: arbitrary bytes, and real ClientHellos / ClientAuths with bytes flipped,
  cut or appended;
* after a real handshake (memkv.protocol, so the fuzzer holds the session keys): sequences of
  frames built from real requests (PING, EXISTS, GET, DELETE, PUT with values, LIST with
  good and bad limits, unknown and reply opcodes) and then mutated -- raw byte flips (the MAC must catch them), and field or meta
  mutations with the MAC recomputed and the right sequence number, so the node really parses
  hostile counts, lengths, keys, opcodes, flags and versions; also payloads cut short or too long.

Meanwhile a good client stores and reads back values through the same node. Claims: the node
process stays up and never logs an unhandled exception; every good-client operation succeeds
byte-exact, during and after; afterwards the open-connection count returns to its baseline and
the node's RSS stays within its capacity plus a fixed overhead; every refused frame is counted.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from memkv import protocol as p
from tests.faults.figures import scaled, scaled_s
from tests.faults.nodeops import metrics_of, rss_bytes, status_of
from tests.security.conftest import IO_TIMEOUT_S
from tests.security.raw import RawSession, key_block

pytestmark = pytest.mark.integration

CAPACITY = 64 << 20
RSS_OVERHEAD = 96 << 20  # interpreter, threads, per-connection buffers: generous but fixed
MAX_INPUTS = scaled(1000)
BUDGET_S = scaled_s(15.0)
READ_WINDOW_S = 0.03  # how long each input waits for the node's answer before hanging up

# -- strategies -------------------------------------------------------------------------------

keys = st.lists(st.binary(min_size=0, max_size=40), min_size=0, max_size=6)


@st.composite
def base_requests(draw) -> tuple[int, bytes, bytes]:
    """(opcode, meta, payload) of a well-formed request, or of an opcode no client should send."""
    kind = draw(st.sampled_from(["ping", "exists", "delete", "get", "put", "list", "other"]))
    ks = [k or b"k" for k in draw(keys)] or [b"k"]
    if kind == "ping":
        return p.Opcode.PING, b"", b""
    if kind in ("exists", "delete"):
        return (p.Opcode.EXISTS if kind == "exists" else p.Opcode.DELETE), key_block(ks), b""
    if kind == "get":
        lengths = draw(
            st.lists(st.sampled_from([0, 1, 100, p.ANY_LENGTH, 1 << 20]), min_size=len(ks), max_size=len(ks))
        )
        return p.Opcode.GET, key_block(ks) + struct.pack(f">{len(ks)}I", *lengths), b""
    if kind == "list":
        prefix = draw(st.sampled_from([b"", b"k", ks[0]]))
        limit = draw(st.sampled_from([0, 1, 10, p.DEFAULT_MAX_BATCH, p.DEFAULT_MAX_BATCH + 1, 2**32 - 1]))
        return p.Opcode.LIST, struct.pack(">IH", limit, len(prefix)) + prefix, b""
    if kind == "put":
        values = [draw(st.binary(max_size=300)) for _ in ks]
        algos = [draw(st.sampled_from([1, 2, 0, 255])) for _ in ks]
        sums = [draw(st.binary(min_size=32, max_size=32)) for _ in ks]
        meta = key_block(ks) + struct.pack(f">{len(ks)}I", *map(len, values)) + bytes(algos) + b"".join(sums)
        return p.Opcode.PUT, meta, b"".join(values)
    opcode = draw(st.sampled_from([0x00, 0x02, 0x14, 0x15, 0x20, 0x21, 0x55, 0x7F, 0x81, 0x90, 0x91, 0x92, 0x94, 0xFF]))
    return opcode, draw(st.binary(max_size=200)), b""


@st.composite
def frames(draw) -> dict:
    """One frame to send after the handshake: a request and how it is broken."""
    opcode, meta, payload = draw(base_requests())
    mutation = draw(st.sampled_from(["none", "flip-raw", "field", "meta", "payload", "random-meta"]))
    fields = {
        "opcode": opcode,
        "meta": meta,
        "payload": payload,
        "seq_delta": 0,
        "meta_len": None,
        "payload_len": len(payload),
        "version": 1,
        "flags": 0,
        "status": 0,
        "flip": None,
    }
    if mutation == "flip-raw":
        fields["flip"] = (draw(st.integers(0, 10_000)), draw(st.integers(1, 255)))
    elif mutation == "field":
        name = draw(st.sampled_from(["opcode", "seq_delta", "meta_len", "payload_len", "version", "flags", "status"]))
        fields[name] = draw(
            {
                "opcode": st.integers(0, 255),
                "seq_delta": st.sampled_from([-1, 1, 2, -(2**20)]),
                "meta_len": st.sampled_from(
                    [0, 1, len(meta) + 1, max(0, len(meta) - 1), 2**32 - 1, p.DEFAULT_MAX_META_BYTES + 1]
                ),
                "payload_len": st.sampled_from(
                    [0, 1, len(payload) + 1, 2**63, p.DEFAULT_MAX_PAYLOAD_BYTES + 1, 16 << 20]
                ),
                "version": st.sampled_from([0, 2, 255]),
                "flags": st.integers(1, 0xFFFF),
                "status": st.integers(1, 0xFFFF),
            }[name]
        )
    elif mutation == "meta" and meta:
        at = draw(st.integers(0, len(meta) - 1))
        how = draw(st.sampled_from(["replace", "cut", "extend"]))
        if how == "replace":
            meta = meta[:at] + bytes([draw(st.integers(0, 255))]) + meta[at + 1 :]
        elif how == "cut":
            meta = meta[:at]
        else:
            meta = meta[:at] + draw(st.binary(min_size=1, max_size=50)) + meta[at:]
        fields["meta"] = meta
    elif mutation == "payload":
        fields["payload"] = payload[: len(payload) // 2] if draw(st.booleans()) else payload + b"\x00" * 7
    elif mutation == "random-meta":
        fields["meta"] = draw(st.binary(max_size=300))
    return fields


pre_handshake = st.one_of(
    st.binary(max_size=200).map(lambda b: ("raw", b)),
    st.tuples(st.integers(0, 39), st.integers(1, 255), st.integers(0, 40), st.binary(max_size=40)).map(
        lambda t: ("hello", t)
    ),
    st.tuples(st.integers(0, 35), st.integers(1, 255), st.binary(max_size=40)).map(lambda t: ("auth", t)),
)

inputs = st.one_of(
    pre_handshake.map(lambda x: ("pre", x)),
    st.lists(frames(), min_size=1, max_size=4).map(lambda fs: ("post", fs)),
)

# Inputs aimed at known-dangerous parsers, always run first.
TARGETED = [
    ("post", [{"opcode": p.Opcode.HELLO_OK, "meta": b"[" * 100_000}]),  # nested JSON: RecursionError
    ("post", [{"opcode": p.Opcode.HELLO_OK, "meta": b'{"node_id": 1, "limits": {"max_key_bytes": 1e999}}'}]),
    ("post", [{"opcode": p.Opcode.ERROR, "meta": b"\xff" * 5000, "status": 0xFFFF}]),
    ("post", [{"opcode": p.Opcode.PUT, "meta": struct.pack(">I", 4096)}]),  # count with no keys
    (
        "post",
        [{"opcode": p.Opcode.GET, "meta": key_block([b"k"] * 4096) + struct.pack(">4096I", *[p.ANY_LENGTH] * 4096)}],
    ),
    ("post", [{"opcode": p.Opcode.EXISTS, "meta": struct.pack(">I", 2**32 - 1)}]),
    (
        "post",
        [
            {
                "opcode": p.Opcode.PUT,
                "meta": key_block([b"big"]) + struct.pack(">I", 16 << 20) + b"\x01" + bytes(32),
                "payload_len": 16 << 20,
            }
        ],
    ),  # announces 16 MiB, sends none: a reserved buffer released at timeout
]


# -- running one input ------------------------------------------------------------------------


def build(raw: RawSession, f: dict) -> bytes:
    seq = (raw.send_seq + 1 + f.get("seq_delta", 0)) % (1 << 64)
    raw.send_seq += 1
    frame = raw.frame(
        f["opcode"],
        f.get("meta", b""),
        seq=seq,
        meta_len=f.get("meta_len"),
        payload_len=f.get("payload_len", len(f.get("payload", b""))),
        version=f.get("version", 1),
        flags=f.get("flags", 0),
        status=f.get("status", 0),
    )
    data = frame + f.get("payload", b"")
    if f.get("flip") is not None:
        at, xor = f["flip"]
        at %= len(data)
        data = data[:at] + bytes([data[at] ^ xor]) + data[at + 1 :]
    return data


def run_input(node, key_hex: str, item) -> None:
    phase, body = item
    with RawSession(node, key_hex, timeout_s=2.0) as raw:
        if phase == "pre":
            kind, data = body
            if kind == "hello":
                at, xor, cut, tail = data
                hello = bytearray(p.ClientHandshake(raw.key, raw.client_nonce).hello())
                hello[at] ^= xor
                payload = bytes(hello[: len(hello) - cut % 41]) + tail
            elif kind == "auth":
                at, xor, tail = data
                raw.send(p.ClientHandshake(raw.key, raw.client_nonce).hello())
                auth = bytearray(p.CLIENT_AUTH.pack(p.AUTH_MAGIC, os.urandom(32)))
                auth[at] ^= xor
                payload = bytes(auth) + tail
            else:
                payload = data
        else:
            raw.handshake()
            payload = b"".join(build(raw, f) for f in body)
        try:
            raw.send(payload)
            raw.sock.settimeout(READ_WINDOW_S)
            for _ in range(64):  # bounded: take what the node answers at once, then hang up
                if not raw.sock.recv(1 << 16):
                    break
        except OSError:  # timeout, reset: the node is free to close on us
            pass


class GoodClient:
    """Stores and reads back 64 KiB values in a loop until stopped; counts every outcome."""

    def __init__(self, client) -> None:
        self.client = client
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set() and i < 100_000:
            value = os.urandom(64 << 10)
            key = f"good/{i % 64}"
            try:
                self.client.put(key, value)
                buf = bytearray(len(value))
                if self.client.batch_get_into([(key, buf)]) != [True] or buf != value:
                    self.failures.append(f"{key}: read back wrong or missing")
                else:
                    self.ok += 1
            except Exception as exc:  # any failure of the good client is the finding
                self.failures.append(f"{key}: {type(exc).__name__}: {exc}")
            i += 1
            self.stop.wait(0.01)


def test_fuzzed_frames_never_crash_leak_or_starve_the_node(
    hostile_node, auth_key_hex, make_client, wait_until, figures
):
    node = hostile_node
    good = GoodClient(make_client([node], io_timeout_s=5.0))
    good.client.probe()
    baseline_conns = status_of(node)["connections"]  # the good client's pooled connection
    rss_before = rss_bytes(node.pid)
    count = {"inputs": 0, "rss_peak": rss_before}
    deadline = time.monotonic() + BUDGET_S

    def one(item) -> None:
        if time.monotonic() > deadline:
            return  # out of time: the remaining examples are no-ops
        run_input(node, auth_key_hex, item)
        count["inputs"] += 1
        if count["inputs"] % 50 == 0:
            assert node.proc.poll() is None, f"the node died after {count['inputs']} inputs"
            count["rss_peak"] = max(count["rss_peak"], rss_bytes(node.pid))

    @settings(
        max_examples=MAX_INPUTS,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs)
    def fuzz(item) -> None:
        one(item)

    good.thread.start()
    try:
        for item in TARGETED:
            one(item)
        fuzz()
    finally:
        good.stop.set()
        good.thread.join(10.0)
    took = BUDGET_S - max(0.0, deadline - time.monotonic())

    assert node.proc.poll() is None, "the node died"
    log = "".join(node.output)
    unhandled = "Traceback" in log or re.search(r"connection from .* failed", log)  # node.py's catch-all
    assert not unhandled, f"the node logged an unhandled error:\n{log[-3000:]}"
    assert not good.failures, f"the good client failed during the fuzz: {good.failures[:5]}"
    assert good.ok > 0
    # No leaked connections: every fuzz connection is gone once its io-timeout has passed.
    wait_until(
        lambda: status_of(node)["connections"] <= baseline_conns,
        IO_TIMEOUT_S * 3 + 5,
        what="connections back to baseline",
    )
    rss_after = rss_bytes(node.pid)
    count["rss_peak"] = max(count["rss_peak"], rss_after)
    assert count["rss_peak"] <= rss_before + CAPACITY + RSS_OVERHEAD, (
        f"RSS peaked at {count['rss_peak'] >> 20} MiB from {rss_before >> 20} MiB (capacity {CAPACITY >> 20} MiB)"
    )
    status = status_of(node)
    assert status["allocated_bytes"] <= CAPACITY
    # And it still serves, byte-exact, after the fuzz.
    client = make_client([node])
    value = os.urandom(1 << 20)
    client.put("after-fuzz", value)
    assert client.get("after-fuzz") == value
    metrics = metrics_of(node)
    refused = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("memkv_node_auth_failures_total{", "memkv_node_errors_total{"))
    )
    assert refused > 0
    figures(
        fuzz_inputs=count["inputs"],
        fuzz_seconds=round(took, 1),
        good_client_ops=good.ok,
        refused_and_counted=int(refused),
        rss_before_mib=rss_before >> 20,
        rss_peak_mib=count["rss_peak"] >> 20,
        capacity_mib=CAPACITY >> 20,
        connections_after=status_of(node)["connections"],
    )
