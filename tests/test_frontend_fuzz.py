"""Property test: malformed commands, addresses and DATA never break the front end.

For every generated session (sent as one byte stream, then ``<CRLF>.<CRLF>QUIT``):

- every reply is a syntactically valid SMTP reply (RFC 5321 §4.2: three digits 2xx-5xx,
  ``-`` continuation on all lines but the last, one code per reply, printable, <= 512
  octets), checked by :class:`support.frontend.ReplyParser`;
- exactly as many entries *and* bodies are stored as ``250 … queued as <id>`` replies with
  a new id were sent (a resend within the dedupe window gets the first id): nothing is
  stored for rejected input, nothing is lost for accepted input;
- the server keeps serving: each example opens a new connection, and a clean transaction
  works at the end.

Bounded: 200 examples against one front end in a thread (memory stores).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from support.frontend import (
    BlockingWire,
    ThreadedFrontend,
    dot_stuff,
    entries_of,
    frontend_settings,
    memory_body_count,
    queued_id,
)

VALID = [
    b"EHLO client.example.test",
    b"HELO client.example.test",
    b"MAIL FROM:<alice@example.test>",
    b"MAIL FROM:<>",
    b"MAIL FROM:<alice@example.test> SMTPUTF8 BODY=8BITMIME SIZE=100 RET=HDRS ENVID=x+2By",
    b"RCPT TO:<bob@dest.example.test>",
    b"RCPT TO:<bob@dest.example.test> NOTIFY=SUCCESS,DELAY ORCPT=rfc822;bob@dest.example.test",
    "RCPT TO:<müller@intl.example.test>".encode(),
    b"DATA",
    b"RSET",
    b"NOOP",
    b"STARTTLS",
    b"AUTH PLAIN AGFsaWNlAHB3",
    b"VRFY <bob@dest.example.test>",
    b"HELP MAIL",
]
VERBS = [
    b"MAIL FROM:",
    b"RCPT TO:",
    b"MAIL FROM: ",
    b"RCPT TO:<",
    b"EHLO ",
    b"DATA ",
    b"",
    b"XCLIENT ",
]
ADDRESS_CHARS = st.sampled_from(list('<>@:.,"\\ ;=+-_') + list("aZ9ü\u00a0\x00\x7f\udcff") + ["\t"])
ADDRESS = st.text(ADDRESS_CHARS, max_size=30).map(lambda t: t.encode("utf-8", "surrogateescape"))
COMMAND = st.one_of(
    st.sampled_from(VALID),
    st.tuples(
        st.sampled_from(VERBS),
        ADDRESS,
        st.sampled_from([b"", b" SIZE=x", b" NOTIFY=NEVER,SUCCESS"]),
    ).map(b"".join),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"A" * 1200, b"MAIL FROM:<" + b"a" * 600 + b"@x.test>"]),
)
CLEAN_LINE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(
    str.encode
)
DATA_LINE = st.one_of(
    CLEAN_LINE,
    st.binary(max_size=30),
    st.sampled_from(
        [
            b".",
            b"..",
            b".\n",
            b"\r.\r",
            b"\n.\n",
            b"MAIL FROM:<ceo@trusted.example.test>",
            b"B" * 999,
        ]
    ),
)
DATA = st.one_of(st.lists(CLEAN_LINE, max_size=8), st.lists(DATA_LINE, max_size=8)).map(
    lambda lines: (
        b"".join((b"." + ln if ln.startswith(b".") else ln) + b"\r\n" for ln in lines) + b".\r\n"
    )
)
PIECE = st.one_of(COMMAND.map(lambda c: c + b"\r\n"), COMMAND.map(lambda c: c + b"\n"), DATA)


def mostly(
    valid: st.SearchStrategy[bytes], junk: st.SearchStrategy[bytes]
) -> st.SearchStrategy[bytes]:
    """``valid`` four times in five, else ``junk``."""
    return st.tuples(st.integers(0, 4), valid, junk).map(lambda t: t[2] if t[0] == 4 else t[1])


MAIL = mostly(
    st.sampled_from([b"MAIL FROM:<alice@example.test>", b"MAIL FROM:<>", *VALID[2:5]]).map(
        lambda c: c + b"\r\n"
    ),
    COMMAND.map(lambda c: c + b"\r\n"),
)
RCPT = mostly(
    st.sampled_from([b"RCPT TO:<carol@x.example.test>", *VALID[5:8]]).map(lambda c: c + b"\r\n"),
    PIECE,
)
# A transaction skeleton whose steps may each be replaced by junk: many examples get a
# message through, so the stored-iff-acknowledged property is exercised both ways.
TRANSACTION = st.tuples(
    mostly(
        st.sampled_from([b"EHLO client.example.test\r\n", b"HELO client.example.test\r\n"]),
        st.just(b""),
    ),
    MAIL,
    st.lists(RCPT, min_size=1, max_size=4).map(b"".join),
    mostly(st.sampled_from([b"DATA\r\n", b"DATA\n"]), st.just(b"DATA x\r\n")),
    DATA,
).map(b"".join)

SESSION = st.lists(
    st.one_of(TRANSACTION, TRANSACTION, TRANSACTION, PIECE), min_size=1, max_size=4
).map(b"".join)


@pytest.fixture(scope="module")
def frontend() -> Iterator[ThreadedFrontend]:
    fe = ThreadedFrontend(
        frontend_settings(max_message_size=4096, max_recipients=3, session_timeout_s=10)
    )
    yield fe
    fe.stop()


def counts(fe: ThreadedFrontend) -> tuple[int, int]:
    async def count() -> int:
        return len(await entries_of(fe.stores))

    return fe.call(count), memory_body_count(fe.stores)


def test_fuzzed_sessions_get_valid_replies_and_store_only_what_was_acknowledged(
    frontend: ThreadedFrontend,
) -> None:
    """RFC 5321 §4.2 reply syntax; 250-or-nothing storage; the server keeps serving."""

    seen: set[str] = set()

    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True,
    )
    @given(session=SESSION)
    def run(session: bytes) -> None:
        entries_before, bodies_before = counts(frontend)
        w = BlockingWire(frontend.port)
        try:
            greeting = w.reply()
            assert greeting is not None and greeting.code == 220
            w.send(session + b"\r\n.\r\nQUIT\r\n")
            queued = acknowledged = 0
            while (r := w.reply()) is not None:
                if r.code == 250 and "queued as" in r.text:
                    # A resend within the dedupe window is acknowledged with the first id.
                    qid = queued_id(r)
                    acknowledged += 1
                    queued += qid not in seen
                    seen.add(qid)
            event(f"acknowledged: {min(acknowledged, 2)}, new: {min(queued, 2)}")
        finally:
            w.close()
        assert counts(frontend) == (entries_before + queued, bodies_before + queued)

    run()
    w = BlockingWire(frontend.port)
    assert (g := w.reply()) is not None and g.code == 220
    message = dot_stuff(b"Subject: after the fuzz\r\n\r\nstill serving\r\n")
    w.send(
        b"EHLO c.test\r\nMAIL FROM:<a@example.test>\r\nRCPT TO:<b@dest.example.test>\r\nDATA\r\n"
    )
    assert [getattr(w.reply(), "code", None) for _ in range(4)] == [250, 250, 250, 354]
    w.send(message + b"QUIT\r\n")
    final = w.reply()
    assert final is not None and "queued as" in final.text
    w.close()
