"""Certificate checks after a STARTTLS handshake, with ``cryptography`` (no crypto of our
own): the peer's chain from the TLS object, WebPKI validation for MTA-STS (RFC 8461 §4.2),
and DANE matching (RFC 6698 §2.1, RFC 7671 §5, RFC 7672 §3.1).
"""

from __future__ import annotations

import hashlib
import ssl
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from jsqueue.config import Settings
from jsqueue.errors import ConfigError

__all__ = ["Tlsa", "Verdict", "dane_verdict", "load_store", "peer_chain", "webpki_verdict"]

#: DER encoding in the ``_ssl`` module (``ssl.Certificate.public_bytes``).
_ENCODING_DER = 2

#: TLSA certificate usages SMTP may use (RFC 7672 §3.1): DANE-TA(2), DANE-EE(3).
USABLE_USAGES = (2, 3)
USABLE_SELECTORS = (0, 1)
USABLE_MATCHING = (0, 1, 2)


@dataclass(frozen=True)
class Tlsa:
    """One TLSA record (RFC 6698 §2.1): usage, selector, matching type, data."""

    usage: int
    selector: int
    mtype: int
    data: bytes

    @property
    def usable(self) -> bool:
        """Usable for SMTP: DANE-TA or DANE-EE, a known selector and matching type, and
        data of the right length for the digest (RFC 7672 §3.1.3, RFC 7671 §4)."""
        sizes = {1: 32, 2: 64}
        return (
            self.usage in USABLE_USAGES
            and self.selector in USABLE_SELECTORS
            and self.mtype in USABLE_MATCHING
            and (self.mtype == 0 or len(self.data) == sizes[self.mtype])
        )

    def __str__(self) -> str:
        return f"{self.usage} {self.selector} {self.mtype} {self.data.hex()[:16]}"

    def text(self) -> str:
        """The record in presentation form (RFC 6698 §2.2), data in hex."""
        return f"{self.usage} {self.selector} {self.mtype} {self.data.hex()}"

    def matches(self, cert: x509.Certificate) -> bool:
        """Whether ``cert`` (selector 0) or its SubjectPublicKeyInfo (selector 1), as is
        (matching type 0), or its SHA-256 (1) or SHA-512 (2) digest, equals the data."""
        if self.selector == 0:
            content = cert.public_bytes(Encoding.DER)
        else:
            content = cert.public_key().public_bytes(
                Encoding.DER, PublicFormat.SubjectPublicKeyInfo
            )
        if self.mtype == 1:
            content = hashlib.sha256(content).digest()
        elif self.mtype == 2:
            content = hashlib.sha512(content).digest()
        return content == self.data


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``result`` is ``success`` or an RFC 8460 §4.3 result type,
    ``detail`` says why."""

    result: str
    detail: str

    @property
    def ok(self) -> bool:
        """The check passed."""
        return self.result == "success"


def peer_chain(tls: object) -> list[x509.Certificate]:
    """The certificates the server sent, leaf first, unverified.

    ``tls`` is the ``ssl.SSLObject`` of the connection. Python 3.13 has
    ``get_unverified_chain()``; before it the same call exists on the object's ``_sslobj``.
    Falls back to the leaf alone (``getpeercert(binary_form=True)``).
    """
    ders: list[bytes] = []
    chain = getattr(tls, "get_unverified_chain", None)
    raw = chain() if callable(chain) else None
    if raw is None:
        inner = getattr(tls, "_sslobj", None)
        getter = getattr(inner, "get_unverified_chain", None)
        raw = getter() if callable(getter) else None
    for item in raw or []:
        ders.append(item if isinstance(item, bytes) else item.public_bytes(_ENCODING_DER))
    if not ders and isinstance(tls, ssl.SSLObject | ssl.SSLSocket):
        leaf = tls.getpeercert(binary_form=True)
        if leaf:
            ders.append(leaf)
    return [x509.load_der_x509_certificate(d) for d in ders]


def load_store(ca_file: Path | None) -> list[x509.Certificate]:
    """The trusted CAs from ``ca_file`` (PEM), else from the system's default CA file, else
    every ``*.pem``/``*.crt`` of its CA directory.

    Raises:
        OSError: the file cannot be read.
        ValueError: no certificate found.
    """
    paths = ssl.get_default_verify_paths()
    if ca_file is not None or paths.cafile:
        files = [Path(str(ca_file or paths.cafile))]
    elif paths.capath:
        files = sorted(
            p for p in Path(paths.capath).iterdir() if p.suffix in (".pem", ".crt") and p.is_file()
        )
    else:
        files = []
    certs: list[x509.Certificate] = []
    with warnings.catch_warnings():
        # some system roots have non-positive serial numbers; they still anchor chains
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        for path in files:
            certs.extend(x509.load_pem_x509_certificates(path.read_bytes()))
    if not certs:
        raise ValueError(f"no CA certificate in {ca_file or paths.cafile or paths.capath}")
    return certs


def _verify(
    chain: list[x509.Certificate], roots: list[x509.Certificate], names: list[str]
) -> str | None:
    """None when ``chain`` validates to one of ``roots`` for one of ``names``, else why.

    Signatures, validity dates, CA constraints and the name (subjectAltName, RFC 6125)
    are checked; the CA/Browser Forum's rules on the leaf's extensions are not (SMTP
    servers' certificates are not web certificates: a critical subjectAltName or
    extendedKeyUsage is no reason to defer mail)."""
    why = "no name to check"
    leaf_policy = ExtensionPolicy.permit_all().require_present(
        x509.SubjectAlternativeName, Criticality.AGNOSTIC, None
    )
    for name in names:
        verifier = (
            PolicyBuilder()
            .store(Store(roots))
            .time(datetime.now(UTC))
            .extension_policies(
                ee_policy=leaf_policy, ca_policy=ExtensionPolicy.webpki_defaults_ca()
            )
            .build_server_verifier(x509.DNSName(name))
        )
        try:
            verifier.verify(chain[0], chain[1:])
        except VerificationError as e:
            why = f"{name}: {e}".split(" (encountered")[0]
            continue
        return None
    return why


def _classify(why: str, leaf: x509.Certificate) -> str:
    now = datetime.now(UTC)
    if leaf.not_valid_after_utc < now or leaf.not_valid_before_utc > now:
        return "certificate-expired"
    if "name" in why.lower() or "san" in why.lower():
        return "certificate-host-mismatch"
    return "certificate-not-trusted"


def webpki_verdict(
    chain: list[x509.Certificate], roots: list[x509.Certificate], mx_host: str
) -> Verdict:
    """RFC 8461 §4.2: the MX's certificate chains to a trusted CA, is valid now and names
    ``mx_host`` (RFC 6125 rules as ``cryptography`` applies them)."""
    if not chain:
        return Verdict("certificate-not-trusted", "no certificate")
    why = _verify(chain, roots, [mx_host])
    if why is None:
        return Verdict("success", f"certificate valid for {mx_host}")
    return Verdict(_classify(why, chain[0]), f"certificate for {mx_host}: {why}")


def dane_verdict(chain: list[x509.Certificate], records: list[Tlsa], names: list[str]) -> Verdict:
    """RFC 7672 §3.1: DANE-EE(3) matches the leaf, names and dates not checked; DANE-TA(2)
    matches a certificate of the chain that then anchors a path validation of the leaf
    for one of ``names`` (the MX host name first), dates included. Only usable records
    count (PKIX-TA/EE are not, RFC 7672 §3.1.3)."""
    usable = [r for r in records if r.usable]
    if not chain:
        return Verdict("validation-failure", "no certificate")
    for r in usable:
        if r.usage == 3 and r.matches(chain[0]):
            return Verdict("success", f"TLSA {r} matched the certificate (DANE-EE)")
    reasons: list[str] = []
    for r in usable:
        if r.usage != 2:
            continue
        for anchor in chain[1:] or chain:
            if not r.matches(anchor):
                continue
            below = chain[: chain.index(anchor)] or chain[:1]
            why = _verify(below, [anchor], names)
            if why is None:
                return Verdict("success", f"TLSA {r} anchored the chain (DANE-TA)")
            reasons.append(f"TLSA {r}: {why}")
    detail = "; ".join(reasons) or "no TLSA record matched the certificate chain"
    return Verdict("validation-failure", detail)


def check_ca_files(settings: Settings) -> None:
    """Load every configured CA bundle once (``worker.tls_ca_file``,
    ``outbound_tls.mta_sts_ca_file``), so that a missing or empty one stops the start
    instead of failing each verified delivery as ``certificate-not-trusted``.

    Raises:
        ConfigError: a bundle cannot be read or holds no certificate (names the setting).
    """
    for name, path in (
        ("worker.tls_ca_file", settings.worker.tls_ca_file),
        ("outbound_tls.mta_sts_ca_file", settings.outbound_tls.mta_sts_ca_file),
    ):
        if path is None:
            continue
        try:
            certs = load_store(path)
        except OSError as e:
            raise ConfigError(f"{name} {path}: {e.strerror or e}") from e
        except ValueError as e:
            raise ConfigError(f"{name} {path}: no PEM certificate ({e})") from e
        assert certs  # load_store raises ValueError rather than return none
