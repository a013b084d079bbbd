"""STARTTLS of one outbound session (RFC 3207) under its TLS policy: the configured
``worker.tls``/``worker.tls_policies`` (``manual``), or a :class:`TlsPlan` from
:mod:`jsqueue.delivery.policy.decision` (DANE, MTA-STS, opportunistic). Under a plan the
handshake accepts any certificate and the plan's check then runs on the chain the server
sent, before any MAIL: a failed enforced check ends the session with ``4.7.5``, nothing
sent in plaintext. Every session gets a :class:`~jsqueue.replies.TlsNote`.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING

import aiosmtplib

from jsqueue.config import TlsPolicy
from jsqueue.delivery.policy.certs import peer_chain
from jsqueue.delivery.policy.decision import MANUAL, OPPORTUNISTIC, TlsPlan
from jsqueue.delivery.responses import with_detail
from jsqueue.delivery.signals import NextMx, TlsFallback, literal_like
from jsqueue.delivery.sync import check_sync
from jsqueue.delivery.tls import client_context
from jsqueue.replies import R451_CONNECTION_LOST, R451_TLS_REQUIRED, Reply, TlsNote

if TYPE_CHECKING:
    from jsqueue.delivery.session import OutboundSession

__all__ = ["starttls"]

log = logging.getLogger(__name__)

_LIBRARY_ERRORS = (aiosmtplib.SMTPException, OSError, TimeoutError, ValueError)


def _manual_note(s: OutboundSession, detail: str) -> TlsNote:
    """The note of a session under the configured policy: ``manual`` when a plan said so
    or the policy is not the default opportunistic one."""
    if s.plan is not None:
        label, base = MANUAL, s.plan.detail
    elif s.policy is TlsPolicy.OPPORTUNISTIC:
        label, base = OPPORTUNISTIC, ""
    else:
        label, base = MANUAL, s.policy.value
    text = "; ".join(d for d in (base, detail) if d)
    return TlsNote(policy=label, detail=text, tls=s.tls, mx=s.host)


def _deferral(s: OutboundSession, note: TlsNote) -> Reply:
    """The ``4.7.5`` reply of a TLS policy failure, carrying its note."""
    reply = with_detail(R451_TLS_REQUIRED, f"{s.where()}: {note.detail}")
    return reply.model_copy(update={"tls": note})


async def starttls(s: OutboundSession, extensions: dict[str, str]) -> dict[str, str]:
    """STARTTLS per the session's policy; returns the extensions to use afterwards and
    sets ``s.tls``, ``s.tls_version`` and ``s.tls_note``.

    Raises:
        NextMx: TLS is required (``required``/``verify``, DANE, MTA-STS enforce) and
            STARTTLS is not offered, there is no name to verify, it is refused or fails,
            or the plan's certificate check fails (``4.7.5``); or the server refused it
            with 421 or dropped the connection; or the EHLO after it failed.
        TlsFallback: opportunistic STARTTLS failed in the handshake: retry the address
            in plaintext. (So does a TLS session that breaks later, before anyone was
            accepted: :meth:`OutboundSession.run` raises it, from ``s.tls_optional``.)
    """
    plan = s.plan
    if plan is None or plan.label == MANUAL:
        return await _manual(s, extensions)
    return await _planned(s, plan, extensions)


async def _planned(s: OutboundSession, plan: TlsPlan, extensions: dict[str, str]) -> dict[str, str]:
    """The decided plan (DANE, MTA-STS, opportunistic).

    Raises:
        NextMx: as :func:`starttls`.
        TlsFallback: as :func:`starttls`.
    """
    assert s.smtp is not None
    host = s.host
    if not s.allow_tls:
        why = "STARTTLS failed on this address: plaintext"
        s.tls_note = plan.note(tls=False, result="validation-failure", detail=why, mx=host)
        return extensions
    if "starttls" not in extensions:
        note = plan.note(
            tls=False, result="starttls-not-supported", detail="STARTTLS not offered", mx=host
        )
        if plan.required:
            raise NextMx(_deferral(s, note))
        s.tls_note = note
        return extensions
    # RFC 7672 §8.1: under DANE the SNI name is the TLSA base domain (plan.sni)
    sni = None if literal_like(host) else (plan.sni or host)
    await check_sync(s.smtp, "STARTTLS")
    try:
        await s.smtp.starttls(
            server_hostname=sni,
            tls_context=client_context(TlsPolicy.OPPORTUNISTIC),
            timeout=s.settings.mail_timeout_s,
        )
    except aiosmtplib.SMTPResponseException as e:
        why = f"STARTTLS refused: {e.code} {e.message}"
        note = plan.note(tls=False, result="starttls-not-supported", detail=why, mx=host)
        if plan.required:
            raise NextMx(_deferral(s, note)) from e
        if e.code == 421 or not s.smtp.is_connected:
            raise NextMx(with_detail(R451_CONNECTION_LOST, f"{s.where()}: {why}")) from e
        log.warning("%s: %s; continuing in plaintext", s.where(), why)
        s.tls_note = note
        return extensions
    except _LIBRARY_ERRORS as e:
        why = f"TLS handshake failed: {e or type(e).__name__}"
        if plan.required:
            note = plan.note(tls=False, result="validation-failure", detail=why, mx=host)
            raise NextMx(_deferral(s, note)) from e
        raise TlsFallback(str(e) or type(e).__name__) from e
    s.tls, s.tls_optional = True, not plan.required
    ssl_object = s.smtp.get_transport_info("ssl_object")
    if isinstance(ssl_object, ssl.SSLObject):
        s.tls_version = ssl_object.version()
    if plan.check is None:
        result = "success" if plan.required else "none"
        s.tls_note = plan.note(tls=True, result=result, detail="", mx=host)
    else:
        verdict = plan.check(peer_chain(ssl_object))
        note = plan.note(tls=True, result=verdict.result, detail=verdict.detail, mx=host)
        if not verdict.ok and plan.enforce:
            log.warning("%s: %s: %s; not delivering", s.where(), plan.label, verdict.detail)
            raise NextMx(_deferral(s, note))
        s.tls_note = note
    return await s._hello()


async def _manual(s: OutboundSession, extensions: dict[str, str]) -> dict[str, str]:
    """The configured policy (``worker.tls``, ``worker.tls_policies``; RFC 3207, 7435).

    Raises:
        NextMx: as :func:`starttls`.
        TlsFallback: as :func:`starttls`.
    """
    assert s.smtp is not None
    policy = s.policy
    if policy is TlsPolicy.NEVER or (policy is TlsPolicy.OPPORTUNISTIC and not s.allow_tls):
        s.tls_note = _manual_note(s, "plaintext")
        return extensions
    required = policy in (TlsPolicy.REQUIRED, TlsPolicy.VERIFY)
    if "starttls" not in extensions:
        if required:
            raise NextMx(with_detail(R451_TLS_REQUIRED, f"{s.where()}: STARTTLS not offered"))
        s.tls_note = _manual_note(s, "STARTTLS not offered")
        return extensions
    sni = None if literal_like(s.host) else s.host
    if policy is TlsPolicy.VERIFY and sni is None:
        raise NextMx(with_detail(R451_TLS_REQUIRED, f"{s.where()}: no name to verify"))
    await check_sync(s.smtp, "STARTTLS")
    try:
        await s.smtp.starttls(
            server_hostname=sni,
            tls_context=client_context(policy, s.settings.tls_ca_file),
            timeout=s.settings.mail_timeout_s,
        )
    except aiosmtplib.SMTPResponseException as e:
        # The server refused STARTTLS (e.g. 454) but the plaintext session is intact.
        if e.code == 421 or required or not s.smtp.is_connected:
            reason = f"STARTTLS refused: {e.code} {e.message}"
            base = R451_TLS_REQUIRED if required else R451_CONNECTION_LOST
            raise NextMx(s._fail(base, f"{s.where()}: {reason}")) from e
        refused = f"{e.code} {e.message}"
        log.warning("%s: STARTTLS refused (%s); continuing in plaintext", s.where(), refused)
        s.tls_note = _manual_note(s, f"STARTTLS refused ({refused})")
        return extensions
    except _LIBRARY_ERRORS as e:
        if required:
            raise NextMx(with_detail(R451_TLS_REQUIRED, f"{s.where()}: {e}")) from e
        raise TlsFallback(str(e) or type(e).__name__) from e
    s.tls, s.tls_optional = True, not required
    ssl_object = s.smtp.get_transport_info("ssl_object")
    if isinstance(ssl_object, ssl.SSLObject):
        s.tls_version = ssl_object.version()
    s.tls_note = _manual_note(s, "")
    return await s._hello()
