"""The ``[worker.dkim]`` settings: which private keys sign outgoing mail (RFC 6376 DKIM,
RSA-SHA256 and Ed25519-SHA256 per RFC 8463), found in a directory (e.g. a mounted
Kubernetes Secret) and/or listed one by one. Paths only: the keys are read and checked at
worker start by :mod:`jsqueue.delivery.dkim`, which names the setting of a bad one.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from jsqueue.config.base import _Section

__all__ = ["DkimAlgorithm", "DkimIdentity", "DkimKeySettings", "DkimSettings"]

# A DNS label as a selector (RFC 6376 §3.1: sub-domain of one or more labels).
_SELECTOR = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*")
_DOMAIN = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)(\.(?!-)[a-z0-9-]{1,63}(?<!-))+")


class DkimAlgorithm(StrEnum):
    """The ``a=`` signing algorithm (RFC 6376 §3.3, RFC 8463 §3)."""

    RSA_SHA256 = "rsa-sha256"
    ED25519_SHA256 = "ed25519-sha256"


class DkimIdentity(StrEnum):
    """Whose domain picks the key: the RFC 5322 From field's (what DMARC aligns with,
    RFC 7489 §3.1) or the envelope reverse-path's (RFC 5321 MAIL FROM)."""

    FROM = "from"
    REVERSE_PATH = "reverse-path"


def _domain(value: str) -> str:
    """A signing domain: lower-case A-label form, no trailing dot.

    Raises:
        ValueError: not a domain name of at least two labels (U-labels are converted).
    """
    text = value.strip().rstrip(".").lower()
    try:
        text = text.encode("idna").decode("ascii")
    except UnicodeError as e:
        raise ValueError(f"not a domain name: {value!r}") from e
    if not _DOMAIN.fullmatch(text) or len(text) > 253:
        raise ValueError(f"not a domain name: {value!r}")
    return text


def _selector(value: str) -> str:
    """A selector (RFC 6376 §3.1).

    Raises:
        ValueError: not one or more DNS labels.
    """
    if not _SELECTOR.fullmatch(value):
        raise ValueError(f"not a DKIM selector (DNS labels): {value!r}")
    return value


Domain = Annotated[str, AfterValidator(_domain)]
Selector = Annotated[str, AfterValidator(_selector)]


class DkimKeySettings(_Section):
    """One signing key: ``[[worker.dkim.keys]]``."""

    domain: Domain = Field(description="signing domain (d=), e.g. example.com")
    selector: Selector = Field(
        description="selector (s=): the public key is the TXT record SELECTOR._domainkey.DOMAIN"
    )
    key_file: Path = Field(
        description="private key: PEM (PKCS#1 or PKCS#8) for RSA, base64 seed for Ed25519"
    )
    algorithm: DkimAlgorithm | None = Field(
        None, description="rsa-sha256 or ed25519-sha256; from the key file when unset"
    )


class DkimSettings(_Section):
    """DKIM signing at egress (RFC 6376): keys per signing domain; unsigned when none fits."""

    keys_dir: Path | None = Field(
        None,
        description="directory of keys: DOMAIN/SELECTOR.key or "
        "SELECTOR._domainkey.DOMAIN.key files (e.g. a mounted Secret); hidden entries skipped",
    )
    keys: list[DkimKeySettings] = Field(
        default_factory=list, description="keys listed one by one ([[worker.dkim.keys]])"
    )
    signer: DkimIdentity = Field(
        DkimIdentity.FROM, description="the domain that picks the key: From field or reverse-path"
    )
    max_sign_octets: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="larger messages go unsigned, octets: dkimpy signs in memory, "
        "its peak is about 26 times the message (bench/dkim_sign.py)",
    )
