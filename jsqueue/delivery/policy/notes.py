"""TLS notes on replies (:class:`~jsqueue.replies.TlsNote`): the note of a session put on
every reply it gave, and the ``4.7.5`` reply of an MX a policy refused before connecting
(RFC 8461 §4.2, RFC 7672 §2.1.1). Pure."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from jsqueue.delivery.base import DeliveryResult
from jsqueue.delivery.resolver import MxTarget
from jsqueue.delivery.responses import with_detail
from jsqueue.replies import R451_TLS_REQUIRED, Reply, TlsNote

if TYPE_CHECKING:
    from jsqueue.delivery.policy.decision import TlsPlan
    from jsqueue.delivery.session import OutboundSession

__all__ = ["fallback_note", "last_failure", "refused_reply", "with_note"]


def refused_reply(target: MxTarget, note: TlsNote) -> Reply:
    """``451 4.7.5`` for an MX its policy forbids, with the note."""
    reply = with_detail(R451_TLS_REQUIRED, f"{target.host} [{target.address}]: {note.detail}")
    return reply.model_copy(update={"tls": note})


def fallback_note(plan: TlsPlan | None, session: OutboundSession, error: Exception) -> TlsNote:
    """The note of an opportunistic session whose handshake failed (a plaintext retry
    follows): a failure for TLS reports (RFC 8460 ``validation-failure``)."""
    label = plan.label if plan is not None else session.policy.value
    detail = f"TLS handshake failed ({error}); retried in plaintext"
    return TlsNote(policy=label, result="validation-failure", detail=detail, mx=session.host)


def last_failure(last: Reply | None, earlier: list[TlsNote]) -> Reply | None:
    """The reply every recipient gets when no MX took the message, its TLS note (if any)
    listing the other failed sessions' notes as ``earlier``."""
    if last is None or last.tls is None:
        return last
    before = tuple(n for n in earlier if n is not last.tls)
    return last.model_copy(update={"tls": last.tls.model_copy(update={"earlier": before})})


def with_note(
    result: DeliveryResult, session: OutboundSession, earlier: list[TlsNote] | None = None
) -> DeliveryResult:
    """``result`` with the session's TLS note on every reply that has none, listing the
    notes of sessions that failed before it in this attempt (``earlier``). A reused
    (cached) session did no STARTTLS now: its note says so, from the plan."""
    note = session.tls_note
    if note is None:
        plan = session.plan
        note = TlsNote(
            policy=plan.label if plan is not None else session.policy.value,
            result="success" if result.tls else "none",
            detail="session reused" if result.tls else "session reused, plaintext",
            tls=result.tls,
            mx=session.host,
            policy_id=plan.policy_id if plan is not None else None,
        )
    if earlier:
        note = note.model_copy(update={"earlier": tuple(earlier)})
    replies = {
        a: r if r.tls else r.model_copy(update={"tls": note}) for a, r in result.replies.items()
    }
    return replace(result, replies=replies)
