"""TLS settings (memkv.config ClientTls / ServerConfig, memkv.tls contexts and messages).

Behaviour under test:
* the client's TLS is off unless a MEMKV_TLS_* variable or a `tls:` block says otherwise; each
  variable beats its yaml key; an empty `tls: {}` turns TLS on with the system's CAs;
* a client certificate without its key (or the reverse), a `tls:` that is not a mapping or has
  unknown keys, and empty values are ConfigErrors naming the setting;
* the node's TLS flags must come together (--tls-cert with --tls-key; --tls-ca / --tls-listen
  need both);
* contexts are TLS 1.3 only, verify the peer and check host names; mutual TLS requires a client
  certificate; unreadable or mismatched files are ConfigErrors that name the file and never
  print key material;
* `explain_tls` names each cause.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from memkv.config import ClientConfig, ClientTls, ServerConfig
from memkv.errors import ConfigError, explain_tls
from memkv.tls import ServerTls, client_context, server_context
from tests.tlscerts import session_pki

pytestmark = pytest.mark.unit

KEY = "5e" * 32


@pytest.fixture(autouse=True)
def no_default_key_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def env(**extra: str) -> dict[str, str]:
    return {"MEMKV_AUTH_KEY": KEY, **extra}


def test_tls_is_off_by_default() -> None:
    assert ClientConfig.from_env(env()).tls is None


def test_env_variables_turn_tls_on_and_beat_the_yaml(tmp_path: Path) -> None:
    y = tmp_path / "client.yaml"
    y.write_text("tls:\n  ca: /yaml/ca.crt\n  server_name: yaml.example\n")
    tls = ClientConfig.from_env(env(MEMKV_CONFIG=str(y), MEMKV_TLS_CA="/env/ca.crt")).tls
    assert tls == ClientTls(ca="/env/ca.crt", server_name="yaml.example")
    assert ClientConfig.from_env(env(MEMKV_TLS_SERVER_NAME="memkv.example")).tls == ClientTls(
        server_name="memkv.example"
    )


def test_an_empty_tls_block_turns_tls_on_with_the_system_store(tmp_path: Path) -> None:
    y = tmp_path / "client.yaml"
    y.write_text("tls: {}\n")
    assert ClientConfig.from_env(env(MEMKV_CONFIG=str(y))).tls == ClientTls()


@pytest.mark.parametrize(
    ("yaml_text", "variables", "message"),
    [
        ("", {"MEMKV_TLS_CERT": "/c.crt"}, "must be set together"),
        ("", {"MEMKV_TLS_KEY": "/c.key"}, "must be set together"),
        ("tls: /ca.crt\n", {}, "tls must be a mapping"),
        ("tls:\n  cafile: /ca.crt\n", {}, "tls has unknown keys ['cafile']"),
        ("tls:\n  ca: ''\n", {}, "tls.ca: expected a non-empty string"),
    ],
)
def test_bad_client_tls_settings_name_the_setting(
    tmp_path: Path, yaml_text: str, variables: dict, message: str
) -> None:
    y = tmp_path / "client.yaml"
    y.write_text(yaml_text or "{}\n")
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_env(env(MEMKV_CONFIG=str(y), **variables))
    assert message in str(info.value)
    assert KEY not in str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls_cert": "/n.crt"}, "--tls-cert and --tls-key must be given together"),
        ({"tls_key": "/n.key"}, "--tls-cert and --tls-key must be given together"),
        ({"tls_ca": "/ca.crt"}, "need --tls-cert and --tls-key"),
        ({"tls_listen": ("127.0.0.1", 0)}, "need --tls-cert and --tls-key"),
    ],
)
def test_node_tls_flags_come_together(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(capacity_bytes=1 << 30, **fields)


def test_contexts_are_tls13_only_verify_peers_and_check_host_names() -> None:
    pki = session_pki()
    client = client_context(ClientTls(ca=pki.ca))
    assert client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    node = server_context(pki.server.cert, pki.server.key, None)
    assert node.minimum_version == ssl.TLSVersion.TLSv1_3 and node.verify_mode == ssl.CERT_NONE
    mutual = ServerTls(pki.server.cert, pki.server.key, pki.ca)
    assert mutual.context.verify_mode == ssl.CERT_REQUIRED
    assert mutual.admin_context.verify_mode == ssl.CERT_NONE, "the admin port never asks for a client certificate"


def test_unusable_files_name_the_file_and_never_print_key_material(tmp_path: Path) -> None:
    pki = session_pki()
    with pytest.raises(ConfigError, match="--tls-cert: no such file"):
        server_context(str(tmp_path / "none.crt"), pki.server.key, None)
    with pytest.raises(ConfigError, match=r"--tls-key: no such file .*none\.key"):
        server_context(pki.server.cert, str(tmp_path / "none.key"), None)
    with pytest.raises(ConfigError, match="matching private key") as info:
        server_context(pki.server.cert, pki.server2.key, None)
    key_pem = Path(pki.server2.key).read_text()
    assert key_pem.splitlines()[1] not in str(info.value)
    with pytest.raises(ConfigError, match="MEMKV_TLS_CA: no such file"):
        client_context(ClientTls(ca=str(tmp_path / "none.pem")))
    bad = tmp_path / "bad.pem"
    bad.write_text("not pem\n")
    with pytest.raises(ConfigError, match="not a PEM CA certificate"):
        client_context(ClientTls(ca=str(bad)))


def test_a_failed_reload_keeps_the_previous_context(tmp_path: Path) -> None:
    pki = session_pki()
    cert, key = tmp_path / "n.crt", tmp_path / "n.key"
    cert.write_bytes(Path(pki.server.cert).read_bytes())
    key.write_bytes(Path(pki.server.key).read_bytes())
    tls = ServerTls(str(cert), str(key), None)
    before = tls.context
    cert.write_text("half-written\n")
    assert tls.reload() is False and tls.context is before
    cert.write_bytes(Path(pki.server2.cert).read_bytes())
    key.write_bytes(Path(pki.server2.key).read_bytes())
    assert tls.reload() is True and tls.context is not before and tls.reloads == 1


def test_explain_names_each_cause() -> None:
    def verify(code: int, message: str) -> ssl.SSLCertVerificationError:
        exc = ssl.SSLCertVerificationError(1, message)
        exc.verify_code, exc.verify_message = code, message
        return exc

    def reason(name: str) -> ssl.SSLError:
        exc = ssl.SSLError(1, name)
        exc.reason = name
        return exc

    assert "unknown CA" in explain_tls(verify(20, "unable to get local issuer certificate"))
    assert "hostname mismatch" in explain_tls(verify(62, "Hostname mismatch"))
    assert "expired" in explain_tls(verify(10, "certificate has expired"))
    assert "requires a client certificate" in explain_tls(reason("TLSV13_ALERT_CERTIFICATE_REQUIRED"))
    assert "does not trust our client certificate" in explain_tls(reason("TLSV1_ALERT_UNKNOWN_CA"))
    assert "a TLS client on a plain port" in explain_tls(reason("WRONG_VERSION_NUMBER"))
