"""SMTP TLS reports (RFC 8460), pure: the ``_smtp._tls`` TXT record, the sessions of a
day taken from attempt events (each event's reply carries the
:class:`~jsqueue.replies.TlsNote` of its session and of the sessions that failed before it
in the same attempt), the aggregate JSON report per policy domain (§4.4) and the
``multipart/report`` message that carries it to a ``mailto:`` address (§5.3).
"""

from __future__ import annotations

import gzip
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from email.message import EmailMessage
from email.utils import format_datetime, make_msgid
from typing import Any

from jsqueue.events import Event, EventKind
from jsqueue.replies import TlsNote

__all__ = [
    "RESULT_TYPES",
    "ReportSession",
    "build_report",
    "day_range",
    "parse_rua",
    "report_filename",
    "report_message",
    "sessions_by_domain",
]

#: RFC 8460 §4.3 result types.
RESULT_TYPES = frozenset(
    {
        "starttls-not-supported",
        "certificate-host-mismatch",
        "certificate-expired",
        "certificate-not-trusted",
        "validation-failure",
        "tlsa-invalid",
        "dnssec-invalid",
        "dane-required",
        "sts-policy-fetch-error",
        "sts-policy-invalid",
        "sts-webpki-invalid",
    }
)
_ATTEMPT_KINDS = (EventKind.DELIVERED, EventKind.DEFERRED, EventKind.BOUNCED)
_POLICY_TYPES = {
    "dane": "tlsa",
    "mta-sts enforce": "sts",
    "mta-sts testing": "sts",
    "opportunistic": "no-policy-found",
}
_URI_RE = re.compile(r"(mailto:[^\s,!]+|https://[^\s,]+)")


@dataclass(frozen=True)
class ReportSession:
    """One SMTP session as a report counts it.

    Attributes:
        policy_type: ``sts``, ``tlsa`` or ``no-policy-found`` (RFC 8460 §4.4).
        policy_id: the MTA-STS policy id, if any.
        mx: the receiving MX host name.
        result: ``success`` or an RFC 8460 result type.
        detail: words for ``failure-reason-code``.
    """

    policy_type: str
    policy_id: str | None
    mx: str
    result: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        """The session counts as successful."""
        return self.result == "success"


def _session(note: TlsNote) -> ReportSession | None:
    policy_type = _POLICY_TYPES.get(note.policy)
    if policy_type is None:  # manual: no published policy to report on
        return None
    if note.result in RESULT_TYPES:
        result = note.result
    elif note.tls and note.result in ("success", "none"):
        result = "success"
    else:
        result = "validation-failure"
    return ReportSession(policy_type, note.policy_id, note.mx or "", result, note.detail[:200])


def sessions_by_domain(
    events: Iterable[Event], start: datetime, end: datetime
) -> dict[str, list[ReportSession]]:
    """The sessions of attempts recorded in ``[start, end)``, by policy domain (the
    recipients' domain). An attempt of several recipients is one set of sessions: events
    of the same message, domain and instant count once. Pure."""
    seen: set[tuple[str, str, datetime]] = set()
    found: dict[str, list[ReportSession]] = {}
    for event in events:
        if event.kind not in _ATTEMPT_KINDS or event.domain is None or event.reply is None:
            continue
        note = event.reply.tls
        if note is None or not start <= event.at < end:
            continue
        key = (event.queue_id, event.domain, event.at)
        if key in seen:
            continue
        seen.add(key)
        for each in (*note.earlier, note):
            session = _session(each)
            if session is not None:
                found.setdefault(event.domain, []).append(session)
    return found


def day_range(day: date) -> tuple[datetime, datetime]:
    """``[00:00, next 00:00)`` UTC of ``day`` (RFC 8460 §4.1: 24-hour UTC reports)."""
    start = datetime.combine(day, time(0), tzinfo=UTC)
    return start, start + timedelta(days=1)


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_report(
    domain: str,
    sessions: list[ReportSession],
    day: date,
    *,
    organization: str,
    contact: str,
    policy_strings: dict[tuple[str, str | None], list[str]] | None = None,
    mx_patterns: dict[str | None, list[str]] | None = None,
) -> dict[str, Any]:
    """The RFC 8460 §4.4 report of ``domain`` for ``day``: one ``policies`` item per
    (policy type, policy id) with its success and failure counts and the failures by
    result type and receiving MX. Pure.

    Args:
        domain: the policy domain.
        sessions: its sessions of the day (:func:`sessions_by_domain`).
        day: the UTC day reported.
        organization: ``organization-name``.
        contact: ``contact-info``.
        policy_strings: by (policy type, policy id): the policy's text lines (MTA-STS
            policy lines, TLSA records), when known.
        mx_patterns: by MTA-STS policy id: its ``mx`` patterns.
    """
    start, end = day_range(day)
    groups: dict[tuple[str, str | None], list[ReportSession]] = {}
    for s in sessions:
        groups.setdefault((s.policy_type, s.policy_id), []).append(s)
    policies: list[dict[str, Any]] = []
    for (policy_type, policy_id), items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        policy: dict[str, Any] = {"policy-type": policy_type, "policy-domain": domain}
        strings = (policy_strings or {}).get((policy_type, policy_id))
        if strings:
            policy["policy-string"] = strings
        if policy_type == "sts" and (mx_patterns or {}).get(policy_id):
            policy["mx-host"] = (mx_patterns or {})[policy_id]
        failures: dict[tuple[str, str], list[ReportSession]] = {}
        for s in items:
            if not s.ok:
                failures.setdefault((s.result, s.mx), []).append(s)
        item: dict[str, Any] = {
            "policy": policy,
            "summary": {
                "total-successful-session-count": sum(1 for s in items if s.ok),
                "total-failure-session-count": sum(1 for s in items if not s.ok),
            },
        }
        if failures:
            item["failure-details"] = [
                {
                    "result-type": result,
                    "receiving-mx-hostname": mx,
                    "failed-session-count": len(group),
                    "failure-reason-code": group[-1].detail,
                }
                for (result, mx), group in sorted(failures.items())
            ]
        policies.append(item)
    return {
        "organization-name": organization,
        "date-range": {"start-datetime": _stamp(start), "end-datetime": _stamp(end)},
        "contact-info": contact,
        "report-id": f"{day.isoformat()}.{domain}@{organization}",
        "policies": policies,
    }


def parse_rua(texts: list[str]) -> list[str]:
    """The ``rua`` URIs (``mailto:``, ``https:``) of the ``_smtp._tls`` TXT RRset
    (RFC 8460 §3): exactly one record starting ``v=TLSRPTv1``, else none. Pure."""
    records = [t for t in texts if re.match(r"v=TLSRPTv1[ \t]*(;|$)", t)]
    if len(records) != 1:
        return []
    for part in records[0].split(";"):
        key, eq, value = part.strip().partition("=")
        if key.strip() == "rua" and eq:
            return [m.group(1) for v in value.split(",") if (m := _URI_RE.fullmatch(v.strip()))]
    return []


def report_filename(report: dict[str, Any], organization: str, domain: str) -> str:
    """``<submitter>!<policy-domain>!<begin>!<end>!<id>.json.gz`` (RFC 8460 §5.3)."""
    rng = report["date-range"]
    begin = int(datetime.strptime(rng["start-datetime"], "%Y-%m-%dT%H:%M:%SZ").timestamp())
    end = int(datetime.strptime(rng["end-datetime"], "%Y-%m-%dT%H:%M:%SZ").timestamp())
    unique = re.sub(r"[^A-Za-z0-9]", "", report["report-id"])[:32]
    return f"{organization}!{domain}!{begin}!{end}!{unique}.json.gz"


def report_message(
    report: dict[str, Any], *, domain: str, organization: str, sender: str, to: str
) -> bytes:
    """The RFC 8460 §5.3 message: ``multipart/report; report-type="tlsrpt"`` with a text
    part and the gzipped report (``application/tlsrpt+gzip``), the ``TLS-Report-Domain``
    and ``TLS-Report-Submitter`` fields; CRLF line ends. Pure."""
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = (
        f"Report Domain: {domain} Submitter: {organization} Report-ID: <{report['report-id']}>"
    )
    msg["Date"] = format_datetime(datetime.now(UTC))
    msg["Message-ID"] = make_msgid(domain=sender.rpartition("@")[2] or "localhost")
    msg["TLS-Report-Domain"] = domain
    msg["TLS-Report-Submitter"] = organization
    msg.set_content(
        f"This is an aggregate TLS report (RFC 8460) from {organization} for {domain}.\n"
    )
    data = gzip.compress(json.dumps(report).encode())
    msg.add_attachment(
        data,
        maintype="application",
        subtype="tlsrpt+gzip",
        filename=report_filename(report, organization, domain),
    )
    msg.replace_header("Content-Type", 'multipart/report; report-type="tlsrpt"')
    msg.set_boundary(f"tlsrpt-{uuid.uuid4().hex}")
    return msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))
