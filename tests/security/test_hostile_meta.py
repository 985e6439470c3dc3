"""Meta that no parser should choke on: deeply nested JSON in a HELLO_OK-opcode frame.

Behaviour under test: the codec turns JSON nested past the interpreter's recursion limit into a
RemoteProtocolError (MALFORMED) like any other malformed meta, and a live node, receiving it from
an authenticated client, answers ERROR MALFORMED, counts `errors{code="malformed"}`, logs no
unhandled exception and keeps serving.
"""

from __future__ import annotations

import os

import pytest

from memkv import protocol as p
from memkv.errors import RemoteProtocolError
from tests.faults.nodeops import metric_value, metrics_of
from tests.security.raw import RawSession

pytestmark = pytest.mark.integration

NESTED = b"[" * 100_000


def test_codec_reads_nested_json_as_malformed_meta():
    key = os.urandom(32)
    sender, receiver = p.FrameCodec(key, os.urandom(32), p.Limits()), p.FrameCodec(os.urandom(32), key, p.Limits())
    frame = sender.encode(p.ErrorReply(0, ""), validate=False)  # a valid frame to take a header from
    header = p.FRAME_HEADER.pack(b"MK", 1, p.Opcode.HELLO_OK, 0, 0, 1, len(NESTED), 0)
    import hashlib
    import hmac

    mac = hmac.new(key, header + NESTED, hashlib.sha256).digest()
    prefix = header + mac
    with pytest.raises(RemoteProtocolError) as info:
        receiver.open(receiver.parse_header(prefix), prefix, NESTED)
    assert info.value.code == p.ErrorCode.MALFORMED
    assert frame  # (the sender side is untouched by any of this)


def test_node_answers_nested_json_with_malformed_and_keeps_serving(hostile_node, auth_key_hex, make_client, wait_until):
    before = metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="malformed")
    with RawSession(hostile_node, auth_key_hex) as raw:
        raw.handshake()
        raw.send(raw.frame(p.Opcode.HELLO_OK, NESTED))
        error = raw.error_then_close()
    assert error.code == p.ErrorCode.MALFORMED
    wait_until(
        lambda: metric_value(metrics_of(hostile_node), "memkv_node_errors_total", code="malformed") == before + 1,
        5.0,
        what="the malformed frame to be counted",
    )
    assert "Traceback" not in "".join(hostile_node.output)
    client = make_client([hostile_node])
    client.put("after-nested", b"x" * 10)
    assert client.get("after-nested") == b"x" * 10
