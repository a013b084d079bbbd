"""DSNs (jsqueue/dsn/report.py): RFC 3464 content, RFC 3461 NOTIFY/RET, RFC 5321 §4.5.5 loops.

CASE-22 is checked field by field on a parsed message; CASE-19 and CASE-21 cover multi-line
diagnostics and the null / UTF-8 reverse-path.
"""

from __future__ import annotations

import email
import email.policy
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage, Message
from email.utils import parsedate_to_datetime
from typing import Literal
from zoneinfo import ZoneInfo

import pytest

from jsqueue.dsn.report import (
    RETURNED_HEADERS_MAX_OCTETS,
    Action,
    DsnEvent,
    action_for,
    build_dsn,
    header_block,
    recipients_to_report,
    returns_full,
    status_code,
    wants_notice,
)
from jsqueue.envelope import Entry, Notify, Recipient, RecipientState
from jsqueue.replies import R550_NO_SUCH_DOMAIN, Reply

BERLIN = ZoneInfo("Europe/Berlin")
MTA = "relay.jsqueue.example.test"
ACCEPTED = datetime(2026, 3, 2, 9, 0, 5, tzinfo=UTC)
ATTEMPT = datetime(2026, 3, 2, 9, 0, 7, tzinfo=UTC)

CASE22_MESSAGE = (
    b"From: Sender <sender@src.example.test>\r\n"
    b"To: a@ok.example.test, b@rej.example.test, c@nx.example.test\r\n"
    b"Subject: DSN format check\r\n"
    b"Message-ID: <bug22@example.test>\r\n"
    b"Date: Mon, 02 Mar 2026 09:00:00 +0000\r\n"
    b"MIME-Version: 1.0\r\n"
    b"Content-Type: text/plain; charset=us-ascii\r\n"
    b"\r\n"
    b"Please confirm the meeting.\r\n"
)
CASE22_550 = Reply(
    code=550,
    enhanced="5.7.26",
    text=(
        "Unauthenticated mail from src.example.test is refused because\n"
        "of the sending domain's published policy."
    ),
    remote_host="mx.rej.example.test",
)
CASE19_550 = Reply(
    code=550,
    enhanced="5.7.1",
    text=(
        "The message from this sender was refused by local policy.\n"
        "Policy reference PX-4471; see the postmaster page of\n"
        "ml.example.test for the appeal procedure. Automated\n"
        "requests will be ignored.\n"
        "id=7f3a2c"
    ),
    remote_host="mx.ml.example.test",
)

# RFC 5322 §3.3 date-time with a numeric zone (obsolete forms and zone names excluded).
DATE_RE = re.compile(
    r"^(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), )?\d{1,2} "
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} "
    r"\d{2}:\d{2}(?::\d{2})? [+-]\d{4}$"
)
STATUS_RE = re.compile(r"^[245]\.\d{1,3}\.\d{1,3}$")  # RFC 3463 §2


# --------------------------------------------------------------------------- helpers


def recipient(
    address: str,
    state: RecipientState = RecipientState.BOUNCED,
    reply: Reply | None = None,
    *,
    notify: frozenset[Notify] | None = None,
    orcpt: str | None = None,
    attempts: int = 1,
) -> Recipient:
    r = Recipient.from_address(address, orcpt=orcpt, notify=notify)
    return r.model_copy(
        update={
            "state": state,
            "last_reply": reply,
            "attempts": attempts,
            "last_attempt_at": ATTEMPT if attempts else None,
        }
    )


def entry(
    recipients: list[Recipient],
    *,
    reverse_path: str = "sender@src.example.test",
    created_at: datetime = ACCEPTED,
    ret: Literal["FULL", "HDRS"] | None = None,
    size: int | None = None,
    envid: str | None = None,
    is_dsn: bool = False,
) -> Entry:
    return Entry(
        id="01jq0000000000000000000000",
        reverse_path=reverse_path,
        recipients=recipients,
        created_at=created_at,
        size=len(CASE22_MESSAGE) if size is None else size,
        ret=ret,
        envid=envid,
        is_dsn=is_dsn,
    )


def case22_entry(created_at: datetime = ACCEPTED) -> Entry:
    return entry(
        [
            recipient("a@ok.example.test", RecipientState.DELIVERED, None),
            recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550),
            recipient("c@nx.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN),
        ],
        created_at=created_at,
    )


def failure_dsn(e: Entry, original: bytes = CASE22_MESSAGE, **kwargs: object) -> bytes:
    chosen = recipients_to_report(e, DsnEvent.FAILURE)
    return build_dsn(
        e,
        chosen,
        Action.FAILED,
        reporting_mta=MTA,
        now=ATTEMPT,
        original=original,
        **kwargs,  # type: ignore[arg-type]  # optional keyword arguments of build_dsn
    )


def parse(data: bytes) -> EmailMessage:
    msg = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    return msg


def parts(msg: EmailMessage) -> list[EmailMessage]:
    return list(msg.iter_parts())  # type: ignore[arg-type]  # parts of an EmailMessage


def status_groups(msg: EmailMessage) -> list[Message]:
    """The message/delivery-status part as header groups: [per-message, per-recipient...]."""
    (status_part,) = [p for p in parts(msg) if p.get_content_type() == "message/delivery-status"]
    groups = status_part.get_payload()
    assert isinstance(groups, list)
    assert all(isinstance(g, Message) for g in groups)
    return [g for g in groups if isinstance(g, Message)]


def by_recipient(msg: EmailMessage) -> dict[str, Message]:
    return {str(g["Final-Recipient"]): g for g in status_groups(msg)[1:]}


def assert_date(value: object, instant: datetime | None = None) -> None:
    text = str(value)
    assert DATE_RE.match(text), f"not an RFC 5322 date-time with numeric zone: {text!r}"
    if instant is not None:
        assert parsedate_to_datetime(text) == instant


@pytest.fixture
def berlin_local_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process time zone is Europe/Berlin (CASE-22 config), restored afterwards."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    assert time.localtime(ACCEPTED.timestamp()).tm_gmtoff == 3600
    yield
    monkeypatch.undo()
    time.tzset()


# --------------------------------------------------------------------------- CASE-22


def test_case22_is_a_multipart_report(berlin_local_time: None) -> None:
    """RFC 6522 §3 / RFC 3464 §2: multipart/report; report-type=delivery-status with a
    text/plain part, a message/delivery-status part and the returned headers."""
    msg = parse(failure_dsn(case22_entry()))
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "delivery-status"
    assert [p.get_content_type() for p in parts(msg)] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]


def test_case22_top_level_headers(berlin_local_time: None) -> None:
    """RFC 3464 §2, RFC 3461 §6.2, RFC 3834 §5, RFC 5322 §3.6: From a MAILER-DAEMON at the
    reporting MTA, To the reverse-path, Date with numeric zone, unique Message-ID,
    Auto-Submitted, MIME-Version."""
    msg = parse(failure_dsn(case22_entry()))
    from_addr = msg["From"].addresses[0]
    assert from_addr.username.lower() in {"mailer-daemon", "postmaster"}
    assert from_addr.domain == MTA
    assert [a.addr_spec for a in msg["To"].addresses] == ["sender@src.example.test"]
    assert str(msg["Subject"]).strip()
    assert_date(msg["Date"], ATTEMPT)
    assert re.fullmatch(r"<[^<>@\s]+@[^<>@\s]+>", str(msg["Message-ID"]))
    assert str(msg["Auto-Submitted"]) == "auto-replied"
    assert str(msg["MIME-Version"]) == "1.0"


def test_case22_message_ids_are_unique() -> None:
    """RFC 5322 §3.6.4: every DSN gets its own Message-ID."""
    ids = {str(parse(failure_dsn(case22_entry()))["Message-ID"]) for _ in range(20)}
    assert len(ids) == 20


def test_case22_per_message_fields(berlin_local_time: None) -> None:
    """RFC 3464 §2.2: Reporting-MTA (dns; name) and Arrival-Date equal to the acceptance
    instant 09:00:05Z even in Europe/Berlin; no Original-Envelope-Id without ENVID."""
    accepted_local = datetime(2026, 3, 2, 10, 0, 5, tzinfo=BERLIN)
    msg = parse(failure_dsn(case22_entry(created_at=accepted_local)))
    per_message = status_groups(msg)[0]
    assert str(per_message["Reporting-MTA"]) == f"dns; {MTA}"
    assert_date(per_message["Arrival-Date"], ACCEPTED)
    assert per_message["Original-Envelope-Id"] is None
    assert per_message["Final-Recipient"] is None


def test_case22_recipient_blocks_only_for_failed(berlin_local_time: None) -> None:
    """RFC 3464 §2.3 / RFC 3461 §5.2.8: one per-recipient group for b@ and c@, none for the
    delivered a@."""
    data = failure_dsn(case22_entry())
    msg = parse(data)
    groups = by_recipient(msg)
    assert set(groups) == {"rfc822; b@rej.example.test", "rfc822; c@nx.example.test"}
    assert len(status_groups(msg)) == 3
    assert (
        b"a@ok.example.test"
        not in data.split(b"message/delivery-status", 1)[1].split(b"text/rfc822-headers", 1)[0]
    )
    for g in groups.values():
        assert str(g["Action"]) == "failed"
        assert STATUS_RE.match(str(g["Status"]))
        assert_date(g["Last-Attempt-Date"], ATTEMPT)


def test_case22_b_fields(berlin_local_time: None) -> None:
    """RFC 3464 §2.3.4-§2.3.6: b@ has Status 5.7.26, Remote-MTA dns; mx.rej.example.test and
    a Diagnostic-Code (smtp) holding both lines of the 550 reply."""
    b = by_recipient(parse(failure_dsn(case22_entry())))["rfc822; b@rej.example.test"]
    assert str(b["Status"]) == "5.7.26"
    assert str(b["Remote-MTA"]) == "dns; mx.rej.example.test"
    diag = " ".join(str(b["Diagnostic-Code"]).split())
    assert diag.startswith("smtp; 550 5.7.26 ")
    assert "Unauthenticated mail from src.example.test is refused because" in diag
    assert "of the sending domain's published policy." in diag


def test_case22_c_fields() -> None:
    """RFC 3464 §2.3.4/§2.3.6: c@ (NXDOMAIN, no remote MTA) has Status 5.1.2, a synthesised
    Diagnostic-Code and no Remote-MTA."""
    c = by_recipient(parse(failure_dsn(case22_entry())))["rfc822; c@nx.example.test"]
    assert str(c["Status"]) == "5.1.2"
    assert c["Remote-MTA"] is None
    diag_type, _, diag = str(c["Diagnostic-Code"]).partition(";")
    assert diag_type in {"smtp", "X-jsqueue"}
    assert "550 5.1.2" in diag


def test_case22_human_readable_part() -> None:
    """RFC 6522 §3 / RFC 3464 §2: part 1 names b@ and c@ with their reasons and does not list
    a@ as failed."""
    text = parts(parse(failure_dsn(case22_entry())))[0].get_content()
    flat = " ".join(text.split())
    assert "b@rej.example.test" in flat and "c@nx.example.test" in flat
    assert "is refused because of the sending domain's published policy." in flat
    assert "Recipient domain does not exist" in flat
    assert "a@ok.example.test" not in flat


@pytest.mark.parametrize(
    ("sent", "recorded"),
    [
        ("552 5.2.2 mailbox full", Reply(code=452, enhanced="4.2.2", text="mailbox full")),
        ("552 quota exceeded", Reply(code=452, text="quota exceeded")),
        (
            "552 5.5.3 Too many recipients",
            Reply(code=452, enhanced="4.5.3", text="Too many recipients"),
        ),
    ],
)
def test_a_552_taken_as_temporary_is_reported_as_the_server_sent_it(
    sent: str, recorded: Reply
) -> None:
    """RFC 3464 §2.3.6: the Diagnostic-Code of type smtp is the reply the remote MTA
    issued, here the 552 to RCPT jsqueue recorded as 452 (RFC 5321 §4.5.3.1.10) and
    reported when the message expired; why it was retried is said in the human-readable
    part, not mixed into the diagnostic."""
    codes = " ".join(sent.split()[:2]) if sent.split()[1][0].isdigit() else "552"
    reply = recorded.model_copy(update={"remote_host": "mx.full.example.test", "sent": codes})
    r = recipient("a@full.example.test", RecipientState.DEFERRED, reply, attempts=3)
    e = entry([r])
    data = build_dsn(e, [r], Action.FAILED, reporting_mta=MTA, now=ATTEMPT, original=CASE22_MESSAGE)
    msg = parse(data)
    block = by_recipient(msg)["rfc822; a@full.example.test"]
    assert block["Diagnostic-Code"] == f"smtp; {sent}"
    assert block["Status"] == "4.4.7"
    flat = " ".join(parts(msg)[0].get_content().split())
    assert f"its {codes} to RCPT was taken as temporary: RFC 5321 section 4.5.3.1.10" in flat


def test_case22_original_headers_returned() -> None:
    """RFC 3462 / RFC 6522 §3 (RET default = headers): part 3 holds the original header
    section, not the body."""
    returned = parts(parse(failure_dsn(case22_entry())))[2]
    content = returned.get_payload(decode=True)
    assert isinstance(content, bytes)
    assert b"Subject: DSN format check\r\n" in content
    assert b"Message-ID: <bug22@example.test>\r\n" in content
    assert b"Please confirm the meeting." not in content


def test_case22_wire_format(berlin_local_time: None) -> None:
    """RFC 5322 §2.1/§2.1.1, RFC 3464 §2.1.1: CRLF only, lines <= 998 octets, 7-bit ASCII for
    an ASCII sender, every date field with a numeric zone (no zone names)."""
    data = failure_dsn(case22_entry())
    assert data.count(b"\n") == data.count(b"\r\n")
    assert data.count(b"\r") == data.count(b"\r\n")
    assert all(len(line) <= 998 for line in data.split(b"\r\n"))
    assert data.isascii()
    for name in (b"Date", b"Arrival-Date", b"Last-Attempt-Date"):
        values = re.findall(rb"^" + name + rb": (.*)\r$", data, re.M)
        assert values, name
        for value in values:
            assert_date(value.decode())
    assert not re.search(rb"\b(?:GMT|UTC|CET|CEST|PST|PDT)\b", data)


# --------------------------------------------------------------------------- CASE-19


def test_case19_five_line_diagnostic_kept() -> None:
    """CASE-19, RFC 3464 §2.3.6, RFC 5321 §4.2.1: all five lines of a multi-line 550 are in
    the Diagnostic-Code; Status 5.7.1; folded lines stay within 78 columns where possible."""
    e = entry([recipient("blocked@ml.example.test", RecipientState.BOUNCED, CASE19_550)])
    data = failure_dsn(e)
    (g,) = status_groups(parse(data))[1:]
    assert str(g["Status"]) == "5.7.1"
    diag = " ".join(str(g["Diagnostic-Code"]).split())
    for line in CASE19_550.text.split("\n"):
        assert line in diag
    assert "PX-4471" in diag and "id=7f3a2c" in diag
    raw = data.split(b"Diagnostic-Code:", 1)[1].split(b"\r\nLast-Attempt-Date", 1)[0]
    assert raw.count(b"\r\n ") >= 4
    assert all(len(line) <= 78 for line in raw.split(b"\r\n"))


def test_overlong_reply_stays_within_line_limit() -> None:
    """RFC 5322 §2.1.1: a reply with a 3000-character word still gives lines <= 998 octets."""
    reply = Reply(code=550, enhanced="5.0.0", text="x" * 3000, remote_host="mx.example.test")
    data = failure_dsn(entry([recipient("z@example.test", RecipientState.BOUNCED, reply)]))
    assert all(len(line) <= 998 for line in data.split(b"\r\n"))
    assert data.count(b"x") >= 3000


def test_reply_text_cannot_inject_fields() -> None:
    """RFC 3464 §2.1.1: remote text with CR/LF cannot add fields to the DSN."""
    evil = Reply(
        code=550,
        enhanced="5.1.1",
        text="no such user\r\nAction: delivered\r\nBcc: victim@example.test",
        remote_host="mx.example.test\r\nX-Evil: 1",
    )
    data = failure_dsn(entry([recipient("z@example.test", RecipientState.BOUNCED, evil)]))
    assert not re.search(rb"^(?:Bcc|X-Evil):", data, re.M)
    assert re.findall(rb"^Action: (\w+)", data, re.M) == [b"failed"]


# --------------------------------------------------------------------------- CASE-21


@pytest.mark.parametrize("event", list(DsnEvent))
def test_case21_no_dsn_for_null_reverse_path(event: DsnEvent) -> None:
    """CASE-21 A/B, RFC 5321 §4.5.5, RFC 3461 §6.1: mail from <> (and every DSN) never gets a
    DSN, whatever happened to it."""
    recipients = [
        recipient("nobody@nx.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN),
        recipient("late@nx.example.test", RecipientState.DEFERRED, None),
        recipient("ok@nx.example.test", RecipientState.DELIVERED, None, notify=frozenset(Notify)),
    ]
    for e in (
        entry(recipients, reverse_path=""),
        entry(recipients, reverse_path="", is_dsn=True),
        entry(recipients, reverse_path="postmaster@src.example.test", is_dsn=True),
    ):
        assert (
            recipients_to_report(
                e, event, now=ACCEPTED + timedelta(days=3), delay_warning_after_s=60
            )
            == []
        )
    with pytest.raises(ValueError):
        build_dsn(
            entry(recipients, reverse_path=""),
            recipients,
            action_for(event),
            reporting_mta=MTA,
            now=ATTEMPT,
            original=CASE22_MESSAGE,
        )


def test_case21_utf8_reverse_path() -> None:
    """CASE-21 C, RFC 6531 §3.2, RFC 6532 §3.2: a UTF-8 reverse-path is used as is, with no
    address conversion and no error; only the To: field carries UTF-8."""
    e = entry(
        [recipient("gone@nomail.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN)],
        reverse_path="jörg@src.example.test",
    )
    data = failure_dsn(e)
    assert "To: <jörg@src.example.test>\r\n".encode() in data
    non_ascii = [line for line in data.split(b"\r\n") if not line.isascii()]
    assert non_ascii == ["To: <jörg@src.example.test>".encode()]
    msg = parse(data)
    assert msg.get_content_type() == "multipart/report"
    assert set(by_recipient(msg)) == {"rfc822; gone@nomail.example.test"}
    text = parts(msg)[0].get_content()
    assert "jörg@src.example.test" in text


def test_utf8_recipient_uses_utf8_address_type() -> None:
    """RFC 6533 §3: a non-ASCII recipient is reported as utf-8; utf-8-addr-xtext, keeping the
    message/delivery-status part ASCII."""
    e = entry([recipient("jörg@nx.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN)])
    data = failure_dsn(e)
    assert data.isascii()
    (final,) = by_recipient(parse(data))
    assert final == "utf-8; j\\x{F6}rg@nx.example.test"
    text = parts(parse(data))[0].get_content()
    assert "jörg@nx.example.test" in text


def test_8bit_original_headers_returned_unchanged() -> None:
    """RFC 6532 §3, RFC 6533 §6.3: UTF-8 header bytes are cut out and returned without any
    conversion error, base64-wrapped so the DSN stays 7-bit."""
    original = (
        "From: Jörg <jörg@src.example.test>\r\nSubject: Grüße\r\n\r\nKörper\r\n".encode()
        + b"\xff\xfe invalid utf-8\r\n"
    )
    head = header_block(original)
    assert head == "From: Jörg <jörg@src.example.test>\r\nSubject: Grüße\r\n".encode()
    e = entry([recipient("z@nx.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN)])
    data = failure_dsn(e, original=original)
    assert data.isascii()
    returned = parts(parse(data))[2]
    assert returned.get_content_type() == "text/rfc822-headers"
    assert returned.get_content_charset() == "utf-8"
    assert returned.get_payload(decode=True) == head


# --------------------------------------------------------------------------- RET


def test_ret_full_within_limit_returns_message() -> None:
    """RFC 3461 §4.3, RFC 3464 §2: RET=FULL within the size limit returns message/rfc822 with
    headers and body."""
    e = entry(
        [recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)],
        ret="FULL",
    )
    assert returns_full(e, 1000)
    returned = parts(parse(failure_dsn(e, max_returned_size=1000)))[2]
    assert returned.get_content_type() == "message/rfc822"
    payload = returned.get_payload()
    assert isinstance(payload, list) and len(payload) == 1
    inner = payload[0]
    assert isinstance(inner, EmailMessage)
    assert str(inner["Subject"]) == "DSN format check"
    assert "Please confirm the meeting." in inner.get_content()


def test_ret_full_over_limit_returns_headers() -> None:
    """RFC 3461 §4.3 (an MTA may truncate): RET=FULL above max_returned_size returns only the
    headers."""
    e = entry([recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)], ret="FULL")
    limit = len(CASE22_MESSAGE) - 1
    assert not returns_full(e, limit)
    returned = parts(parse(failure_dsn(e, max_returned_size=limit)))[2]
    assert returned.get_content_type() == "text/rfc822-headers"
    content = returned.get_payload(decode=True)
    assert isinstance(content, bytes)
    assert b"Subject: DSN format check" in content
    assert b"Please confirm" not in content


@pytest.mark.parametrize("ret", ["HDRS", None])
def test_ret_hdrs_or_default_returns_headers(ret: Literal["HDRS"] | None) -> None:
    """RFC 3461 §4.3: RET=HDRS, and no RET (our default), return the headers only, even when
    the caller passes the whole message."""
    e = entry([recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)], ret=ret)
    assert not returns_full(e, 10**9)
    returned = parts(parse(failure_dsn(e)))[2]
    assert returned.get_content_type() == "text/rfc822-headers"
    content = returned.get_payload(decode=True)
    assert isinstance(content, bytes)
    assert b"Please confirm" not in content


def test_ret_hdrs_without_the_empty_line_returns_no_body_text() -> None:
    """RFC 3461 §4.3, RFC 5322 §2.2: a message whose body text follows its fields without
    the empty line (or that has no header at all) is returned as the fields alone; the
    text/rfc822-headers part (RFC 6522 §4) never carries the body."""
    e = entry([recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)], ret="HDRS")
    original = b"From: a@src.example.test\r\nSubject: x\r\nsecret body text\r\nmore: of it\r\n"
    returned = parts(parse(failure_dsn(e, original=original)))[2]
    assert returned.get_content_type() == "text/rfc822-headers"
    assert returned.get_payload(decode=True) == b"From: a@src.example.test\r\nSubject: x\r\n"
    headless = failure_dsn(e, original=b"just text, no header\r\nsecret: body\r\n")
    assert b"secret" not in headless and parts(parse(headless))[2].get_payload() == ""


def test_a_huge_header_section_is_returned_cut_at_a_field_boundary() -> None:
    """RFC 3461 §4.3 leaves the amount returned to the MTA: headers only, a header section
    of 4.5 MB (5 000 fields of 900 octets) comes back as its first fields up to
    RETURNED_HEADERS_MAX_OCTETS, each whole with its continuation line (RFC 5322 §2.2.3),
    so the DSN stays small enough to reach the sender (it used to return every field)."""
    e = entry([recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)], ret="HDRS")
    fields = [b"X-F%04d: " % i + b"v" * 880 + b"\r\n\tmore\r\n" for i in range(5000)]
    original = b"From: a@src.example.test\r\n" + b"".join(fields) + b"\r\nbody\r\n"
    data = failure_dsn(e, original=original)
    returned = parts(parse(data))[2].get_payload(decode=True)
    assert len(data) < 2 * RETURNED_HEADERS_MAX_OCTETS
    assert RETURNED_HEADERS_MAX_OCTETS - 1000 < len(returned) <= RETURNED_HEADERS_MAX_OCTETS
    assert returned.startswith(b"From: a@src.example.test\r\nX-F0000: ")
    assert returned.endswith(b"\r\n\tmore\r\n")  # a whole field, not a cut one
    small = b"From: a@src.example.test\r\nSubject: x\r\n\r\nbody\r\n"
    assert parts(parse(failure_dsn(e, original=small)))[2].get_payload(decode=True) == (
        b"From: a@src.example.test\r\nSubject: x\r\n"
    )


def test_ret_full_8bit_body_returned_exactly() -> None:
    """RFC 2046 §5.2.1, RFC 6152: an 8-bit original under RET=FULL comes back byte for byte in
    message/rfc822 with Content-Transfer-Encoding 8bit (the DSN is then 8-bit)."""
    original = CASE22_MESSAGE.replace(b"Please confirm", "Bitte bestätigen".encode())
    e = entry(
        [recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)],
        ret="FULL",
        size=len(original),
    )
    data = failure_dsn(e, original=original)
    assert original in data
    assert not data.isascii()
    returned = parts(parse(data))[2]
    assert returned.get_content_type() == "message/rfc822"
    assert str(returned["Content-Transfer-Encoding"]) == "8bit"
    non_ascii = [line for line in data.split(b"\r\n") if not line.isascii()]
    assert non_ascii == ["Bitte bestätigen the meeting.".encode()]


def test_ret_full_utf8_headers_use_message_global() -> None:
    """RFC 6532 §3.7: a full original with UTF-8 headers is returned as message/global."""
    original = "Subject: Grüße\r\nFrom: jörg@src.example.test\r\n\r\nHallo\r\n".encode()
    e = entry(
        [recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)],
        ret="FULL",
        size=len(original),
    )
    data = failure_dsn(e, original=original)
    assert original in data
    assert b"Content-Type: message/global\r\n" in data


def test_empty_original_omits_third_part() -> None:
    """RFC 6522 §3: the returned-content part is optional."""
    e = entry([recipient("b@rej.example.test", RecipientState.BOUNCED, CASE22_550)])
    assert len(parts(parse(failure_dsn(e, original=b"")))) == 2


# --------------------------------------------------------------------------- NOTIFY / selection

N = Notify
NOTIFY_CASES: list[tuple[frozenset[Notify] | None, set[DsnEvent]]] = [
    (None, {DsnEvent.FAILURE, DsnEvent.DELAY}),
    (frozenset({N.NEVER}), set()),
    (frozenset({N.NEVER, N.FAILURE}), set()),  # invalid mix: NEVER wins
    (frozenset({N.FAILURE}), {DsnEvent.FAILURE}),
    (frozenset({N.SUCCESS}), {DsnEvent.SUCCESS}),
    (frozenset({N.DELAY}), {DsnEvent.DELAY}),
    (frozenset({N.SUCCESS, N.FAILURE}), {DsnEvent.SUCCESS, DsnEvent.FAILURE}),
    (frozenset({N.SUCCESS, N.FAILURE, N.DELAY}), set(DsnEvent)),
]
STATE_FOR = {
    DsnEvent.FAILURE: RecipientState.BOUNCED,
    DsnEvent.DELAY: RecipientState.DEFERRED,
    DsnEvent.SUCCESS: RecipientState.DELIVERED,
}


@pytest.mark.parametrize(("notify", "wanted"), NOTIFY_CASES)
@pytest.mark.parametrize("event", list(DsnEvent))
def test_notify_combinations(
    notify: frozenset[Notify] | None, wanted: set[DsnEvent], event: DsnEvent
) -> None:
    """RFC 3461 §4.1: NEVER suppresses, FAILURE/DELAY/SUCCESS select the event, no NOTIFY
    means FAILURE,DELAY (DELAY at the MTA's discretion)."""
    r = recipient("x@ex.example.test", STATE_FOR[event], None, notify=notify)
    e = entry([r])
    assert wants_notice(r, event) is (event in wanted)
    chosen = recipients_to_report(
        e, event, now=ACCEPTED + timedelta(hours=5), delay_warning_after_s=3600
    )
    assert [c.address for c in chosen] == (["x@ex.example.test"] if event in wanted else [])


def test_one_failure_dsn_names_exactly_the_bounced() -> None:
    """RFC 3461 §5.2.8, RFC 3464 §2.3: 1 delivered, 1 deferred, 2 bounced give one failure DSN
    listing exactly the 2 bounced recipients."""
    e = entry(
        [
            recipient("ok@a.example.test", RecipientState.DELIVERED, None),
            recipient("later@b.example.test", RecipientState.DEFERRED, None),
            recipient("x@c.example.test", RecipientState.BOUNCED, CASE22_550),
            recipient("y@d.example.test", RecipientState.BOUNCED, R550_NO_SUCH_DOMAIN),
        ]
    )
    chosen = recipients_to_report(e, DsnEvent.FAILURE)
    assert [r.address for r in chosen] == ["x@c.example.test", "y@d.example.test"]
    msg = parse(failure_dsn(e))
    assert set(by_recipient(msg)) == {"rfc822; x@c.example.test", "rfc822; y@d.example.test"}
    assert len(status_groups(msg)) == 3


def test_never_twice_and_failed_state_owes_no_dsn() -> None:
    """RFC 3461 §5.2.8 (one DSN per event): dsn_sent recipients are not reported again; state
    failed means no DSN is owed."""
    sent = recipient("x@c.example.test", RecipientState.BOUNCED, CASE22_550)
    sent = sent.model_copy(update={"dsn_sent": True})
    e = entry([sent, recipient("y@c.example.test", RecipientState.FAILED, CASE22_550)])
    assert recipients_to_report(e, DsnEvent.FAILURE) == []


def test_delay_warning_timing() -> None:
    """RFC 3461 §4.1 DELAY, RFC 3464 §2.3.3: delay warnings only when enabled, after the
    configured age, and not again within the interval."""
    r = recipient("slow@c.example.test", RecipientState.DEFERRED, None)
    e = entry([r])
    hour = timedelta(hours=1)
    assert recipients_to_report(e, DsnEvent.DELAY, now=ACCEPTED + 10 * hour) == []
    assert (
        recipients_to_report(e, DsnEvent.DELAY, now=ACCEPTED + hour, delay_warning_after_s=4 * 3600)
        == []
    )
    assert recipients_to_report(
        e, DsnEvent.DELAY, now=ACCEPTED + 5 * hour, delay_warning_after_s=4 * 3600
    ) == [r]
    warned = e.model_copy(
        update={"recipients": [r.model_copy(update={"delay_notified_at": ACCEPTED + 5 * hour})]}
    )

    def again(now: datetime) -> list[Recipient]:
        return recipients_to_report(
            warned,
            DsnEvent.DELAY,
            now=now,
            delay_warning_after_s=4 * 3600,
            delay_warning_interval_s=86400.0,
        )

    assert again(ACCEPTED + 6 * hour) == []
    assert len(again(ACCEPTED + 30 * hour)) == 1
    with pytest.raises(ValueError):
        recipients_to_report(e, DsnEvent.DELAY, delay_warning_after_s=60)


def test_delay_dsn_fields() -> None:
    """RFC 3464 §2.3.3/§2.3.4/§2.3.9: a delay DSN says delayed, a 4.x.x Status and
    Will-Retry-Until with a numeric zone."""
    reply = Reply(code=451, enhanced="4.3.0", text="try later", remote_host="mx.tz.example.test")
    e = entry([recipient("user@tz.example.test", RecipientState.DEFERRED, reply)])
    until = ACCEPTED + timedelta(days=5)
    chosen = recipients_to_report(
        e, DsnEvent.DELAY, now=ACCEPTED + timedelta(hours=5), delay_warning_after_s=3600
    )
    data = build_dsn(
        e,
        chosen,
        action_for(DsnEvent.DELAY),
        reporting_mta=MTA,
        now=ACCEPTED + timedelta(hours=5),
        original=CASE22_MESSAGE,
        will_retry_until=until.astimezone(BERLIN),
    )
    (g,) = status_groups(parse(data))[1:]
    assert str(g["Action"]) == "delayed"
    assert str(g["Status"]) == "4.3.0"
    assert_date(g["Will-Retry-Until"], until)


def test_success_dsn_relayed_and_not_when_next_hop_reports() -> None:
    """RFC 3461 §5.2.1/§5.2.2, §6.2.1: NOTIFY=SUCCESS gives a relayed DSN (2.x.x) when the
    next hop had no DSN support, none for a recipient whose next hop took NOTIFY over
    (``next_hop_dsn``), decided per recipient."""
    ok = Reply(code=250, enhanced="2.0.0", text="ok", remote_host="mx.ok.example.test")
    success = frozenset({N.SUCCESS})
    e = entry(
        [
            recipient("a@ok.example.test", RecipientState.DELIVERED, ok, notify=success),
            recipient("b@ok.example.test", RecipientState.DELIVERED, ok),
            recipient("c@ok.example.test", RecipientState.DELIVERED, ok, notify=success),
        ]
    )
    e.recipients[2].next_hop_dsn = True
    chosen = recipients_to_report(e, DsnEvent.SUCCESS)
    assert [r.address for r in chosen] == ["a@ok.example.test"]
    e.recipients[0].next_hop_dsn = True
    assert recipients_to_report(e, DsnEvent.SUCCESS) == []
    assert action_for(DsnEvent.SUCCESS) is Action.RELAYED
    data = build_dsn(
        e, chosen, Action.RELAYED, reporting_mta=MTA, now=ATTEMPT, original=CASE22_MESSAGE
    )
    (g,) = status_groups(parse(data))[1:]
    assert str(g["Action"]) == "relayed"
    assert str(g["Status"]).startswith("2.")


# --------------------------------------------------------------------------- status / expiry


def test_expiry_reports_4_4_7_with_last_remote_reply() -> None:
    """RFC 3463 §3.5 (X.4.7), RFC 5321 §4.5.4.1: an expired recipient is failed with Status
    4.4.7 and the last remote reply as Diagnostic-Code."""
    last = Reply(code=451, enhanced="4.3.0", text="try later", remote_host="mx.tz.example.test")
    e = entry([recipient("user@tz.example.test", RecipientState.BOUNCED, last, attempts=6)])
    msg = parse(failure_dsn(e))
    (g,) = status_groups(msg)[1:]
    assert str(g["Action"]) == "failed"
    assert str(g["Status"]) == "4.4.7"
    assert str(g["Diagnostic-Code"]) == "smtp; 451 4.3.0 try later"
    assert str(g["Remote-MTA"]) == "dns; mx.tz.example.test"
    assert "expired" in parts(msg)[0].get_content()


def test_expiry_after_tls_policy_failure_reports_5_7_x() -> None:
    """CASE-20 E2 (RFC 3463 §3.8): a recipient that expired while its TLS policy could not
    be met (last reply 4.7.5) gets one failure DSN with Status 5.7.5 and a diagnostic
    naming the TLS failure."""
    last = Reply(
        code=451,
        enhanced="4.7.5",
        text="TLS required by policy but could not be established (mx.strict.example.test "
        "[127.0.2.161]: MTA-STS policy 20260301T000000; TLS handshake failed)",
    )
    e = entry([recipient("user@strict.example.test", RecipientState.BOUNCED, last, attempts=9)])
    (g,) = status_groups(parse(failure_dsn(e)))[1:]
    assert (str(g["Action"]), str(g["Status"])) == ("failed", "5.7.5")
    assert "TLS handshake failed" in str(g["Diagnostic-Code"])


@pytest.mark.parametrize(
    ("reply", "action", "expected"),
    [
        (Reply(code=550, enhanced="5.1.1", text="no"), Action.FAILED, "5.1.1"),
        (Reply(code=550, text="no enhanced code"), Action.FAILED, "5.0.0"),
        (Reply(code=550, enhanced="4.1.1", text="class mismatch"), Action.FAILED, "5.0.0"),
        (Reply(code=554, enhanced="5.x.1", text="malformed"), Action.FAILED, "5.0.0"),
        (Reply(code=421, text="busy"), Action.FAILED, "4.4.7"),
        (Reply(code=451, enhanced="4.7.5", text="TLS required"), Action.FAILED, "5.7.5"),
        (Reply(code=451, enhanced="4.7.8", text="relay auth failed"), Action.FAILED, "5.7.8"),
        # a server's 4.7.x (greylisting, rate limits) is no refusal (RFC 3463 §3.5, §3.8)
        (
            Reply(code=451, enhanced="4.7.1", text="greylisted", remote_host="mx"),
            Action.FAILED,
            "4.4.7",
        ),
        (
            Reply(code=421, enhanced="4.7.0", text="slow down", remote_host="mx"),
            Action.FAILED,
            "4.4.7",
        ),
        (None, Action.FAILED, "4.4.7"),
        (Reply(code=421, text="busy"), Action.DELAYED, "4.0.0"),
        (None, Action.DELAYED, "4.0.0"),
        (Reply(code=250, text="ok"), Action.RELAYED, "2.0.0"),
    ],
)
def test_status_code_synthesis(reply: Reply | None, action: Action, expected: str) -> None:
    """RFC 3464 §2.3.4, RFC 3463 §2: the enhanced code when it agrees with the basic code's
    class, else synthesised from the class; expired failures are 4.4.7, or 5.7.x after
    this queue's own policy deferral (4.7.x, no remote host)."""
    r = recipient("x@ex.example.test", RecipientState.BOUNCED, reply)
    assert status_code(r, action) == expected


def test_orcpt_and_envid_are_reported() -> None:
    """RFC 3464 §2.2.1/§2.3.1, RFC 3461 §4.2/§4.4: ENVID and ORCPT (stored decoded) come back
    unchanged as Original-Envelope-Id and Original-Recipient, never decoded twice; a UTF-8
    ORCPT uses the utf-8 address type (RFC 6533 §3)."""
    r = recipient(
        "b@rej.example.test",
        RecipientState.BOUNCED,
        CASE22_550,
        orcpt="rfc822;B+2Btag@Rej.example.test",
    )
    u = recipient(
        "u@rej.example.test",
        RecipientState.BOUNCED,
        CASE22_550,
        orcpt="utf-8;jörg@rej.example.test",
    )
    a = recipient(  # an ASCII utf-8 ORCPT: the same encoding (a \\ is \\x{5C} there)
        "a@rej.example.test",
        RecipientState.BOUNCED,
        CASE22_550,
        orcpt="utf-8;a\\b+c@rej.example.test",
    )
    e = entry([r, u, a], envid="QQ+2B314")
    data = failure_dsn(e)
    assert data.isascii()
    groups = status_groups(parse(data))
    assert str(groups[0]["Original-Envelope-Id"]) == "QQ+2B314"
    assert str(groups[1]["Original-Recipient"]) == "rfc822; B+2Btag@Rej.example.test"
    assert str(groups[1]["Final-Recipient"]) == "rfc822; b@rej.example.test"
    assert str(groups[2]["Original-Recipient"]) == "utf-8; j\\x{F6}rg@rej.example.test"
    assert str(groups[3]["Original-Recipient"]) == "utf-8; a\\x{5C}b\\x{2B}c@rej.example.test"


def test_build_rejects_bad_input() -> None:
    """build_dsn contract: no recipients, naive dates and a bad MTA name raise ValueError."""
    e = case22_entry()
    chosen = recipients_to_report(e, DsnEvent.FAILURE)
    ok = {"reporting_mta": MTA, "now": ATTEMPT, "original": CASE22_MESSAGE}
    with pytest.raises(ValueError):
        build_dsn(e, [], Action.FAILED, **ok)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        build_dsn(
            e, chosen, Action.FAILED, reporting_mta=MTA, now=datetime(2026, 3, 2), original=b""
        )
    with pytest.raises(ValueError):
        build_dsn(e, chosen, Action.FAILED, reporting_mta="bad name\r\n", now=ATTEMPT, original=b"")


# --------------------------------------------------------------------------- header_block


@pytest.mark.parametrize(
    ("data", "complete", "expected"),
    [
        (b"A: 1\r\nB: 2\r\n\r\nbody\r\n", False, b"A: 1\r\nB: 2\r\n"),
        (b"A: 1\r\nB: 2\r\n", False, None),  # header section not finished yet: read more
        (b"A: 1\r\nB: 2\r\n", True, b"A: 1\r\nB: 2\r\n"),  # whole message is header
        (b"A: 1\nB: 2\n\nbody\n", False, b"A: 1\r\nB: 2\r\n"),  # bare LF normalised
        (b"\r\nbody only\r\n", False, b""),
        (b"A: 1\r\n folded\r\n\r\n", False, b"A: 1\r\n folded\r\n"),
        (b"S: \xc3\xa4\xff\r\n\r\nx", False, b"S: \xc3\xa4\xff\r\n"),  # 8-bit untouched
        # RFC 5322 §2.2: a line that is neither a field nor a continuation ends the section
        (b"A: 1\r\nbody text\r\nmore\r\n", True, b"A: 1\r\n"),  # no empty line
        (b"A: 1\r\nbody text\r\nmore", False, b"A: 1\r\n"),  # decided before the end
        (b"A: 1\r\nbody", True, b"A: 1\r\n"),
        (b"body first\r\nA: 1\r\n\r\n", True, b""),
        (b" folded first\r\nA: 1\r\n\r\n", False, b""),
        (b"A: 1\r\nB : obsolete\r\n\r\nx", False, b"A: 1\r\nB : obsolete\r\n"),  # §4.5
    ],
)
def test_header_block(data: bytes, complete: bool, expected: bytes | None) -> None:
    """RFC 5322 §2.1: the header section ends at the first empty line; 8-bit bytes pass
    through (RFC 6532 §3)."""
    assert header_block(data, complete=complete) == expected


def test_header_block_from_chunks() -> None:
    """RFC 5322 §2.1: the caller can feed growing prefixes of a streamed body."""
    chunks = [CASE22_MESSAGE[i : i + 16] for i in range(0, len(CASE22_MESSAGE), 16)]
    seen = b""
    result = None
    for chunk in chunks:
        seen += chunk
        result = header_block(seen)
        if result is not None:
            break
    assert result == CASE22_MESSAGE.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    assert len(seen) < len(CASE22_MESSAGE)
