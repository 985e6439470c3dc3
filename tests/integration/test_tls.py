"""TLS and mutual TLS against real `memkv serve` processes (issue 20).

Every failure case of the startup probe names its cause (unknown CA, hostname mismatch,
expired certificate, client certificate required, a plain client on a TLS port, a TLS client
on a plain port), and after each the node still serves a correct client. SIGHUP rotation:
connections already up keep working, new handshakes see the new certificate. The admin port
speaks HTTPS and `memkv status` verifies it.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from memkv import Client, ClientConfig
from memkv import protocol as p
from memkv.client.node import NodeConnection, tcp_connect
from memkv.config import AuthKey, ClientTls, ServerAddress
from memkv.errors import AuthError, ConnectError, MemKVError, MemKVTimeout, ProtocolError, ServerError, TlsError
from memkv.local import LocalNode
from memkv.tls import client_connect, client_context
from tests.conftest import poll_until
from tests.tlscerts import Cert, Pki

MiB = 1 << 20


def tls_args(cert: Cert, ca: str | None = None, listen: str | None = None) -> list[str]:
    args = ["--tls-cert", cert.cert, "--tls-key", cert.key]
    if ca is not None:
        args += ["--tls-ca", ca]
    if listen is not None:
        args += ["--tls-listen", listen]
    return args


def client_for(node: LocalNode, key_hex: str, tls: ClientTls | None, port: int | None = None, host: str | None = None):
    return Client(
        ClientConfig(
            servers=(ServerAddress(host or node.host, port or node.port),),
            auth_key=AuthKey.from_hex(key_hex, "test session key"),
            tls=tls,
            io_timeout_s=5.0,
            connect_timeout_s=2.0,
            down_for_s=0.1,
        )
    )


def probe_error(client: Client) -> TlsError:
    try:
        with client:
            client.probe()
    except TlsError as exc:
        # The vLLM tier's explain_probe_failure adds a hint only for these classes; a TlsError
        # is none of them, so the tier's startup message is this text unchanged.
        assert not isinstance(exc, (AuthError, ConnectError, MemKVTimeout, ProtocolError, ServerError))
        assert tier_explain()(exc) == str(exc)
        return exc
    pytest.fail("the probe passed where it must fail")


def tier_explain():
    """The tier's own explain_probe_failure (tests/ops/test_docs_troubleshooting.py compiles it
    from memkv_vllm/startup.py's source: importing memkv_vllm's modules needs vLLM)."""
    from tests.ops.test_docs_troubleshooting import explain_probe_failure

    return explain_probe_failure()


def assert_serves(node: LocalNode, key_hex: str, tls: ClientTls | None, **kw) -> None:
    with client_for(node, key_hex, tls, **kw) as client:
        assert client.probe()[0].server


def peer_serial(host: str, port: int, ca: str, cert: Cert | None = None) -> int:
    ctx = client_context(ClientTls(ca=ca, cert=cert.cert if cert else None, key=cert.key if cert else None))
    with socket.create_connection((host, port), timeout=5.0) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        der = s.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.fixture(scope="module")
def tls_node(start_module_node, pki: Pki) -> LocalNode:
    return start_module_node(capacity="128MiB", extra_args=tls_args(pki.server))


@pytest.fixture(scope="module")
def mtls_node(start_module_node, pki: Pki) -> LocalNode:
    return start_module_node(capacity="64MiB", extra_args=tls_args(pki.server, ca=pki.ca))


def test_values_round_trip_over_tls_into_the_callers_buffers(tls_node: LocalNode, auth_key_hex: str, pki: Pki):
    with client_for(tls_node, auth_key_hex, ClientTls(ca=pki.ca)) as client:
        big = bytes(range(256)) * (16 * MiB // 256)
        small = b"tiny value"
        assert client.batch_put_views([(b"tls/big", memoryview(big)), (b"tls/small", memoryview(small))]) == [
            True,
            True,
        ]
        into_big, into_small = bytearray(len(big)), bytearray(len(small))
        assert client.batch_get_into([(b"tls/big", memoryview(into_big)), (b"tls/small", memoryview(into_small))]) == [
            True,
            True,
        ]
        assert into_big == big and into_small == small
        assert client.get(b"tls/small") == small
        assert client.exists([b"tls/big", b"tls/none"]) == [True, False]
        assert client.delete([b"tls/big"]) == [True]


def test_the_node_certificate_must_be_signed_by_a_trusted_ca(tls_node, auth_key_hex, pki):
    exc = probe_error(client_for(tls_node, auth_key_hex, ClientTls(ca=pki.other_ca)))
    assert "unknown CA" in str(exc) and "MEMKV_TLS_CA" in str(exc)
    assert_serves(tls_node, auth_key_hex, ClientTls(ca=pki.ca))


def test_the_node_certificate_must_name_the_host(tls_node, auth_key_hex, pki):
    exc = probe_error(client_for(tls_node, auth_key_hex, ClientTls(ca=pki.ca, server_name="memkv-0.example")))
    assert "hostname mismatch" in str(exc) and "MEMKV_TLS_SERVER_NAME" in str(exc)
    # The certificate names 127.0.0.1 and localhost: both verify, by address or by name.
    assert_serves(tls_node, auth_key_hex, ClientTls(ca=pki.ca), host="localhost")
    assert_serves(tls_node, auth_key_hex, ClientTls(ca=pki.ca, server_name="localhost"))


def test_an_expired_node_certificate_is_named(start_node, auth_key_hex, pki):
    node = start_node(capacity="64MiB", extra_args=tls_args(pki.expired))
    exc = probe_error(client_for(node, auth_key_hex, ClientTls(ca=pki.ca)))
    assert "expired" in str(exc)


def test_a_plain_client_on_a_tls_port_is_told_so(tls_node, auth_key_hex, pki):
    exc = probe_error(client_for(tls_node, auth_key_hex, None))
    assert "a plain client on a TLS port" in str(exc) and "MEMKV_TLS_CA" in str(exc)
    assert_serves(tls_node, auth_key_hex, ClientTls(ca=pki.ca))


def test_a_tls_client_on_a_plain_port_is_told_so(start_module_node, auth_key_hex, pki):
    plain = start_module_node(capacity="64MiB")
    exc = probe_error(client_for(plain, auth_key_hex, ClientTls(ca=pki.ca)))
    assert "a TLS client on a plain port" in str(exc)
    assert_serves(plain, auth_key_hex, None)


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_node, auth_key_hex, pki):
    exc = probe_error(client_for(mtls_node, auth_key_hex, ClientTls(ca=pki.ca)))
    assert "requires a client certificate" in str(exc) and "MEMKV_TLS_CERT" in str(exc)
    assert_serves(mtls_node, auth_key_hex, ClientTls(ca=pki.ca, cert=pki.client.cert, key=pki.client.key))


def test_mutual_tls_refuses_a_client_certificate_of_another_ca(mtls_node, auth_key_hex, pki):
    rogue = ClientTls(ca=pki.ca, cert=pki.rogue_client.cert, key=pki.rogue_client.key)
    exc = probe_error(client_for(mtls_node, auth_key_hex, rogue))
    assert "does not trust our client certificate" in str(exc)
    assert_serves(mtls_node, auth_key_hex, ClientTls(ca=pki.ca, cert=pki.client.cert, key=pki.client.key))


def test_tls_does_not_replace_the_auth_key(tls_node, pki):
    wrong = "ab" * 32
    with pytest.raises(AuthError, match="MEMKV_AUTH_KEY"), client_for(tls_node, wrong, ClientTls(ca=pki.ca)) as client:
        client.probe()


def test_tls_listen_serves_tls_beside_the_plain_port(start_node, auth_key_hex, pki):
    node = start_node(capacity="64MiB", extra_args=tls_args(pki.server, listen="127.0.0.1:0"))
    assert node.tls_port is not None and node.tls_port != node.port
    assert_serves(node, auth_key_hex, None)  # the plain port keeps serving plain clients
    assert_serves(node, auth_key_hex, ClientTls(ca=pki.ca), port=node.tls_port)
    exc = probe_error(client_for(node, auth_key_hex, None, port=node.tls_port))
    assert "a plain client on a TLS port" in str(exc)


def test_sighup_rotates_the_certificate_and_keeps_open_connections(start_node, auth_key_hex, pki, tmp_path: Path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    node = start_node(capacity="64MiB", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)])
    connect = client_connect(ClientTls(ca=pki.ca), tcp_connect)
    address = ServerAddress(node.host, node.port)
    opened = NodeConnection(address, bytes.fromhex(auth_key_hex), 2.0, 5.0, connect=connect)
    try:
        assert peer_serial(node.host, node.port, pki.ca) == pki.server.serial
        # A broken file first: the node keeps the certificate it has (and keeps serving).
        cert.write_text("not a certificate\n")
        node.signal(signal.SIGHUP)
        poll_until(lambda: any("TLS reload failed" in line for line in node.output), 10.0, what="a failed reload")
        assert peer_serial(node.host, node.port, pki.ca) == pki.server.serial
        # Then the new pair (key first: a reload between the two writes fails and is retried).
        shutil.copy(pki.server2.key, key)
        shutil.copy(pki.server2.cert, cert)
        node.signal(signal.SIGHUP)
        poll_until(
            lambda: peer_serial(node.host, node.port, pki.ca) == pki.server2.serial, 10.0, what="the new certificate"
        )
        # The connection opened before the rotation still works, on its old session.
        assert isinstance(opened.request(p.PingRequest()), p.PingReply)
    finally:
        opened.close()


def test_admin_port_speaks_https_and_memkv_status_verifies_it(start_node, auth_key_hex, pki, tmp_path: Path):
    node = start_node(capacity="64MiB", extra_args=[*tls_args(pki.server, ca=pki.ca), "--admin-port", "0"])
    assert node.admin_url.startswith("https://")
    ctx = client_context(ClientTls(ca=pki.ca))  # no client certificate: the admin port asks for none
    with (
        socket.create_connection((node.host, node.admin_port), timeout=5.0) as raw,
        ctx.wrap_socket(raw, server_hostname=node.host) as s,
    ):
        s.sendall(b"GET /v1/ready HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 200") and b'"ready": true' in answer
    # Plain HTTP on the HTTPS port gets no answer, and the port keeps serving.
    with socket.create_connection((node.host, node.admin_port), timeout=5.0) as raw:
        raw.sendall(b"GET /v1/ready HTTP/1.0\r\n\r\n")
        try:
            assert not raw.recv(4096).startswith(b"HTTP/")
        except (ConnectionResetError, TimeoutError):
            pass
    env = {
        "MEMKV_SERVERS": node.address,
        "MEMKV_AUTH_KEY": auth_key_hex,
        "MEMKV_TLS_CA": pki.ca,
        "MEMKV_TLS_CERT": pki.client.cert,
        "MEMKV_TLS_KEY": pki.client.key,
        "XDG_CONFIG_HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
    }
    offset = str(node.admin_port - node.port)
    run = subprocess.run(
        [sys.executable, "-m", "memkv", "status", "--json", "--admin-port-offset", offset],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(run.stdout)
    assert doc["ok"], run.stdout + run.stderr
    assert doc["servers"][0]["auth"] == "ok"
    # Without the CA, status names the TLS cause of the admin port's failure.
    env["MEMKV_TLS_CA"] = pki.other_ca
    run = subprocess.run(
        [sys.executable, "-m", "memkv", "status", "--json", "--admin-port-offset", offset],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(run.stdout)
    assert not doc["ok"] and "unknown CA" in doc["servers"][0]["error"], doc


def test_bad_tls_flags_are_configuration_errors(tmp_path: Path, auth_key_hex, pki):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "memkv", "serve", "--listen", "127.0.0.1:0", "--capacity", "64MiB", *args],
            env={"MEMKV_AUTH_KEY": auth_key_hex, "PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    run = serve("--tls-cert", pki.server.cert)
    assert run.returncode == 2 and "--tls-cert and --tls-key" in run.stderr
    run = serve("--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", pki.server.key)
    assert run.returncode == 2 and "no such file" in run.stderr and "missing.crt" in run.stderr
    run = serve("--tls-cert", pki.server.cert, "--tls-key", pki.server2.key)  # not its key
    assert run.returncode == 2 and "matching private key" in run.stderr
    assert "PRIVATE KEY" not in run.stderr  # key material is never printed


def test_ssl_module_refuses_tls_below_1_3(tls_node, pki):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection((tls_node.host, tls_node.port), timeout=5.0) as raw, pytest.raises(ssl.SSLError):
        ctx.wrap_socket(raw, server_hostname=tls_node.host)


def test_sigterm_closes_open_tls_connections_and_the_node_exits_cleanly(start_node, auth_key_hex, pki):
    """shutdown() must reach the TLS sockets (they replace the TCP ones in the node's set): the
    node exits 0 on SIGTERM, not by the SIGKILL that follows a hung stop, and an open client
    connection sees the close (a failed request, never a hang)."""
    node = start_node(capacity="64MiB", extra_args=tls_args(pki.server))
    connect = client_connect(ClientTls(ca=pki.ca), tcp_connect)
    opened = NodeConnection(ServerAddress(node.host, node.port), bytes.fromhex(auth_key_hex), 2.0, 5.0, connect=connect)
    try:
        assert isinstance(opened.request(p.PingRequest()), p.PingReply)
        assert node.stop(timeout_s=10.0) == 0, node.output
        assert any("node stopped" in line for line in node.output)
        with pytest.raises(MemKVError):
            opened.request(p.PingRequest())
    finally:
        opened.close()
