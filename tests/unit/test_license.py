"""MEMKV_LICENSE: optional in the open build; when set it must be a readable file or a
well-formed JWT; its plan is reported as verified only when a configured public key checks the
signature; a bad value is refused without echoing it."""

from __future__ import annotations

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from memkv.errors import ConfigError
from memkv.license import check_license

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def signer():
    key = Ed25519PrivateKey.generate()
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return key, public_pem.decode()


def token(key, plan="ENTERPRISE-PLUS") -> str:
    return jwt.encode({"plan": plan, "sub": "acme"}, key, algorithm="EdDSA")


def test_no_license_is_fine():
    assert check_license(None) is None and check_license("") is None


def test_inline_jwt_without_a_verification_key_is_reported_unverified(signer):
    status = check_license(token(signer[0]))
    assert status.plan == "ENTERPRISE-PLUS" and not status.verified
    assert "unverified" in status.log_line()


def test_license_file_verified_with_the_public_key(signer, tmp_path):
    path = tmp_path / "minio.license"
    path.write_text(token(signer[0], plan="PRO") + "\n")
    key_path = tmp_path / "pub.pem"
    key_path.write_text(signer[1])
    status = check_license(str(path), str(key_path))
    assert status.verified and status.plan == "PRO" and status.source == f"file {path}"
    assert status.log_line() == "memkv-client license verified plan=PRO"


def test_signature_from_another_key_is_refused(signer):
    other = Ed25519PrivateKey.generate()
    with pytest.raises(ConfigError, match="signature does not verify"):
        check_license(token(other), signer[1])


def test_garbage_is_refused_without_echoing_it():
    secret_looking = "eyJhbGciOi.not-a-jwt-really-secret-value"
    with pytest.raises(ConfigError) as info:
        check_license(secret_looking)
    assert "MEMKV_LICENSE" in str(info.value) and secret_looking not in str(info.value)
