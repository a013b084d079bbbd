"""End to end with real mail software: swaks → jsqueue (CLI processes) → Postfix → Maildir.

One Postfix instance (Debian's package, own config dir) is the receiving MX on a 127.0.x.y
address for ``dest.example.test`` and ``sender.example.test``, storing mail in Maildirs.
A DNS server on loopback answers the worker's MX lookups for both domains with that
address. jsqueue runs as ``python -m jsqueue up`` (embedded nats-server, front end, worker)
with ``JSQUEUE_*`` settings: the resolver points at the DNS server, ``worker.mx_port`` at
Postfix's port, retries every second. swaks submits mail to the front end.

Checks: a message arrives exactly once with its body intact (only trace headers added);
a ``550`` for an unknown user produces a DSN that Postfix delivers into the sender's
Maildir; with Postfix stopped the message is deferred (retried), and delivered once
Postfix is back.

Everything waits for events (files in a Maildir, the queue entry's state, log lines).
Nothing leaves 127.0.0.0/8. Needs Postfix and swaks installed (``make tools``).
"""

from __future__ import annotations

import asyncio
import email
import email.message
import email.policy
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry, RecipientState
from jsqueue.errors import EntryNotFound
from jsqueue.names import Names
from jsqueue.store.jetstream import connect_nats
from jsqueue.store.jetstream.entries import JetStreamEntryStore
from jsqueue.store.jetstream.work import JetStreamScheduler
from support.dns import DnsServer
from support.postfix import (
    SWAKS,
    JsqueueProcess,
    Postfix,
    make_workdir,
    require_tools,
    up_env,
)

DEST = "dest.example.test"
SENDER_DOMAIN = "sender.example.test"
BOB = f"bob@{DEST}"
CAROL = f"carol@{DEST}"
UNKNOWN = f"nobody@{DEST}"
ALICE = f"alice@{SENDER_DOMAIN}"
DAVE = f"dave@{SENDER_DOMAIN}"
PREFIX = "jsq"
_QUEUED = re.compile(r"queued as (\S+)")
_TRACE_FIELDS = ("return-path", "x-original-to", "delivered-to", "received")

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- fixtures


class Site:
    """The running pieces: Postfix MX, DNS, jsqueue, and how to reach them."""

    def __init__(self, mx: Postfix, jsq: JsqueueProcess, smtp_port: int, nats_url: str) -> None:
        self.mx = mx
        self.jsq = jsq
        self.smtp_port = smtp_port
        self.nats_url = nats_url


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    require_tools(SWAKS)
    path = make_workdir("jsqueue-e2e-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def site(workdir: Path) -> Iterator[Site]:
    mx = Postfix.mx(workdir / "postfix", [BOB, CAROL, ALICE, DAVE])
    zone = (
        f"{DEST}. MX 10 mx.{DEST}.\n"
        f"mx.{DEST}. A {mx.host}\n"
        f"{SENDER_DOMAIN}. MX 10 mx.{SENDER_DOMAIN}.\n"
        f"mx.{SENDER_DOMAIN}. A {mx.host}\n"
    )
    with DnsServer(zone) as dns:
        mx.start()
        env = up_env(workdir, mx, dns, nats__prefix=PREFIX)
        jsq = JsqueueProcess(["up"], env, workdir / "jsqueue.log").start()
        try:
            nats_url = jsq.wait_for_log(r"embedded nats-server on (nats://\S+)").group(1)
            port = int(jsq.wait_for_log(r"SMTP front end listening on [\d.]+:(\d+)").group(1))
            jsq.wait_for_log(r"jsqueue running")
            yield Site(mx, jsq, port, nats_url)
        finally:
            status = jsq.stop()
            mx.remove()
        assert status == 0, f"jsqueue up exited with {status}:\n{jsq.log()[-3000:]}"


class Queue:
    """Read-only look at the queue: entries by direct get, the consumer's backlog."""

    def __init__(self, entries: JetStreamEntryStore, scheduler: JetStreamScheduler) -> None:
        self.entries = entries
        self.scheduler = scheduler

    async def entry(self, queue_id: str) -> Entry | None:
        try:
            return (await self.entries.get(queue_id)).entry
        except EntryNotFound:
            return None


@pytest.fixture
async def queue(site: Site) -> AsyncIterator[Queue]:
    nc = await connect_nats(NatsSettings(), [site.nats_url])
    names = Names(PREFIX)
    try:
        yield Queue(JetStreamEntryStore(nc, names), JetStreamScheduler(nc, names))
    finally:
        await nc.close()


# --------------------------------------------------------------------------- helpers


def swaks(site: Site, sender: str, recipient: str, message: Path) -> str:
    """Submit ``message`` with swaks to the front end; return the queue id from the 250."""
    proc = subprocess.run(
        [
            SWAKS,
            "--server",
            "127.0.0.1",
            "--port",
            str(site.smtp_port),
            "--helo",
            "client.example.test",
            "--from",
            sender,
            "--to",
            recipient,
            "--data",
            f"@{message}",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"swaks failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    match = _QUEUED.search(proc.stdout)
    assert match, proc.stdout
    return match.group(1)


async def eventually(check: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Wait until ``check()`` (sync or async) is truthy, polled every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


async def settled(queue: Queue, queue_id: str) -> None:
    """Wait until the entry is gone (final, removed) and no work item is left at all."""

    async def done() -> bool:
        return await queue.entry(queue_id) is None and await queue.scheduler.backlog() == 0

    await eventually(done, f"queue {queue_id} finished and the queue idle")


def strip_trace(delivered: bytes) -> tuple[list[str], bytes]:
    """Split the trace fields Postfix and jsqueue put on top from the rest of the message.

    Returns:
        the trace field names in order, and the message below them.
    """
    lines = delivered.split(b"\n")
    names: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line[:1] in (b" ", b"\t") and names:
            i += 1
            continue
        name = line.split(b":", 1)[0].decode("ascii", "replace").lower()
        if b":" not in line or name not in _TRACE_FIELDS:
            break
        names.append(name)
        i += 1
    return names, b"\n".join(lines[i:])


def write_message(path: Path, sender: str, recipient: str, subject: str, body: str) -> bytes:
    """Write a message file for swaks; return the message as swaks sends it (LF for CRLF).

    swaks ends the data it read with one more line end of its own, so the file is written
    without the final one.
    """
    text = (
        f"Date: Sun, 29 Nov 2026 12:00:00 +0000\n"
        f"Message-ID: <{subject.replace(' ', '.')}@client.example.test>\n"
        f"From: <{sender}>\n"
        f"To: <{recipient}>\n"
        f"Subject: {subject}\n"
        "MIME-Version: 1.0\n"
        "Content-Type: text/plain; charset=utf-8\n"
        "Content-Transfer-Encoding: 8bit\n"
        "\n"
        f"{body}"
    )
    data = text.encode()
    assert data.endswith(b"\n")
    path.write_bytes(data[:-1])
    return data


def intact_body() -> str:
    """A body that spans several store chunks and has the usual traps in it."""
    lines = [
        "Hello Bob,",
        ".a line that starts with a dot (dot-stuffed on the wire)",
        "..two dots",
        ".",
        "trailing blanks   ",
        "\ttab-indented line",
        "8-bit text: grüße, 日本語, ½",
        "From the start of a line (mbox would quote this)",
    ]
    filler = [f"line {n:06d} " + "x" * 60 for n in range(9000)]  # ~650 KB: three chunks
    return "\n".join([*lines, *filler, "-- ", "end"]) + "\n"


# --------------------------------------------------------------------------- tests


async def test_message_arrives_once_with_body_intact(
    site: Site, queue: Queue, workdir: Path
) -> None:
    original = write_message(workdir / "intact.eml", ALICE, BOB, "intact body", intact_body())
    queue_id = swaks(site, ALICE, BOB, workdir / "intact.eml")

    site.mx.wait_for_messages(BOB, 1)
    await settled(queue, queue_id)
    files = site.mx.messages(BOB)
    assert len(files) == 1, f"{len(files)} copies delivered"
    names, rest = strip_trace(files[0].read_bytes())
    assert rest == original
    assert names[:3] == ["return-path", "x-original-to", "delivered-to"]
    assert names[3:] == ["received", "received"]  # Postfix's, then jsqueue's
    delivered = email.message_from_bytes(files[0].read_bytes(), policy=email.policy.default)
    assert delivered["Return-Path"] == f"<{ALICE}>"
    ours = [str(r) for r in delivered.get_all("Received", []) if "(jsqueue)" in str(r)]
    assert len(ours) == 1
    assert f"id {queue_id}" in ours[0]
    assert f"for <{BOB}>" in ours[0]


async def test_unknown_user_bounces_into_senders_maildir(
    site: Site, queue: Queue, workdir: Path
) -> None:
    write_message(workdir / "unknown.eml", DAVE, UNKNOWN, "to nobody", "Are you there?\n")
    queue_id = swaks(site, DAVE, UNKNOWN, workdir / "unknown.eml")

    files = site.mx.wait_for_messages(DAVE, 1)
    await settled(queue, queue_id)
    files = site.mx.messages(DAVE)
    assert len(files) == 1, f"{len(files)} DSNs delivered"
    dsn = email.message_from_bytes(files[0].read_bytes(), policy=email.policy.default)
    assert dsn["Return-Path"] == "<>"  # bounces come from the null reverse-path
    assert dsn.get_content_type() == "multipart/report"
    assert dsn.get_param("report-type") == "delivery-status"
    parts = {part.get_content_type(): part for part in dsn.iter_parts()}
    assert "message/delivery-status" in parts
    status = parts["message/delivery-status"]
    fields: dict[str, str] = {}
    for block in status.get_payload():
        assert isinstance(block, email.message.Message)
        fields.update({k.lower(): str(v) for k, v in block.items()})
    assert fields["final-recipient"].lower() == f"rfc822; {UNKNOWN}"
    assert fields["action"] == "failed"
    assert fields["status"] == "5.1.1"
    assert fields["diagnostic-code"].startswith("smtp; 550 5.1.1")
    assert "User unknown" in fields["diagnostic-code"]
    assert fields["remote-mta"].lower().startswith("dns; mx.dest.example.test")
    returned = [p for t, p in parts.items() if t in ("message/rfc822", "text/rfc822-headers")]
    assert returned, f"no returned message in {list(parts)}"
    assert "Subject: to nobody" in returned[0].as_string()
    assert site.mx.messages(UNKNOWN) == []


async def test_stopped_postfix_defers_then_delivers(
    site: Site, queue: Queue, workdir: Path
) -> None:
    original = write_message(
        workdir / "later.eml", ALICE, CAROL, "later", "Deferred, then delivered.\n"
    )
    site.mx.stop()
    try:
        queue_id = swaks(site, ALICE, CAROL, workdir / "later.eml")

        async def retried() -> bool:
            entry = await queue.entry(queue_id)
            if entry is None:
                return False
            (rcpt,) = entry.recipients
            return rcpt.state is RecipientState.DEFERRED and rcpt.attempts >= 2

        await eventually(retried, "two failed attempts while Postfix is down")
        entry = await queue.entry(queue_id)
        assert entry is not None
        reply = entry.recipients[0].last_reply
        assert reply is not None and reply.code // 100 == 4, reply
        assert site.mx.messages(CAROL) == []
    finally:
        site.mx.start()

    site.mx.wait_for_messages(CAROL, 1)
    await settled(queue, queue_id)
    files = site.mx.messages(CAROL)
    assert len(files) == 1, f"{len(files)} copies delivered"
    assert strip_trace(files[0].read_bytes())[1] == original
    assert site.mx.messages(ALICE) == []  # no DSN: delivered in the end, NOTIFY default
