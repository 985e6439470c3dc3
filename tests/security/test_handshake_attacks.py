"""Every handshake and session attack is refused and counted by reason.

Behaviour under test, one case per attack, each against a live node: the node answers with the
refusal the protocol names (a refusal ServerHello, an AuthReject, an ERROR frame, or a close),
counts exactly one `memkv_node_auth_failures_total{reason}` (or `errors_total{code}` where the
protocol says so) and nothing else, and keeps serving a good client:

* wrong key: a real client with another key (it refuses the node's proof: `wrong_key`), and a
  raw client that answers with a proof under another key (`bad_proof`);
* no key: a zero proof, skipping ClientAuth, frames without any handshake;
* a replayed handshake (a recorded hello + proof on a new connection);
* a replayed frame, reordered frames, a frame of another connection's session, a frame
  reflected back to the node;
* a downgrade to protocol version 0 (and 2) in the hello, and a version-0 frame mid-session.
"""

from __future__ import annotations

import os

import pytest

from memkv import AuthError
from memkv import protocol as p
from tests.faults.nodeops import metrics_of
from tests.security.raw import RawSession, key_block

pytestmark = pytest.mark.integration

AUTH = "memkv_node_auth_failures_total"
ERRORS = "memkv_node_errors_total"


def counters(node) -> dict[tuple[str, str], float]:
    """Every auth-failure and error sample: {(metric, label value): count}."""
    out = {}
    for line in metrics_of(node).splitlines():
        for name in (AUTH, ERRORS):
            if line.startswith(name + "{"):
                label = line.split('"')[1]
                out[(name, label)] = float(line.rsplit(" ", 1)[1])
    return out


def delta(before: dict, after: dict) -> dict:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)
    }


# -- the attacks: each returns what the node sent back --------------------------------------------


def wrong_key_client(node, key_hex, make_client):
    with pytest.raises(AuthError):
        make_client([node], auth_key_hex=os.urandom(32).hex()).probe()


def proof_under_another_key(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        other = p.ClientHandshake(os.urandom(32), raw.client_nonce)  # another key, same nonce
        raw.send(other.hello())
        server_hello = raw.sock.recv(p.SERVER_HELLO.size)
        # Skip verifying the node's proof (it would fail) and prove with the other key anyway.
        transcript = bytes([1]) + raw.client_nonce + server_hello[8:40]
        import hashlib
        import hmac

        proof = hmac.new(other._key, b"memkv/1 client proof" + transcript, hashlib.sha256).digest()
        raw.send(p.AUTH_MAGIC + proof)
        return raw.read_to_eof()


def zero_proof(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.send(p.ClientHandshake(os.urandom(32), raw.client_nonce).hello())
        raw.sock.recv(p.SERVER_HELLO.size)
        raw.send(p.AUTH_MAGIC + bytes(32))
        return raw.read_to_eof()


def frame_instead_of_client_auth(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.send(p.ClientHandshake(os.urandom(32), raw.client_nonce).hello())
        raw.sock.recv(p.SERVER_HELLO.size)
        raw.c2s_key = os.urandom(32)
        raw.send(raw.frame(p.Opcode.EXISTS, key_block([b"k"])))
        return raw.read_to_eof()


def frames_without_a_handshake(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.c2s_key = os.urandom(32)
        raw.send(raw.frame(p.Opcode.EXISTS, key_block([b"k"])))
        return raw.read_to_eof()


def replayed_handshake(node, key_hex, make_client):
    with RawSession(node, key_hex) as good:
        good.handshake()
        recorded = good.hello_bytes + good.auth_bytes
    with RawSession(node, key_hex) as raw:
        raw.send(recorded)  # the node's nonce is new: the old proof cannot verify
        return raw.read_to_eof()


def replayed_frame(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.handshake()
        frame = raw.encode(p.ExistsRequest((b"k",)))
        raw.send(frame)
        raw.read_frame()
        raw.send(frame)
        return raw.error_then_close()


def reordered_frames(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.handshake()
        first = raw.frame(p.Opcode.EXISTS, key_block([b"a"]))
        second = raw.frame(p.Opcode.EXISTS, key_block([b"b"]))
        raw.send(second + first)
        return raw.error_then_close()


def frame_of_another_session(node, key_hex, make_client):
    with RawSession(node, key_hex) as a, RawSession(node, key_hex) as b:
        a.handshake()
        b.handshake()
        b.send(a.frame(p.Opcode.EXISTS, key_block([b"k"])))  # seq 1 on both: only the MAC differs
        error = b.error_then_close()
        a.send(a.frame(p.Opcode.EXISTS, key_block([b"k"]), seq=1))  # and `a` is unaffected
        reply, _ = a.read_frame()
        assert isinstance(reply, p.StatusReply)
        return error


def reflected_node_frame(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.handshake()
        raw.send(raw.frame(p.Opcode.PING))
        raw.read_frame()
        # The node's own PING reply (seq 2 from its side) MACed with its key, sent back at it.
        assert raw.codec is not None
        s2c_key = raw.codec._recv_mac  # the node's direction key, as the client holds it
        header = p.FRAME_HEADER.pack(b"MK", 1, p.Opcode.PING | p.Opcode.REPLY, 0, 0, 2, 0, 0)
        mac = s2c_key.copy()
        mac.update(header)
        raw.send(header + mac.digest())
        return raw.error_then_close()


def hello_version(version):
    def attack(node, key_hex, make_client):
        with RawSession(node, key_hex) as raw:
            raw.send(p.ClientHandshake(os.urandom(32), raw.client_nonce, version).hello())
            return raw.read_to_eof()

    return attack


def frame_version_zero(node, key_hex, make_client):
    with RawSession(node, key_hex) as raw:
        raw.handshake()
        raw.send(raw.frame(p.Opcode.EXISTS, key_block([b"k"]), version=0))
        return raw.error_then_close()


REFUSE_VERSION = p.ServerHandshake.refusal(p.ErrorCode.UNSUPPORTED_VERSION)
REJECT = p.auth_reject(p.ErrorCode.AUTH_FAILED)
CASES = [
    # id, attack, counter it must bump by one, what the node must answer
    ("wrong-key-client", wrong_key_client, (AUTH, "wrong_key"), None),
    ("proof-under-another-key", proof_under_another_key, (AUTH, "bad_proof"), REJECT),
    ("no-key-zero-proof", zero_proof, (AUTH, "bad_proof"), REJECT),
    ("no-key-skips-client-auth", frame_instead_of_client_auth, (AUTH, "bad_proof"), REJECT),
    (
        "no-key-no-handshake",
        frames_without_a_handshake,
        (AUTH, "bad_hello"),
        p.ServerHandshake.refusal(p.ErrorCode.BAD_MAGIC),
    ),
    (
        "replayed-handshake",
        replayed_handshake,
        (AUTH, "bad_proof"),
        lambda got: len(got) == p.SERVER_HELLO.size + len(REJECT) and got[:4] == b"MKVS" and got.endswith(REJECT),
    ),
    ("replayed-frame", replayed_frame, (AUTH, "bad_sequence"), p.ErrorCode.BAD_SEQUENCE),
    ("reordered-frames", reordered_frames, (AUTH, "bad_sequence"), p.ErrorCode.BAD_SEQUENCE),
    ("frame-of-another-session", frame_of_another_session, (AUTH, "bad_mac"), p.ErrorCode.BAD_MAC),
    ("reflected-node-frame", reflected_node_frame, (AUTH, "bad_mac"), p.ErrorCode.BAD_MAC),
    ("downgrade-hello-v0", hello_version(0), (AUTH, "unsupported_version"), REFUSE_VERSION),
    ("hello-v2", hello_version(2), (AUTH, "unsupported_version"), REFUSE_VERSION),
    ("downgrade-frame-v0", frame_version_zero, (ERRORS, "unsupported_version"), p.ErrorCode.UNSUPPORTED_VERSION),
]


@pytest.mark.parametrize("attack, counter, answer", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_attack_is_refused_and_counted_once_by_reason(
    hostile_node, auth_key_hex, make_client, wait_until, figures, attack, counter, answer
):
    before = counters(hostile_node)
    got = attack(hostile_node, auth_key_hex, make_client)
    if isinstance(answer, bytes):
        assert got == answer
    elif callable(answer):
        assert answer(got), got
    elif answer is not None:
        assert isinstance(got, p.ErrorReply) and got.code == answer, got
    changes = wait_until(lambda: delta(before, counters(hostile_node)) or None, 5.0, what=f"{counter} to be counted")
    assert changes == {counter: 1.0}, f"expected exactly one {counter}, got {changes}"
    assert hostile_node.proc.poll() is None
    client = make_client([hostile_node])
    client.put("after-attack", b"v" * 100)
    assert client.get("after-attack") == b"v" * 100
    figures(attack=counter[1], refused=True)
