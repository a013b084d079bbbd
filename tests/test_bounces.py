"""Bounces end to end (RFC 3464 DSNs, RFC 3461 parameters, delay warnings, expiry):
mail through the real front end, real workers, a real nats-server, scripted MXes."""

from __future__ import annotations

import base64
import email.utils
import re
from datetime import UTC, datetime, timedelta

from test_worker import SENDER_ZONE, dsn_parts, gone, one_mx

from jsqueue.admin import Admin
from jsqueue.envelope import RecipientState
from jsqueue.views import Outcome
from support.cases import case_message, case_text
from support.frontend import split_body
from support.mx import ScriptedMx, Session, SmtpdMx
from support.queue import Harness, eventually

SRC_ZONE = """
src.example.test.     300 IN MX 10 mx.src.example.test.
mx.src.example.test.  300 IN A  127.0.2.170
"""
# RFC 5322 §3.3 date-time with a numeric zone
DATE_RE = re.compile(
    r"^(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), )?\d{1,2} "
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} "
    r"\d{2}:\d{2}(?::\d{2})? [+-]\d{4}$"
)


async def test_null_reverse_path_never_gets_a_dsn_case21a(queue_harness: Harness) -> None:
    """CASE-21 A / RFC 5321 §4.5.5: a bounce (MAIL FROM:<>) to an NXDOMAIN recipient fails
    for good, no DSN is generated or sent anywhere, and nothing is left in the queue."""
    h = queue_harness
    h.dns.add(case_text("CASE-21", "dns.txt"))
    async with SmtpdMx("127.0.2.170", h.mx_port) as src:
        qid = await h.submit(
            case_message("CASE-21", "bounce-in.eml"), ["nobody@nx.example.test"], sender=""
        )
        worker = h.worker()
        async with h.running(worker):
            await eventually(lambda: worker.notifier.dropped == 1, what="dropped")  # type: ignore[attr-defined]
        assert src.connections == 0, "nothing sent anywhere"
    assert await h.entry(qid) is None or (await h.entry(qid)).is_final  # type: ignore[union-attr]
    page = await h.stores.entries.page(limit=10)
    assert all(v.entry.id == qid for v in page), "no DSN entry was created"


async def test_refused_dsn_is_dropped_case21b(queue_harness: Harness) -> None:
    """CASE-21 B/C: a DSN the sender's MX refuses (501 to MAIL FROM:<>) is dropped after
    its permanent failure, with no DSN about the DSN; exactly one message was created by
    jsqueue; the null path is sent as exactly <> (also for a UTF-8 original sender)."""
    h = queue_harness
    h.dns.add(case_text("CASE-21", "dns.txt"))
    async with SmtpdMx(
        "127.0.2.170", h.mx_port, smtputf8=True, mail_reply="501 5.1.7 bad sender address"
    ) as src:
        plain = await h.submit(
            case_message("CASE-21"), ["gone@nomail.example.test"], sender="sender@src.example.test"
        )
        utf8 = await h.submit(
            case_message("CASE-21"),
            ["gone@nomail.example.test"],
            sender="jörg@src.example.test",
            mail_options=["SMTPUTF8"],
        )
        worker = h.worker()
        async with h.running(worker):
            await eventually(lambda: worker.notifier.dropped == 2, what="both DSNs dropped")  # type: ignore[attr-defined]
            await eventually(lambda: gone(h, plain), what="original removed")
            await eventually(lambda: gone(h, utf8), what="original removed")
        mails = [c for s in src.sessions for c in s.commands if c.upper().startswith("MAIL")]
        assert len(mails) == 2, "one DSN per original, no DSN about a DSN"
        assert all(re.match(r"MAIL FROM:<> ?", m) for m in mails), mails
    left = [v.entry for v in await h.stores.entries.page(limit=10)]
    assert len(left) == 2 and all(e.is_dsn and e.is_final for e in left)
    assert all(r.state is RecipientState.FAILED for e in left for r in e.recipients)


async def test_dsn_content_case22(queue_harness: Harness) -> None:
    """CASE-22 / RFC 3464 §2.2-2.3, RFC 6522: one DSN from <> to the sender lists b@ (5.7.26,
    Remote-MTA, both lines of the 550) and c@ (NXDOMAIN), not a@ (delivered); dates carry
    numeric zones; Arrival-Date is the acceptance instant; the original headers return."""
    h = queue_harness
    h.dns.add(case_text("CASE-22", "dns.txt"))
    policy = (
        "550-5.7.26 Unauthenticated mail from src.example.test is refused because\n"
        "550 5.7.26 of the sending domain's published policy."
    )
    async with (
        SmtpdMx("127.0.2.180", h.mx_port) as ok,
        SmtpdMx("127.0.2.181", h.mx_port, name="mx.rej.example.test", data_reply=policy),
        SmtpdMx("127.0.2.182", h.mx_port) as src,
    ):
        before = datetime.now(UTC).replace(microsecond=0)
        qid = await h.submit(
            case_message("CASE-22"),
            ["a@ok.example.test", "b@rej.example.test", "c@nx.example.test"],
            sender="sender@src.example.test",
        )
        async with h.running():
            await eventually(lambda: len(src.delivered) == 1, what="the DSN")
            await eventually(lambda: gone(h, qid), what="original removed")
        after = datetime.now(UTC)
    assert len(ok.delivered) == 1
    tx = src.delivered[0]
    assert (tx.mail_from, tx.rcpt_to) == ("", ["sender@src.example.test"])
    msg, groups = dsn_parts(tx.content or b"")
    assert msg["To"] == "sender@src.example.test"
    assert "relay.jsqueue.example.test" in msg["From"]
    assert msg["Auto-Submitted"] == "auto-replied"
    assert msg["Message-ID"]
    for value in (msg["Date"],):
        assert DATE_RE.match(str(value)), value
    status = next(p for p in msg.walk() if p.get_content_type() == "message/delivery-status")
    per_message = status.get_payload()[0]  # type: ignore[index]
    assert per_message["Reporting-MTA"] == "dns; relay.jsqueue.example.test"
    arrival = str(per_message["Arrival-Date"])
    assert DATE_RE.match(arrival), arrival
    arrived = email.utils.parsedate_to_datetime(arrival)
    assert before <= arrived <= after, "Arrival-Date is the acceptance instant"
    by = {str(g["Final-Recipient"]): g for g in groups}
    assert set(by) == {"rfc822; b@rej.example.test", "rfc822; c@nx.example.test"}
    b = by["rfc822; b@rej.example.test"]
    assert (b["Action"], b["Status"]) == ("failed", "5.7.26")
    assert b["Remote-MTA"] == "dns; mx.rej.example.test"
    diag = " ".join(str(b["Diagnostic-Code"]).split())
    assert "is refused because" in diag and "published policy" in diag
    c = by["rfc822; c@nx.example.test"]
    assert c["Status"] in ("5.1.2", "5.4.4")
    for g in groups:
        assert DATE_RE.match(" ".join(str(g["Last-Attempt-Date"]).split()))
    returned = [p for p in msg.walk() if p.get_content_type() == "text/rfc822-headers"]
    assert returned and b"Subject: DSN format check" in returned[0].get_payload(decode=True)


async def test_one_dsn_per_event_then_expiry(queue_harness: Harness) -> None:
    """RFC 3464 §2: 1 delivered, 1 deferred, 2 bounced → exactly one failure DSN naming the
    2 bounced; when the deferred one expires (RFC 5321 §4.5.4.1), one more naming it with
    Status 4.4.7 and the last remote reply as Diagnostic-Code."""
    h = queue_harness
    h.configure(retry={"max_age_s": 4.0, "base_s": 1.0})
    h.dns.add(
        SENDER_ZONE
        + "four.example.test. 300 IN MX 10 mx.four.example.test.\n"
        + "mx.four.example.test. 300 IN A 127.0.2.60\n"
    )
    replies = {
        "soft@four.example.test": "451 4.3.0 try later",
        "x@four.example.test": "550 5.1.1 no such user",
        "y@four.example.test": "550 5.1.1 no such user",
    }
    async with (
        SmtpdMx("127.0.2.60", h.mx_port, rcpt_replies=replies) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        rcpts = [f"{u}@four.example.test" for u in ("ok", "soft", "x", "y")]
        qid = await h.submit(case_message("CASE-07"), rcpts)
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 2, 20, what="two DSNs")
            await eventually(lambda: gone(h, qid), what="original removed")
    assert [t.rcpt_to for t in mx.delivered] == [["ok@four.example.test"]]
    _, first = dsn_parts(sender_mx.delivered[0].content or b"")
    assert sorted(str(g["Final-Recipient"]) for g in first) == [
        "rfc822; x@four.example.test",
        "rfc822; y@four.example.test",
    ]
    _, second = dsn_parts(sender_mx.delivered[1].content or b"")
    assert [str(g["Final-Recipient"]) for g in second] == ["rfc822; soft@four.example.test"]
    assert second[0]["Status"] == "4.4.7"
    assert "451 4.3.0 try later" in str(second[0]["Diagnostic-Code"])


async def test_an_expiry_reports_every_destination_in_one_dsn(queue_harness: Harness) -> None:
    """RFC 3464 §2 (one report per message and event), RFC 5321 §4.5.4.1: a message
    deferred at two domains whose lifetime has run out (here ``retry.max_age_s`` lowered
    after the attempts, their retries an hour away) is expired at the first domain's
    claim for both: one DSN names the two recipients with 4.4.7 and each one's last
    remote reply (it used to take one DSN per domain, each when its work item came due)."""
    h = queue_harness
    h.configure(retry={"base_s": 3600.0})
    a, b = "u@a.expiry.example.test", "v@b.expiry.example.test"
    h.dns.add(
        SENDER_ZONE
        + one_mx("a.expiry.example.test", "127.0.2.63")
        + one_mx("b.expiry.example.test", "127.0.2.64")
    )
    async with (
        ScriptedMx("127.0.2.63", h.mx_port, rcpt="451 4.3.0 try later") as mx_a,
        ScriptedMx("127.0.2.64", h.mx_port, rcpt="452 4.2.2 mailbox full") as mx_b,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(b"Subject: two sites\r\n\r\nbody\r\n", [a, b])
        async with h.running():
            await eventually(lambda: min(mx_a.connections, mx_b.connections) > 0, what="tried")
            await eventually(lambda: tried_twice(h, qid), what="both recorded")
        h.configure(retry={"max_age_s": 0.5})  # the lifetime has run out
        e = await h.entry(qid)
        assert e is not None
        deadline = e.created_at + timedelta(seconds=0.5)
        await eventually(lambda: datetime.now(UTC) > deadline, what="past the lifetime")
        assert (await Admin(h.stores).flush(qid, "a.expiry.example.test")).outcome is Outcome.DONE
        async with h.running():
            await eventually(lambda: gone(h, qid), what="both expired and the entry removed")
            await eventually(lambda: len(sender_mx.delivered) >= 1, what="the DSN")
    assert len(sender_mx.delivered) == 1, "one DSN for the message"
    assert mx_a.connections == mx_b.connections == 1, "no try after the lifetime"
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    found = {str(g["Final-Recipient"]): g for g in groups}
    assert sorted(found) == [f"rfc822; {a}", f"rfc822; {b}"]
    assert {str(g["Status"]) for g in groups} == {"4.4.7"}
    assert "451 4.3.0 try later" in str(found[f"rfc822; {a}"]["Diagnostic-Code"])
    assert "452 4.2.2 mailbox full" in str(found[f"rfc822; {b}"]["Diagnostic-Code"])


async def tried_twice(h: Harness, queue_id: str) -> bool:
    e = await h.entry(queue_id)
    return e is not None and all(r.attempts == 1 and not e.leases for r in e.recipients)


async def test_the_final_try_at_the_deadline_is_made(queue_harness: Harness) -> None:
    """RFC 5321 §4.5.4.1: a recipient retried until its lifetime runs out gets its last
    attempt *at* the deadline (:mod:`jsqueue.retry`), and only the failure of that try
    bounces it. Lifetime 6 s, retries every 3 s: tries at about 0 s and 3 s are refused,
    the one at 6 s is accepted, so the mail is delivered and no DSN is sent."""
    h = queue_harness
    h.configure(retry={"base_s": 3.0, "factor": 1.0, "jitter": 0.0, "max_age_s": 6.0})
    domain = "last.example.test"
    h.dns.add(one_mx(domain, "127.0.2.90"))

    def greylist_twice(session: Session, line: str) -> str | None:
        if line.upper().startswith("RCPT") and len(mx.sessions) < 3:
            return "451 4.7.1 greylisted, try again later"
        return None

    async with (
        ScriptedMx("127.0.2.90", h.mx_port, hook=greylist_twice) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        qid = await h.submit(b"Subject: last try\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running():
            await eventually(lambda: gone(h, qid), 20, what="the entry settled")
    assert len(mx.sessions) == 3, "the final try at the deadline was not made"
    assert [t.rcpt_to for t in mx.delivered] == [[f"u@{domain}"]]
    assert sender_mx.delivered == [], "no DSN: the final try delivered it"


async def test_a_dead_site_does_not_put_off_the_expiry(queue_harness: Harness) -> None:
    """RFC 5321 §4.5.4.1: a site that refuses every connection is marked down (the
    dead-site list) and its mail is put back until the cool-off ends, without an attempt.
    A cool-off that ends after a message's lifetime must not carry the message past it:
    lifetime 8 s, cool-off 300 s, the site down after 2 failures; the message expires
    (4.4.7) at about 8 s, not when the cool-off ends."""
    h = queue_harness
    h.configure(
        retry={"base_s": 1.0, "factor": 1.0, "jitter": 0.0, "max_age_s": 8.0},
        destinations={"dead_after": 2, "cool_off_s": 300.0},
    )
    domain = "dead.example.test"
    h.dns.add(one_mx(domain, "127.0.2.99"))  # nothing listens there: connection refused
    async with SmtpdMx("127.0.2.1", h.mx_port) as sender_mx:
        qid = await h.submit(b"Subject: dead site\r\n\r\nbody\r\n", [f"u@{domain}"])
        async with h.running():
            await eventually(lambda: len(sender_mx.delivered) == 1, 20, what="the expiry DSN")
            await eventually(lambda: gone(h, qid), what="original removed")
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert [str(g["Final-Recipient"]) for g in groups] == [f"rfc822; u@{domain}"]
    assert (groups[0]["Action"], groups[0]["Status"]) == ("failed", "4.4.7")


async def test_notify_and_delay_warning(queue_harness: Harness) -> None:
    """RFC 3461 §4.1: NOTIFY=NEVER suppresses the failure DSN; NOTIFY=SUCCESS gives a success
    DSN; with delay warnings on, a deferred NOTIFY=DELAY recipient gets one "delayed" DSN
    (Action delayed, 4.x.x, Will-Retry-Until) and is not warned twice within the interval."""
    h = queue_harness
    h.configure(
        retry={"base_s": 1.0, "max_age_s": 3600.0},
        dsn={"delay_warning_after_s": 1.0, "delay_warning_interval_s": 3600.0},
    )
    h.dns.add(
        SENDER_ZONE
        + "n.example.test. 300 IN MX 10 mx.n.example.test.\n"
        + "mx.n.example.test. 300 IN A 127.0.2.61\n"
    )
    replies = {"never@n.example.test": "550 5.1.1 no", "slow@n.example.test": "451 4.3.0 later"}
    async with (
        SmtpdMx("127.0.2.61", h.mx_port, rcpt_replies=replies, extra_extensions=[]) as mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        never = await h.submit(
            case_message("CASE-07"), ["never@n.example.test"], rcpt_options=["NOTIFY=NEVER"]
        )
        success = await h.submit(
            case_message("CASE-07"), ["ok@n.example.test"], rcpt_options=["NOTIFY=SUCCESS"]
        )
        slow = await h.submit(
            case_message("CASE-07"), ["slow@n.example.test"], rcpt_options=["NOTIFY=DELAY"]
        )
        async with h.running():
            await eventually(lambda: gone(h, never), what="NOTIFY=NEVER removed")
            await eventually(lambda: gone(h, success), what="NOTIFY=SUCCESS removed")

            async def attempts(n: int) -> bool:
                e = await h.entry(slow)
                return e is not None and e.recipients[0].attempts >= n

            await eventually(lambda: attempts(4), what="slow retried a few times")
        actions = []
        for tx in sender_mx.delivered:
            _, groups = dsn_parts(tx.content or b"")
            actions += [(str(g["Final-Recipient"]), str(g["Action"])) for g in groups]
    assert sorted(actions) == [
        ("rfc822; ok@n.example.test", "relayed"),
        ("rfc822; slow@n.example.test", "delayed"),
    ]
    delayed = next(
        dsn_parts(t.content or b"")[1][0]
        for t in sender_mx.delivered
        if b"slow@n.example.test" in (t.content or b"")
    )
    assert str(delayed["Status"]).startswith("4.")
    assert delayed["Will-Retry-Until"]
    assert len(mx.delivered) == 1


async def test_no_success_dsn_when_the_next_hop_takes_notify(queue_harness: Harness) -> None:
    """RFC 3461 §5.2.1, §6.2.1: NOTIFY=SUCCESS and ORCPT passed on in RCPT to a next hop
    that advertises DSN hand the duty to report success to it: jsqueue sends no success DSN
    (neither delivered nor relayed). The same message to a next hop without DSN gets the
    one "relayed" DSN (RFC 3461 §5.2.2)."""
    h = queue_harness
    h.dns.add(
        SENDER_ZONE
        + "dsn.example.test. 300 IN MX 10 mx.dsn.example.test.\n"
        + "mx.dsn.example.test. 300 IN A 127.0.2.63\n"
        + "plain.example.test. 300 IN MX 10 mx.plain.example.test.\n"
        + "mx.plain.example.test. 300 IN A 127.0.2.64\n"
    )
    dsn_ext = ("PIPELINING", "8BITMIME", "ENHANCEDSTATUSCODES", "SIZE 52428800", "DSN")
    async with (
        ScriptedMx("127.0.2.63", h.mx_port, extensions=dsn_ext) as dsn_mx,
        SmtpdMx("127.0.2.64", h.mx_port) as plain_mx,
        SmtpdMx("127.0.2.1", h.mx_port) as sender_mx,
    ):
        taken = await h.submit(
            case_message("CASE-07"),
            ["ok@dsn.example.test"],
            rcpt_options=["NOTIFY=SUCCESS", "ORCPT=rfc822;ok@dsn.example.test"],
        )
        relayed = await h.submit(
            case_message("CASE-07"),
            ["ok@plain.example.test"],
            rcpt_options=["NOTIFY=SUCCESS", "ORCPT=rfc822;ok@plain.example.test"],
        )
        async with h.running():
            await eventually(lambda: gone(h, taken), what="the DSN hop's message removed")
            await eventually(lambda: gone(h, relayed), what="the plain hop's message removed")
            await eventually(lambda: len(sender_mx.delivered) >= 1, what="the relayed DSN")
        rcpt = [c for c in dsn_mx.commands if c.upper().startswith("RCPT")]
        assert len(rcpt) == 1 and "NOTIFY=SUCCESS" in rcpt[0], rcpt
        assert "ORCPT=rfc822;ok@dsn.example.test" in rcpt[0], rcpt
        assert len(plain_mx.delivered) == 1
    # Removal comes after every DSN an entry owes is enqueued, and DSN entries are kept:
    # the one DSN entry is the whole story.
    dsns = [v.entry for v in await h.stores.entries.page(limit=10) if v.entry.is_dsn]
    assert len(dsns) == 1, [e.id for e in dsns]
    assert len(sender_mx.delivered) == 1
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert [(str(g["Final-Recipient"]), str(g["Action"])) for g in groups] == [
        ("rfc822; ok@plain.example.test", "relayed")
    ]


UTF8_ORIGINAL = (
    "From: Jörg <joerg@example.test>\r\nTo: <no@intl.example.test>\r\n"
    "Subject: Grüße aus Köln\r\nMIME-Version: 1.0\r\n"
    "Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
    "Schöne Grüße\r\n"
).encode()
PART_HEADER_ORIGINAL = (
    "From: a@example.test\r\nTo: <no@intl.example.test>\r\nSubject: files\r\n"
    "MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n"
    '--b\r\nContent-Type: text/plain; charset=utf-8; name="Grüße.txt"\r\n'
    "Content-Transfer-Encoding: 8bit\r\n\r\nGrüße\r\n--b--\r\n"
).encode()


async def test_failure_dsn_returning_an_8bit_original_reaches_a_7bit_sender_mx(
    queue_harness: Harness,
) -> None:
    """RFC 6532 §3.5 / §3.7, RFC 6152 §3, RFC 3461 §4.3: a failure DSN returning (RET=FULL)
    an SMTPUTF8 original with UTF-8 headers, or an 8BITMIME one with a UTF-8 MIME part
    header, goes to a sender MX without 8BITMIME and SMTPUTF8 as 7-bit MIME: the original
    travels as message/global, base64-encoded, and decodes to the stored message. It is
    not refused for its encoding (5.6.3) and dropped (RFC 5321 §4.5.5): the sender hears."""
    h = queue_harness
    h.dns.add(
        SENDER_ZONE
        + "intl.example.test. 300 IN MX 10 mx.intl.example.test.\n"
        + "mx.intl.example.test. 300 IN A 127.0.2.65\n"
    )
    refused = {"no@intl.example.test": "550 5.1.1 no such user here"}
    async with (
        SmtpdMx("127.0.2.65", h.mx_port, smtputf8=True, rcpt_replies=refused),
        SmtpdMx("127.0.2.1", h.mx_port, eight_bit=False) as sender_mx,
    ):
        utf8 = await h.submit(
            UTF8_ORIGINAL,
            ["no@intl.example.test"],
            mail_options=["SMTPUTF8", "BODY=8BITMIME", "RET=FULL"],
        )
        parts = await h.submit(
            PART_HEADER_ORIGINAL,
            ["no@intl.example.test"],
            mail_options=["BODY=8BITMIME", "RET=FULL"],
        )
        worker = h.worker()
        async with h.running(worker):
            await eventually(lambda: gone(h, utf8), what="the SMTPUTF8 original removed")
            await eventually(lambda: gone(h, parts), what="the 8BITMIME original removed")
            await eventually(lambda: len(sender_mx.delivered) == 2, what="both DSNs")
        assert worker.notifier.dropped == 0  # type: ignore[attr-defined]
    returned = set()
    for tx in sender_mx.delivered:
        assert tx.mail_from == "" and "BODY=8BITMIME" not in tx.mail_params
        content = tx.content or b""
        assert content.isascii()
        dsn, groups = dsn_parts(content)
        assert [(str(g["Action"]), str(g["Status"])) for g in groups] == [("failed", "5.1.1")]
        [part] = [p for p in dsn.walk() if p.get_content_type() == "message/global"]
        assert part["Content-Transfer-Encoding"] == "base64"
        decoded = base64.b64decode(
            content.split(b"Content-Transfer-Encoding: base64\r\n\r\n")[-1].split(b"\r\n--")[0]
        )
        _, message = split_body(decoded)  # after our Received: field
        returned.add(message)
    assert returned == {UTF8_ORIGINAL, PART_HEADER_ORIGINAL}


async def test_undeliverable_dsn_expires_and_copies_postmaster(queue_harness: Harness) -> None:
    """A DSN that cannot be delivered (the sender's MX keeps answering 451) is dropped when
    its shorter lifetime (retry.bounce_max_age_s) runs out: logged, counted, no DSN about
    it to <>; a copy goes to the configured postmaster (double bounce)."""
    h = queue_harness
    h.configure(
        retry={"base_s": 1.0, "max_age_s": 3600.0, "bounce_max_age_s": 3.0},
        dsn={"postmaster": "postmaster@pm.example.test"},
    )
    h.dns.add(
        case_text("CASE-21", "dns.txt")
        + "pm.example.test. 300 IN MX 10 mx.pm.example.test.\n"
        + "mx.pm.example.test. 300 IN A 127.0.2.62\n"
    )
    async with (
        SmtpdMx("127.0.2.170", h.mx_port, mail_reply="451 4.3.0 not now") as src,
        SmtpdMx("127.0.2.62", h.mx_port) as postmaster,
    ):
        await h.submit(
            case_message("CASE-21"), ["gone@nomail.example.test"], sender="sender@src.example.test"
        )
        worker = h.worker()
        async with h.running(worker):
            await eventually(lambda: len(postmaster.delivered) == 1, 20, what="postmaster copy")
        assert worker.notifier.dropped == 1  # type: ignore[attr-defined]
        assert src.delivered == [] and src.connections >= 2, "the DSN was retried, then dropped"
    tx = postmaster.delivered[0]
    assert (tx.mail_from, tx.rcpt_to) == ("", ["postmaster@pm.example.test"])
    _, groups = dsn_parts(tx.content or b"")
    assert [str(g["Final-Recipient"]) for g in groups] == ["rfc822; sender@src.example.test"]
    assert groups[0]["Status"] == "4.4.7"
