"""The front end on JetStream stores (a real nats-server per test, port 0, temp dir).

DESIGN.md §2.1: 250 only after body, entry and work item are stored in JetStream; 451, never
250, while NATS is unreachable; new mail is accepted again once NATS is back, without
restarting the front end.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from email.message import EmailMessage
from pathlib import Path

import aiosmtplib
import nats.js.errors
import pytest

from jsqueue.envelope import WorkItem
from jsqueue.errors import StoreFull
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import connect_nats, open_jetstream
from jsqueue.store.jetstream.api import is_storage_full, is_temporary
from support.frontend import (
    Wire,
    dot_stuff,
    frontend_settings,
    queued_id,
    running,
    split_body,
)
from support.nats import make_entry, make_settings, read_body

MESSAGE = (
    b"From: alice@example.test\r\nTo: bob@dest.example.test\r\nSubject: js\r\n\r\n.dot\r\nbody\r\n"
)


async def test_message_is_in_jetstream_before_250(js_stores: Stores) -> None:
    """Body (object store), entry (KV) and one work item per domain (stream) exist once the
    client has its 250; the stored body is the Received: field plus the message."""
    msg = EmailMessage()
    msg["From"], msg["To"], msg["Subject"] = "alice@example.test", "bob@dest.example.test", "js"
    msg.set_content("hello\n.dotted\n")
    async with running(frontend_settings(), js_stores) as server:
        errors, text = await aiosmtplib.send(
            msg,
            sender="alice@example.test",
            recipients=["bob@dest.example.test", "carol@other.example.test"],
            hostname="127.0.0.1",
            port=server.port,
        )
    assert errors == {}
    qid = text.rsplit(" ", 1)[1]
    entry = (await js_stores.entries.get(qid)).entry
    body = await read_body(js_stores, qid)
    assert split_body(body)[1] == msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))
    assert (entry.size, entry.digest) == (len(body), hashlib.sha256(body).hexdigest())
    due = await js_stores.scheduler.fetch(batch=10, timeout_s=5)
    assert sorted((d.item.queue_id, d.item.domain) for d in due) == [
        (qid, "dest.example.test"),
        (qid, "other.example.test"),
    ]
    for d in due:
        await d.ack()


async def test_rejected_message_leaves_nothing_in_jetstream(js_stores: Stores) -> None:
    """A message rejected after its body upload started (oversize, > one chunk) is removed
    from the object store; the session goes on."""
    big = b"Subject: big\r\n\r\n" + (b"x" * 76 + b"\r\n") * 20_000
    async with running(frontend_settings(max_message_size=1_000_000), js_stores) as server:
        w = await Wire.connect(server.port)
        r = await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(big))
        assert (r.code, r.enhanced) == (552, "5.3.4")
        qid = queued_id(
            await w.transaction(
                "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE), ehlo=False
            )
        )
    page = await js_stores.entries.page()
    assert [v.entry.id for v in page] == [qid]


async def _attempt(port: int) -> int:
    w = await Wire.connect(port)
    try:
        r = await w.transaction("alice@example.test", ["bob@dest.example.test"], dot_stuff(MESSAGE))
        await w.expect("QUIT", 221)
    finally:
        await w.close()
    return r.code


async def test_nats_outage_gives_451_and_mail_flows_again_after_restart(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """DESIGN.md §2.1 / brief item 6: NATS stopped → 451 4.3.0, never 250; NATS restarted on
    the same port and store dir → the same front end (no restart) answers 250 again, and
    the message accepted before the outage is still there."""
    stores = await open_jetstream(
        make_settings(request_timeout_s=1.0), [nats_server.url], names=names
    )
    try:
        async with running(
            frontend_settings(store_timeout_s=2.0, dedupe_window_s=0), stores
        ) as server:
            w = await Wire.connect(server.port)
            before = queued_id(
                await w.transaction(
                    "alice@example.test", ["bob@dest.example.test"], dot_stuff(MESSAGE)
                )
            )
            await w.expect("QUIT", 221)

            await nats_server.stop()
            w = await Wire.connect(server.port)
            r = await w.transaction(
                "alice@example.test", ["bob@dest.example.test"], dot_stuff(MESSAGE)
            )
            assert (r.code, r.enhanced) == (451, "4.3.0")
            await w.expect("NOOP", 250)

            await nats_server.start()
            # Like a real client after a 451: try again until accepted (bounded).
            codes = []
            async with asyncio.timeout(30):
                while not codes or codes[-1] != 250:
                    codes.append(await _attempt(server.port))
            assert set(codes) <= {250, 451}
        assert (await stores.entries.get(before)).entry.reverse_path == "alice@example.test"
        assert split_body(await read_body(stores, before))[1] == MESSAGE
    finally:
        await stores.close()


async def test_resent_message_is_stored_once_on_jetstream(js_stores: Stores) -> None:
    """Idempotent ingest on JetStream (the ingest log KV bucket): a client that resends the
    same envelope and content after losing our 250 (the session broke right after it)
    gets the first queue id back, and the queue holds one entry and one work item, not two;
    a copy sent after a clean QUIT is new mail."""
    assert js_stores.ingest is not None
    async with running(frontend_settings(dedupe_window_s=60), js_stores) as server:
        ids = []
        for _ in range(2):
            w = await Wire.connect(server.port)
            reply = await w.transaction(
                "a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE)
            )
            await w.close()  # no QUIT: the client may not have seen the 250
            ids.append(queued_id(reply))
        w = await Wire.connect(server.port)
        seen = await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE))
        await w.expect("QUIT", 221)
        await w.close()
        assert queued_id(seen) == ids[0]  # still the resend of the first copy...
        w = await Wire.connect(server.port)
        new = await w.transaction("a@example.test", ["b@dest.example.test"], dot_stuff(MESSAGE))
        await w.expect("QUIT", 221)
        await w.close()
        assert queued_id(new) not in ids  # ...but that QUIT proved the 250 arrived
    assert ids[0] == ids[1]
    assert len(await js_stores.entries.page(limit=10)) == 2
    assert await js_stores.scheduler.backlog() == 2


@pytest.mark.parametrize(
    ("err_code", "text", "full"),
    [
        (10002, "resource limits exceeded for account", True),  # account max_file/max_mem
        (10047, "insufficient storage resources available", True),
        (10077, "maximum bytes exceeded", True),  # a stream at its own limit
        (10077, "some other store failure", False),
        (10071, "wrong last sequence: 5", False),
    ],
)
def test_which_refusals_are_storage_full(err_code: int, text: str, full: bool) -> None:
    """The JetStream error codes (nats-server's errors.json) answered 452 4.3.1 at ingest
    (RFC 3463 X.3.1): the server's, the account's and a stream's storage limits."""
    error = nats.js.errors.APIError(code=400, err_code=err_code, description=text)
    assert is_storage_full(error) is full


@pytest.mark.parametrize(
    ("code", "err_code", "text", "temporary"),
    [
        (409, 10158, "duplicate message id is in process", True),
        (503, 0, "no response from stream", True),
        (503, 10023, "insufficient resources", False),  # storage: 452 at once
        (400, 10071, "wrong last sequence: 5", False),
        (400, 10077, "maximum bytes exceeded", False),
    ],
)
def test_which_refusals_a_write_retries(
    code: int, err_code: int, text: str, temporary: bool
) -> None:
    """Refusals retried with the same message id until ``smtp.store_timeout_s``: an earlier
    try of the same write still being applied (409, 10158: a fault soak saw 8 clients
    refused 451 for it after a leader change) and a 503 without a stream leader; never a
    refusal for storage or a lost compare-and-set."""
    error = nats.js.errors.APIError(code=code, err_code=err_code, description=text)
    assert is_temporary(error) is temporary


async def fill_until_refused(
    tmp_path: Path,
    names: Names,
    body: bytes,
    *,
    max_file_store: str,
    request_timeout_s: float,
    store_timeout_s: float,
) -> None:
    """Send ``body`` in one session to a nats-server with ``max_file_store`` until a
    message is refused: it gets ``452 4.3.1``, the session stays usable, the refused
    message leaves no entry, and every message answered 250 before is stored whole."""
    conf = tmp_path / "small.conf"
    conf.write_text(
        "listen: 127.0.0.1:4222\nmax_payload: 1MB\n"
        f"jetstream {{\n  sync_interval: always\n  max_file_store: {max_file_store}\n}}\n"
    )
    async with EmbeddedNats(tmp_path / "nats", port=0, config_file=conf) as srv:
        settings = make_settings(request_timeout_s=request_timeout_s, events_max_bytes=1 << 20)
        stores = await open_jetstream(settings, [srv.url], names=names)
        try:
            async with running(
                frontend_settings(store_timeout_s=store_timeout_s, dedupe_window_s=0), stores
            ) as server:
                w = await Wire.connect(server.port)
                await w.expect("EHLO client.example.test", 250)
                queued: list[str] = []
                for i in range(40):
                    r = await w.transaction(
                        "a@example.test", [f"b{i}@dest.example.test"], dot_stuff(body), ehlo=False
                    )
                    if r.code != 250:
                        break
                    queued.append(queued_id(r))
                assert queued, "nothing fitted at all"
                assert (r.code, r.enhanced) == (452, "4.3.1"), r
                await w.expect("NOOP", 250)
                await w.expect("QUIT", 221)
            entries = await stores.entries.page(limit=100)
            assert sorted(v.entry.id for v in entries) == sorted(queued)
            for qid in queued:
                assert split_body(await read_body(stores, qid))[1] == body
        finally:
            await stores.close()


async def test_jetstream_storage_full_is_452_4_3_1_and_nothing_acknowledged_is_lost(
    tmp_path: Path, names: Names
) -> None:
    """A nats-server whose JetStream storage is full (``max_file_store`` reached) refuses the
    message that does not fit: the client gets ``452 4.3.1`` (RFC 5321 §4.2.3
    "insufficient system storage", RFC 3463 X.3.1 "mail system full"; Postfix says the
    same) rather than a generic local error, never a 250; the session stays usable; the
    refused message leaves no entry; every message answered 250 before is stored whole."""
    body = b"Subject: fill\r\n\r\n" + (b"y" * 70 + b"\r\n") * 4000  # ~290 KB
    await fill_until_refused(
        tmp_path, names, body, max_file_store="6MB", request_timeout_s=2.0, store_timeout_s=5.0
    )


async def test_a_body_chunk_refused_for_storage_is_452_at_once(
    tmp_path: Path, names: Names
) -> None:
    """A body of several object-store chunks on a nats-server out of storage: the chunk the
    server refuses (``insufficient resources``, the reply a full disk gets too) ends the put
    at once with ``452 4.3.1``; the refusal is not lost on the way, leaving the front end to
    wait for an ack that never comes and answer the generic ``451 4.3.0`` when its store
    timeout ends. Every message answered 250 before is stored whole."""
    body = b"Subject: fill\r\n\r\n" + (b"z" * 70 + b"\r\n") * 18000  # ~1.3 MB: 3 chunks
    # A store timeout well below the request timeout: only the refusal itself ends it soon.
    await fill_until_refused(
        tmp_path, names, body, max_file_store="8MB", request_timeout_s=30.0, store_timeout_s=4.0
    )


async def test_writes_refused_for_storage_are_not_retried(
    tmp_path: Path, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-server answers a publish over its JetStream limit ``503 insufficient
    resources`` (10023), the code its retryable unavailability has too. An entry or work
    item write refused so fails at its first try with :class:`StoreFull` (the front end's
    ``452 4.3.1``, RFC 5321 §4.2.3); it used to be retried for three request timeouts, so
    the session waited out its store timeout and got ``451 4.3.0`` instead."""
    conf = tmp_path / "small.conf"
    conf.write_text("listen: 127.0.0.1:4222\njetstream {\n  max_file_store: 8MB\n}\n")
    async with EmbeddedNats(tmp_path / "nats", port=0, config_file=conf) as srv:
        settings = make_settings(request_timeout_s=5.0, events_max_bytes=1 << 20)
        stores = await open_jetstream(settings, [srv.url], names=names)
        nc = await connect_nats(make_settings(), [srv.url])
        try:
            js = nc.jetstream()
            await js.add_stream(name="FILLER", subjects=["filler.>"])
            with pytest.raises(nats.js.errors.APIError) as refused:
                for i in range(100):
                    await js.publish(f"filler.{i}", b"f" * 100_000)
            assert is_storage_full(refused.value) and refused.value.code == 503
            caplog.set_level(logging.DEBUG, logger="jsqueue.store.jetstream")
            entry = make_entry(domain="dest.example.test")
            with pytest.raises(StoreFull):
                await stores.entries.create(entry)
            with pytest.raises(StoreFull):
                await stores.scheduler.schedule(WorkItem(entry.id, "dest.example.test"))
            assert not [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
        finally:
            await nc.close()
            await stores.close()
