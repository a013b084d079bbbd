"""Which DKIM key signs a message, and which header fields it covers (pure, no I/O; the
signing itself is :mod:`jsqueue.delivery.dkim`, over dkimpy).

- The signing domain (RFC 6376 §3.5 ``d=``) is picked by the RFC 5322 From field's domain
  (the first mailbox's, what DMARC aligns with, RFC 7489 §3.1) or, with ``signer =
  "reverse-path"``, the envelope reverse-path's (the null reverse-path of a DSN falls back
  to From). The domain's own keys sign; else the nearest parent domain with keys (relaxed
  alignment, RFC 7489 §3.1.1); else the message goes unsigned. Every key of that domain
  signs once (e.g. RSA and Ed25519 side by side, RFC 8463 §4).
- The header list follows RFC 6376 §5.4.1: the fields of its list that the message has,
  in order, each as often as it occurs; From, and the RFC 5322 §3.6 fields that may occur
  only once, are listed once more ("oversigned", §8.15) so that none can be added later
  without breaking the signature. Trace fields, ``Return-Path``, ``Bcc`` and existing
  ``DKIM-Signature`` fields are never signed (§5.4).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from email.utils import getaddresses

__all__ = [
    "OVERSIGNED",
    "SIGNED",
    "choose_domain",
    "field_names",
    "field_values",
    "from_domains",
    "header_list",
    "signature_domains",
]

#: RFC 6376 §5.4.1's list of fields a signer should sign (lower case).
SIGNED = (
    "from",
    "reply-to",
    "subject",
    "date",
    "to",
    "cc",
    "resent-date",
    "resent-from",
    "resent-to",
    "resent-cc",
    "in-reply-to",
    "references",
    "list-id",
    "list-help",
    "list-unsubscribe",
    "list-subscribe",
    "list-post",
    "list-owner",
    "list-archive",
    # further fields whose change alters what the reader sees (§5.4 leaves it open)
    "sender",
    "message-id",
    "mime-version",
    "content-type",
    "content-transfer-encoding",
    "content-id",
    "content-description",
)

#: Listed once more than they occur (§8.15): From always, the RFC 5322 §3.6 singletons
#: when present.
OVERSIGNED = ("from", "sender", "reply-to", "subject", "date", "to", "cc", "message-id")

_FIELD = re.compile(rb"^([\x21-\x39\x3b-\x7e]+)[ \t]*:", re.M)


def field_names(header_section: bytes) -> list[str]:
    """The field names of ``header_section`` (raw, CRLF), lower case, in order; folded
    continuation lines are no field (RFC 5322 §2.2)."""
    return [m.group(1).decode("ascii").lower() for m in _FIELD.finditer(header_section)]


def header_list(names: Sequence[str]) -> list[str]:
    """The ``h=`` list for a message with fields ``names`` (lower case, in order): every
    field of :data:`SIGNED` it has, then one more of each :data:`OVERSIGNED` one it has,
    and ``from`` once more in any case (RFC 6376 §5.4, §8.15). Pure."""
    present = [n for n in names if n in SIGNED]
    extra = [n for n in OVERSIGNED if n in present or n == "from"]
    return present + extra


def field_values(header_section: bytes, name: str) -> list[str]:
    """The values of the ``name`` fields (lower case), unfolded, as text (8-bit octets kept as
    surrogates: RFC 6532 UTF-8 decodes)."""
    values: list[str] = []
    text = header_section.decode("utf-8", "surrogateescape")
    current: list[str] | None = None
    for line in text.split("\r\n"):
        if line[:1] in (" ", "\t") and current is not None:
            current.append(line)
            continue
        if current is not None:
            values.append("".join(current))
            current = None
        field, sep, value = line.partition(":")
        if sep and field.strip().lower() == name:
            current = [value]
    if current is not None:
        values.append("".join(current))
    return values


def from_domains(header_section: bytes) -> list[str]:
    """The domains of the From field's mailboxes (RFC 5322 §3.6.2), lower case, in order;
    empty when there is no From field or no parsable address. Pure."""
    domains: list[str] = []
    for _, address in getaddresses(field_values(header_section, "from")):
        local, at, domain = address.rpartition("@")
        if at and local and domain:
            domains.append(domain.strip().rstrip(".").lower())
    return domains


def _a_label(domain: str) -> str:
    try:
        return domain.encode("idna").decode("ascii")
    except UnicodeError:
        return domain


def choose_domain(
    key_domains: Collection[str],
    *,
    author_domains: Sequence[str],
    reverse_path: str,
    by_reverse_path: bool,
) -> str | None:
    """The signing domain (``d=``) for a message, or None (sent unsigned). Pure.

    Args:
        key_domains: the domains that have keys (lower-case A-labels).
        author_domains: the From field's domains (:func:`from_domains`); the first counts.
        reverse_path: the envelope reverse-path (``""`` is ``<>``).
        by_reverse_path: pick by the reverse-path's domain (the From domain for ``<>``).

    Returns:
        the identity domain when it has keys, else its nearest parent domain with keys
        (two labels at least), else None.
    """
    identity: str | None = None
    if by_reverse_path and "@" in reverse_path:
        identity = reverse_path.rpartition("@")[2]
    elif author_domains:
        identity = author_domains[0]
    if not identity:
        return None
    labels = _a_label(identity.strip().rstrip(".").lower()).split(".")
    for start in range(len(labels) - 1):
        candidate = ".".join(labels[start:])
        if candidate in key_domains:
            return candidate
    return None


_D_TAG = re.compile(r"(?:^|;)\s*d\s*=\s*([^;\s]+)")


def signature_domains(header_section: bytes) -> list[str]:
    """The ``d=`` of each ``DKIM-Signature`` field already in the message (RFC 6376
    §3.5), in order; ``?`` for one without a readable ``d=``. Pure."""
    out: list[str] = []
    for value in field_values(header_section, "dkim-signature"):
        m = _D_TAG.search(value)
        out.append(m.group(1).lower() if m else "?")
    return out
