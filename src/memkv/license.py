"""MEMKV_LICENSE handling. The open build needs no license; existing deployments set one.

When set, MEMKV_LICENSE must be a readable file or a well-formed JWT. Its `plan` claim is
logged; the line says `verified` only when a configured public key (MEMKV_LICENSE_PUBLIC_KEY
or `license_public_key`) checks the signature, otherwise it says the license is unverified.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jwt

from memkv.config import ENV_LICENSE, ENV_LICENSE_PUBLIC_KEY
from memkv.errors import ConfigError

log = logging.getLogger("memkv.client")

_ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384", "PS512", "EdDSA"]


@dataclasses.dataclass(frozen=True)
class LicenseStatus:
    plan: str | None
    verified: bool
    source: str  # "file <path>" or "inline"

    def log_line(self) -> str:
        if self.verified:
            return f"memkv-client license verified plan={self.plan}"
        return f"memkv-client license present but unverified (no verification key configured) plan={self.plan}"


def _read_token(value: str) -> tuple[str, str]:
    value = value.strip()
    if os.path.exists(value):
        try:
            with open(value) as f:
                return f.read().strip(), f"file {value}"
        except OSError as exc:
            raise ConfigError(f"{ENV_LICENSE}: cannot read {value}: {exc.strerror}") from None
    return value, "inline"


def check_license(value: str | None, public_key: str | None = None) -> LicenseStatus | None:
    """Validate a license setting; None when no license is configured."""
    if not value:
        return None
    token, source = _read_token(value)
    try:
        header = jwt.get_unverified_header(token)
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        # Never echo the value: it may be a secret with a typo.
        raise ConfigError(
            f"{ENV_LICENSE}: neither a readable file nor a well-formed JWT ({source}, {len(token)} characters)"
        ) from None
    plan = claims.get("plan")
    if not public_key:
        return LicenseStatus(plan, False, source)
    key_text = public_key
    if os.path.exists(public_key):
        with open(public_key) as f:
            key_text = f.read()
    alg = header.get("alg")
    if alg not in _ALGORITHMS:
        raise ConfigError(f"{ENV_LICENSE}: signature algorithm {alg!r} is not accepted ({', '.join(_ALGORITHMS)})")
    try:
        jwt.decode(token, key_text, algorithms=[alg], options={"verify_aud": False})
    except jwt.PyJWTError as exc:
        raise ConfigError(f"{ENV_LICENSE}: signature does not verify with {ENV_LICENSE_PUBLIC_KEY}: {exc}") from None
    return LicenseStatus(plan, True, source)
