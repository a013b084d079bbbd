"""DKIM signing at egress (RFC 6376; Ed25519-SHA256 per RFC 8463, RSA-SHA256), an adapter
around dkimpy: :func:`load_keys` reads the ``worker.dkim`` keys at worker start and
:class:`DkimSigner` signs the exact bytes an attempt sends (after any 7-bit conversion, see
:mod:`jsqueue.delivery.body`); which key signs and which fields are covered is
:mod:`jsqueue.delivery.signing` (pure).

Canonicalisation is relaxed/relaxed (RFC 6376 §3.4.2, §3.4.4), no ``l=`` (§8.2). dkimpy
has no streaming interface: it splits the whole message into lines, canonicalises and hashes
it in memory (measured by ``bench/dkim_sign.py``: 0.4–0.5 s of CPU per MB and a peak of
about 26 times the message size), so each worker signs in one thread of its own, one
message at a time, and messages over ``worker.dkim.max_sign_octets`` go unsigned.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import dkim
import dkim.crypto
import nacl.exceptions
import nacl.signing
from pydantic import TypeAdapter, ValidationError

from jsqueue.config.dkim import DkimAlgorithm, DkimIdentity, DkimSettings, Domain, Selector
from jsqueue.delivery.signing import choose_domain, field_names, from_domains, header_list
from jsqueue.errors import ConfigError, SigningError

__all__ = ["DkimSigner", "Signed", "SigningKey", "load_keys"]

log = logging.getLogger(__name__)

_KEY_SUFFIX = ".key"
_FLAT_INFIX = "._domainkey."
MIN_RSA_BITS = 1024
"""RFC 8301 §3.2: signers MUST use RSA keys of at least 1024 bits (2048 recommended)."""


@dataclass(frozen=True)
class SigningKey:
    """One private key and where its public half is published.

    Attributes:
        domain: signing domain ``d=`` (lower-case A-label).
        selector: ``s=``; the public key is the TXT record at ``<s>._domainkey.<d>``.
        algorithm: ``a=``.
        secret: the key as dkimpy takes it (PEM for RSA, base64 seed for Ed25519).
        source: the setting and path it came from, for messages.
    """

    domain: str
    selector: str
    algorithm: DkimAlgorithm
    secret: bytes = field(repr=False)
    source: str = ""

    def describe(self) -> str:
        """``d=<domain> s=<selector> a=<algorithm>``."""
        return f"d={self.domain} s={self.selector} a={self.algorithm.value}"


@dataclass(frozen=True)
class Signed:
    """What signing one message variant gave.

    Attributes:
        header: the ``DKIM-Signature`` fields to put on top of the message (CRLF ends),
            empty when it goes unsigned.
        summary: what the attempt reports: ``d=… s=… a=…`` per signature (``, ``
            between), ``unsigned: <why>`` when a key applied but signing did not happen,
            None when no key applies.
    """

    header: bytes = b""
    summary: str | None = None


def _parse_key(data: bytes, where: str, algorithm: DkimAlgorithm | None) -> SigningKey:
    """Check ``data`` as a private key; the domain and selector are filled by the caller.

    Raises:
        ConfigError: not a usable RSA (PEM, ≥ 1024 bits) or Ed25519 (base64 seed) key, or
            not of the ``algorithm`` given.
    """
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        found = DkimAlgorithm.RSA_SHA256
        try:
            parsed = dkim.crypto.parse_pem_private_key(text)
        except (dkim.crypto.UnparsableKeyError, ValueError, binascii.Error):
            raise ConfigError(f"{where}: not a PEM RSA private key (PKCS#1 or PKCS#8)") from None
        bits = int(parsed["modulus"]).bit_length()
        if bits < MIN_RSA_BITS:
            raise ConfigError(f"{where}: RSA key of {bits} bits; at least {MIN_RSA_BITS}")
    else:
        found = DkimAlgorithm.ED25519_SHA256
        try:
            seed = base64.b64decode(text, validate=True)
            if len(seed) == 32:
                nacl.signing.SigningKey(seed)
        except (ValueError, binascii.Error, nacl.exceptions.CryptoError):
            seed = b""
        if len(seed) != 32:
            why = "neither a PEM RSA key nor a base64 Ed25519 seed of 32 octets"
            raise ConfigError(f"{where}: {why}") from None
    if algorithm is not None and algorithm is not found:
        raise ConfigError(f"{where}: an {found.value} key, not {algorithm.value}")
    return SigningKey("", "", found, text, where)


def _read(path: Path, where: str) -> bytes:
    """The file's bytes.

    Raises:
        ConfigError: it cannot be read (missing, a directory, no permission).
    """
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} {path}: {e.strerror or e}") from None


def _from_dir(directory: Path) -> list[tuple[str, str, Path]]:
    """(domain, selector, path) of every key in ``directory``: ``<domain>/<selector>.key``
    and ``<selector>._domainkey.<domain>.key``; hidden entries (a mounted Secret's
    ``..data``) and other files skipped.

    Raises:
        ConfigError: the directory cannot be listed.
    """
    where = "worker.dkim.keys_dir"
    found: list[tuple[str, str, Path]] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                    if sub.name.endswith(_KEY_SUFFIX) and not sub.name.startswith("."):
                        selector = sub.name[: -len(_KEY_SUFFIX)]
                        found.append((entry.name, selector, Path(sub.path)))
            elif entry.name.endswith(_KEY_SUFFIX) and _FLAT_INFIX in entry.name:
                selector, _, domain = entry.name[: -len(_KEY_SUFFIX)].partition(_FLAT_INFIX)
                found.append((domain, selector, Path(entry.path)))
    except OSError as e:
        raise ConfigError(f"{where} {directory}: {e.strerror or e}") from None
    return found


def load_keys(settings: DkimSettings) -> list[SigningKey]:
    """Read and check every configured key (at worker start).

    Args:
        settings: ``worker.dkim``: ``keys_dir`` and/or ``keys``.

    Returns:
        the keys, ``keys_dir``'s first (sorted by name), then ``keys`` in order.

    Raises:
        ConfigError: one line naming the setting: a key file missing or unreadable, not a
            key, of another algorithm than configured, an RSA key under 1024 bits, a
            directory entry whose name is no domain or selector, or one (domain, selector)
            given twice.
    """
    keys: list[SigningKey] = []
    if settings.keys_dir is not None:
        for domain, selector, path in _from_dir(settings.keys_dir):
            where = f"worker.dkim.keys_dir {path}"
            try:
                domain = TypeAdapter(Domain).validate_python(domain)
                selector = TypeAdapter(Selector).validate_python(selector)
            except ValidationError as e:
                reason = e.errors()[0]["msg"]
                raise ConfigError(f"{where}: {reason}") from None
            key = _parse_key(_read(path, "worker.dkim.keys_dir"), where, None)
            keys.append(SigningKey(domain, selector, key.algorithm, key.secret, where))
    for i, k in enumerate(settings.keys):
        name = f"worker.dkim.keys[{i}].key_file"
        key = _parse_key(_read(k.key_file, name), f"{name} {k.key_file}", k.algorithm)
        keys.append(SigningKey(k.domain, k.selector, key.algorithm, key.secret, name))
    seen: dict[tuple[str, str], str] = {}
    for key in keys:
        other = seen.setdefault((key.domain, key.selector), key.source)
        if other != key.source:
            raise ConfigError(
                f"{key.source}: selector {key.selector} of {key.domain} also in {other}"
            )
    return keys


class DkimSigner:
    """Signs messages with the configured keys (RFC 6376 §5), one dkimpy call at a time
    in a thread of its own (dkimpy holds the whole message in memory; see the module
    docstring).

    Args:
        keys: the keys (:func:`load_keys`); none = nothing is ever signed.
        settings: ``worker.dkim`` (which domain picks the key, the size limit).
    """

    def __init__(self, keys: Sequence[SigningKey], settings: DkimSettings) -> None:
        self.settings = settings
        self.by_domain: dict[str, list[SigningKey]] = {}
        for key in keys:
            self.by_domain.setdefault(key.domain, []).append(key)
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_settings(cls, settings: DkimSettings) -> DkimSigner:
        """A signer over the keys of ``settings``.

        Raises:
            ConfigError: see :func:`load_keys`.
        """
        return cls(load_keys(settings), settings)

    def keys_for(self, header_section: bytes, reverse_path: str) -> list[SigningKey]:
        """The keys that sign a message with this header section and reverse-path
        (:func:`~jsqueue.delivery.signing.choose_domain`); empty = unsigned. Pure."""
        if not self.by_domain:
            return []
        domain = choose_domain(
            self.by_domain,
            author_domains=from_domains(header_section),
            reverse_path=reverse_path,
            by_reverse_path=self.settings.signer is DkimIdentity.REVERSE_PATH,
        )
        return list(self.by_domain.get(domain, [])) if domain else []

    def unsigned_reason(self, size: int) -> str | None:
        """Why a message of ``size`` octets goes unsigned (over ``max_sign_octets``), or
        None when it may be signed."""
        limit = self.settings.max_sign_octets
        if size > limit:
            return f"unsigned: {size} octets > worker.dkim.max_sign_octets {limit}"
        return None

    async def sign(self, message: bytes, keys: Sequence[SigningKey]) -> Signed:
        """Sign ``message`` (the whole raw message as it goes on the wire, CRLF) with each
        of ``keys``; the fields go on top in ``keys`` order. Not idempotent (``t=``).

        Returns:
            the fields and their summary; ``unsigned: …`` when the message is larger than
            ``max_sign_octets``.

        Raises:
            SigningError: dkimpy refused the message (e.g. a header line it cannot parse).
        """
        if not keys:
            return Signed()
        reason = self.unsigned_reason(len(message))
        if reason is not None:
            return Signed(b"", reason)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="dkim")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _sign, message, list(keys))

    def close(self) -> None:
        """Stop the signing thread (after the signature under way). Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _sign(message: bytes, keys: list[SigningKey]) -> Signed:
    """dkimpy's ``DKIM.sign`` per key over one parse of ``message``, relaxed/relaxed, the
    :func:`header_list` fields.

    Raises:
        SigningError: dkimpy raised (``DKIMException``), or its output is not a field.
    """
    end = message.find(b"\r\n\r\n")
    header_section = message if end < 0 else message[: end + 2]
    include = [n.encode() for n in header_list(field_names(header_section))]
    fields: list[bytes] = []
    parsed: dkim.DKIM | None = None  # parsed once, signed once per key
    for key in keys:
        try:
            if parsed is None:
                parsed = dkim.DKIM(message, linesep=b"\r\n")
            value = parsed.sign(
                key.selector.encode(),
                key.domain.encode(),
                key.secret,
                signature_algorithm=key.algorithm.value.encode(),
                canonicalize=(b"relaxed", b"relaxed"),
                include_headers=include,
                length=False,
            )
        except dkim.DKIMException as e:
            raise SigningError(f"{key.describe()}: {e}") from e
        if not isinstance(value, bytes) or not value.startswith(b"DKIM-Signature:"):
            raise SigningError(f"{key.describe()}: dkimpy returned no DKIM-Signature field")
        fields.append(value if value.endswith(b"\r\n") else value + b"\r\n")
    return Signed(b"".join(fields), ", ".join(k.describe() for k in keys))
