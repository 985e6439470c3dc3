"""Certificates the tests make for themselves (the `cryptography` package, via PyJWT[crypto]).

`make_pki(directory)` writes PEM files and returns their paths as a `Pki`:

* `ca`: the CA that signs everything below; `other_ca`: a CA nobody here trusts;
* `server`: the node, for 127.0.0.1, localhost and the node addresses of tests/netns.py; `server2`: a second node certificate from
  the same CA (a rotation target, with another serial number); `wrong_name`: a node
  certificate for `elsewhere.example` only; `expired`: a node certificate that expired;
  `rogue`: a node certificate signed by `other_ca`;
* `client`: a client certificate signed by `ca`; `rogue_client`: one signed by `other_ca`.

EC P-256 keys: making them takes milliseconds. Each `Cert` is (cert, key) paths.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.netns import node_addresses


@dataclasses.dataclass(frozen=True)
class Cert:
    cert: str
    key: str
    serial: int


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: str
    other_ca: str
    server: Cert
    server2: Cert
    wrong_name: Cert
    expired: Cert
    rogue: Cert
    client: Cert
    rogue_client: Cert


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _ca(directory: Path, cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{cn}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, str(path)


def _leaf(
    directory: Path,
    stem: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str],
    names: list[str],
    client: bool = False,
    expired: bool = False,
) -> Cert:
    ca_cert, ca_key, _ = issuer
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = (
        (now - datetime.timedelta(days=10), now - datetime.timedelta(days=1))
        if expired
        else (
            now - datetime.timedelta(days=1),
            now + datetime.timedelta(days=30),
        )
    )
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    serial = x509.random_serial_number()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return Cert(str(cert_path), str(key_path), serial)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "memkv-test-ca")
    other = _ca(directory, "memkv-other-ca")
    here = ["127.0.0.1", "localhost", *node_addresses()]  # nodes on other hosts: tests/netns.py
    return Pki(
        ca=ca[2],
        other_ca=other[2],
        server=_leaf(directory, "server", ca, here),
        server2=_leaf(directory, "server2", ca, here),
        wrong_name=_leaf(directory, "wrong-name", ca, ["elsewhere.example"]),
        expired=_leaf(directory, "expired", ca, here, expired=True),
        rogue=_leaf(directory, "rogue", other, here),
        client=_leaf(directory, "client", ca, [], client=True),
        rogue_client=_leaf(directory, "rogue-client", other, [], client=True),
    )


_SESSION: list[Pki] = []


def session_pki() -> Pki:
    """One Pki per test process, in a temporary folder removed at exit."""
    if not _SESSION:
        import atexit
        import shutil
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="memkv-pki-"))
        atexit.register(shutil.rmtree, directory, True)
        _SESSION.append(make_pki(directory))
    return _SESSION[0]


def node_tls_args(pki: Pki) -> list[str]:
    """`memkv serve` flags for a TLS-only data port with the test CA's node certificate."""
    return ["--tls-cert", pki.server.cert, "--tls-key", pki.server.key]


def connect_to(node: object, timeout_s: float) -> socket.socket:
    """A TCP connection to `node` (a LocalNode), wrapped in TLS when the node serves TLS
    (`node.client_tls`, set by tests/conftest.py's NodeFactory)."""
    host, port = node.host, node.port  # type: ignore[attr-defined]
    sock = socket.create_connection((host, port), timeout=timeout_s)
    tls = getattr(node, "client_tls", None)
    if tls is None:
        return sock
    from memkv.tls import client_context

    try:
        return client_context(tls).wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def admin_context(node: object) -> ssl.SSLContext | None:
    """The context that verifies `node`'s HTTPS admin port, or None for plain HTTP."""
    tls = getattr(node, "client_tls", None)
    if tls is None:
        return None
    from memkv.tls import client_context

    return client_context(tls)
