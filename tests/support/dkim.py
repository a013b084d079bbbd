"""DKIM keys and verification for tests: fresh RSA (``cryptography``) and Ed25519 (PyNaCl)
key pairs written as key files, their public keys as zone lines for the loopback
:class:`~support.dns.DnsServer` (``<selector>._domainkey.<domain>`` TXT, RFC 6376 §3.6.2),
and dkimpy verification whose key lookup goes to that server only (dkimpy's ``dnsfunc``
hook), never to the real DNS.

Usage::

    key = TestKey.ed25519("example.test", "jsq")
    key.write(tmp_path / "jsq.key")
    with DnsServer(key.zone_line()) as dns:
        assert verify(message, dns)                  # the first DKIM-Signature
        assert verify(message, dns, index=1) is False  # the second one does not verify
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import dkim
import dns.exception
import dns.resolver
import nacl.signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from support.dns import DnsServer


@dataclass(frozen=True)
class TestKey:
    """One key pair: ``secret`` as a key file holds it, ``public`` as the TXT ``p=``."""

    domain: str
    selector: str
    algorithm: str  # "rsa-sha256" or "ed25519-sha256"
    secret: bytes
    public: bytes

    __test__ = False  # not a pytest test class

    @classmethod
    def rsa(cls, domain: str, selector: str, bits: int = 2048) -> TestKey:
        key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(domain, selector, "rsa-sha256", pem, base64.b64encode(der))

    @classmethod
    def ed25519(cls, domain: str, selector: str) -> TestKey:
        key = nacl.signing.SigningKey.generate()
        return cls(
            domain,
            selector,
            "ed25519-sha256",
            base64.b64encode(bytes(key)),
            base64.b64encode(bytes(key.verify_key)),
        )

    @property
    def name(self) -> str:
        """Where the public key is published."""
        return f"{self.selector}._domainkey.{self.domain}"

    def txt(self) -> str:
        """The TXT record's text (RFC 6376 §3.6.1)."""
        k = "rsa" if self.algorithm == "rsa-sha256" else "ed25519"
        return f"v=DKIM1; k={k}; p={self.public.decode()}"

    def zone_line(self) -> str:
        """A zone line for :class:`DnsServer`, the text split in strings of 200 octets."""
        text = self.txt()
        parts = " ".join(f'"{text[i : i + 200]}"' for i in range(0, len(text), 200))
        return f"{self.name}. 300 IN TXT {parts}\n"

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.secret + b"\n")
        return path

    def sign(self, message: bytes, headers: list[bytes] | None = None) -> bytes:
        """``message`` signed by this key with dkimpy, relaxed/relaxed (as an author's
        own signature would be)."""
        field = dkim.sign(
            message,
            self.selector.encode(),
            self.domain.encode(),
            self.secret,
            canonicalize=(b"relaxed", b"relaxed"),
            signature_algorithm=self.algorithm.encode(),
            include_headers=headers or [b"from", b"to", b"subject", b"date", b"message-id"],
        )
        return bytes(field) + message


def dnsfunc(server: DnsServer):  # type: ignore[no-untyped-def]
    """dkimpy's ``dnsfunc``: the first TXT record of a name, from ``server`` only."""

    def lookup(name: bytes, timeout: int = 5) -> bytes | None:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [server.host]
        resolver.port = server.port
        try:
            answer = resolver.resolve(name.decode().rstrip("."), "TXT", lifetime=timeout)
        except dns.exception.DNSException:
            return None
        for rdata in answer:
            return b"".join(rdata.strings)
        return None

    return lookup


def verify(message: bytes, server: DnsServer, index: int = 0) -> bool:
    """Whether the ``index``-th DKIM-Signature field of ``message`` verifies (dkimpy, the
    public key from ``server``)."""
    d = dkim.DKIM(message)
    try:
        return bool(d.verify(idx=index, dnsfunc=dnsfunc(server)))
    except dkim.DKIMException:  # e.g. "body hash mismatch": does not verify
        return False


def signatures(message: bytes) -> list[dict[bytes, bytes]]:
    """The tags of every DKIM-Signature field of ``message``, top first."""
    headers, _ = dkim.rfc822_parse(message)
    return [
        dkim.util.parse_tag_value(value)
        for name, value in headers
        if name.lower() == b"dkim-signature"
    ]
