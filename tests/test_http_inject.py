"""HTTP injection end to end: a message injected over HTTP is delivered byte for byte (after
the trace field) to a scripted MX; retried POSTs with the same Idempotency-Key are stored
once, also when they race; NATS down answers 503, never 202. The events stream as
server-sent events. Real nats-server, DNS server, MX and HTTP on loopback."""

from __future__ import annotations

import asyncio
import base64
import email
import email.policy
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from jsqueue.config import ApiSettings, HttpSettings
from jsqueue.nats_server import EmbeddedNats
from support.api import ApiEnv, make_tokens, serve_api
from support.mx import ScriptedMx
from support.queue import Harness, eventually

ZONE = """
dest.example.test.      300 IN MX 10 mx.dest.example.test.
mx.dest.example.test.   300 IN A  127.0.2.80
"""
MESSAGE = (
    b"From: App <app@example.test>\r\n"
    b"To: Bob <bob@dest.example.test>\r\n"
    b"Subject: byte for byte\r\n"
    b"Date: Tue, 01 Dec 2026 10:00:00 +0000\r\n"
    b"Message-ID: <inject-1@example.test>\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Transfer-Encoding: 8bit\r\n"
    b"\r\n"
    b".a line with a leading dot\r\n"
    b"Gr\xc3\xbc\xc3\x9fe, trailing spaces   \r\n"
    b"\r\n"
    b"..\r\n"
)


@pytest.fixture
async def api_harness(
    queue_harness: Harness, nats_server: EmbeddedNats, tmp_path: Path
) -> AsyncIterator[tuple[Harness, ApiEnv]]:
    """The queue harness with the API served over its stores."""
    h = queue_harness
    tokens = make_tokens(tmp_path / "tokens")
    settings = h.settings.model_copy(
        update={
            "nats": h.settings.nats.model_copy(
                update={"urls": [nats_server.url], "request_timeout_s": 2.0}
            ),
            "http": HttpSettings(port=0, queue_depth_interval_s=0),
            "smtp": h.settings.smtp.model_copy(update={"store_timeout_s": 3.0}),
            "api": ApiSettings(tokens_file=tmp_path / "tokens"),
        }
    )
    h.settings = settings
    async with serve_api(settings, h.stores) as url, aiohttp.ClientSession() as session:
        yield h, ApiEnv(url, tokens, settings, h.stores, session)


async def _gone(h: Harness, queue_id: str) -> bool:
    return await h.entry(queue_id) is None


def body(**extra: object) -> dict[str, object]:
    out: dict[str, object] = {
        "reverse_path": "app@example.test",
        "recipients": [
            {
                "address": "bob@dest.example.test",
                "notify": ["SUCCESS", "FAILURE"],
                "orcpt": "rfc822;bob@dest.example.test",
            }
        ],
        "envid": "order 4711",
        "ret": "HDRS",
        "raw_base64": base64.b64encode(MESSAGE).decode(),
    }
    out.update(extra)
    return out


async def test_injected_message_is_delivered_byte_exact(
    api_harness: tuple[Harness, ApiEnv],
) -> None:
    h, api = api_harness
    h.dns.add(ZONE)
    key = {"Idempotency-Key": "welcome-mail/42"}
    async with ScriptedMx("127.0.2.80", h.mx_port, extensions=["8BITMIME", "DSN"]) as mx:
        status, result = await api.call(
            "POST", "/api/v1/inject", role="inject", json=body(), headers=key
        )
        assert status == 202, result
        queue_id = result["queue_id"]
        async with h.running():
            await eventually(lambda: len(mx.delivered) == 1, what="delivery")
            await eventually(lambda: _gone(h, queue_id), what="entry removed")
            # a retry after the message was delivered and removed: the same id, no mail
            status, again = await api.call(
                "POST", "/api/v1/inject", role="inject", json=body(), headers=key
            )
            assert status == 202 and again == {**result, "duplicate": True}
            # (a new copy would have a new queue id; this one's entry stays gone)
            assert await h.entry(queue_id) is None
    assert len(mx.delivered) == 1
    tx = mx.delivered[0]
    assert tx.mail_from == "app@example.test"
    assert tx.rcpt_to == ["bob@dest.example.test"]
    assert "ENVID=order+204711" in tx.mail_params and "RET=HDRS" in tx.mail_params
    assert "BODY=8BITMIME" in tx.mail_params
    assert sorted(tx.rcpt_params["bob@dest.example.test"]) == [
        "NOTIFY=SUCCESS,FAILURE",
        "ORCPT=rfc822;bob@dest.example.test",
    ]
    assert tx.content is not None
    trace, sep, rest = tx.content.partition(b"\r\n\tby relay.jsqueue.example.test (jsqueue)")
    assert sep and trace == b"Received: from [127.0.0.1] ([127.0.0.1])"
    assert rest.startswith(f" with HTTP id {queue_id}\r\n\tfor <bob@dest.example.test>;".encode())
    # the trace field is one folded field; what follows it is the message as given
    assert tx.content.split(b"\r\n", 4)[4] == MESSAGE


async def test_built_message(api_harness: tuple[Harness, ApiEnv]) -> None:
    h, api = api_harness
    h.dns.add(ZONE)
    built = {
        "message": {
            "from": "App <app@example.test>",
            "to": ["Bob <bob@dest.example.test>"],
            "bcc": ["carol@dest.example.test"],
            "subject": "Grüße",
            "text": "plain part\n",
            "html": "<p>html part</p>",
            "attachments": [
                {
                    "filename": "a.bin",
                    "content_type": "application/octet-stream",
                    "content_base64": base64.b64encode(bytes(range(256))).decode(),
                }
            ],
        }
    }
    async with ScriptedMx("127.0.2.80", h.mx_port) as mx:
        status, result = await api.call("POST", "/api/v1/inject", role="inject", json=built)
        assert status == 202, result
        assert result["recipients"] == 2
        async with h.running():
            await eventually(lambda: len(mx.delivered) == 1, what="delivery")
    tx = mx.delivered[0]
    assert sorted(tx.rcpt_to) == ["bob@dest.example.test", "carol@dest.example.test"]
    assert tx.mail_from == "app@example.test"
    assert tx.content is not None
    msg = email.message_from_bytes(tx.content, policy=email.policy.default)
    assert msg["Subject"] == "Grüße" and msg["Bcc"] is None and msg["Message-ID"]
    parts = {p.get_content_type(): p for p in msg.walk()}
    assert parts["text/plain"].get_content() == "plain part\r\n"  # CRLF on the wire
    assert parts["application/octet-stream"].get_content() == bytes(range(256))


async def test_retries_with_one_key_are_stored_once(api_harness: tuple[Harness, ApiEnv]) -> None:
    _, api = api_harness
    key = {"Idempotency-Key": "batch-7/message-1"}
    results = await asyncio.gather(
        *(
            api.call("POST", "/api/v1/inject", role="inject", json=body(), headers=key)
            for _ in range(5)
        )
    )
    assert {status for status, _ in results} == {202}
    ids = {r["queue_id"] for _, r in results}
    assert len(ids) == 1
    assert sum(not r["duplicate"] for _, r in results) == 1
    status, page = await api.call("GET", "/api/v1/queue", role="read")
    assert [e["id"] for e in page["entries"]] == list(ids)
    # a different key is a different message, even with the same content
    status, other = await api.call(
        "POST", "/api/v1/inject", role="inject", json=body(), headers={"Idempotency-Key": "2"}
    )
    assert status == 202 and other["queue_id"] not in ids
    # and without a key, every POST is a message of its own
    first = await api.call("POST", "/api/v1/inject", role="inject", json=body())
    second = await api.call("POST", "/api/v1/inject", role="inject", json=body())
    assert first[1]["queue_id"] != second[1]["queue_id"]


async def test_one_key_with_a_different_request_is_refused(
    api_harness: tuple[Harness, ApiEnv],
) -> None:
    """An Idempotency-Key reused for another request (other recipients or content) is
    422 and stores nothing, never a 202 "duplicate" naming the first message (which would
    drop the second silently); the same request again still gets the first id."""
    _, api = api_harness
    key = {"Idempotency-Key": "invoice-4711"}
    status, first = await api.call(
        "POST", "/api/v1/inject", role="inject", json=body(), headers=key
    )
    assert status == 202 and not first["duplicate"]
    other = body(recipients=[{"address": "carol@dest.example.test"}])
    status, refused = await api.call(
        "POST", "/api/v1/inject", role="inject", json=other, headers=key
    )
    assert status == 422, refused
    assert "Idempotency-Key" in refused["detail"]
    status, again = await api.call(
        "POST", "/api/v1/inject", role="inject", json=body(), headers=key
    )
    assert status == 202 and again["duplicate"] and again["queue_id"] == first["queue_id"]
    status, page = await api.call("GET", "/api/v1/queue", role="read")
    assert {e["id"] for e in page["entries"]} <= {first["queue_id"]}, page


async def test_two_idempotency_keys_are_refused(api_harness: tuple[Harness, ApiEnv]) -> None:
    """Idempotency-Key is a single value (draft-ietf-httpapi-idempotency-key-header §2): a
    request with two such fields is 400 and stores nothing, rather than deduplicated under
    one of them (a client's retry with the other order would be stored twice)."""
    _, api = api_harness
    headers = [("Idempotency-Key", "a-1"), ("Idempotency-Key", "b-2"), *api.auth("inject").items()]
    async with api.session.post(api.url + "/api/v1/inject", json=body(), headers=headers) as r:
        status, refused = r.status, await r.json()
    assert status == 400, refused
    assert "one header, not 2" in refused["detail"]
    status, page = await api.call("GET", "/api/v1/queue", role="read")
    assert page["entries"] == []


async def test_limits_as_at_the_smtp_front_end(api_harness: tuple[Harness, ApiEnv]) -> None:
    """The front end's limits hold for the API too: size (413), recipients, addresses, bare
    CR, line length, DSN parameters and more Received: fields than smtp.max_received
    (422); nothing refused is stored."""
    h, api = api_harness
    limit = h.settings.smtp.max_message_size
    big = base64.b64encode(b"Subject: big\r\n\r\n" + b"x" * 900 + b"\r\n" * (limit // 2))
    status, err = await api.call(
        "POST", "/api/v1/inject", role="inject", json=body(raw_base64=big.decode())
    )
    assert status == 413 and err["error"] == "too large"
    many = [{"address": f"r{i}@dest.example.test"} for i in range(1001)]
    status, err = await api.call(
        "POST", "/api/v1/inject", role="inject", json=body(recipients=many)
    )
    assert status == 422 and "at most 1000" in err["detail"]
    for bad, why in [
        ({"recipients": [{"address": "no-at-sign"}]}, "not a mailbox"),
        ({"raw": "Subject: x\r\rbare CR\r\n", "raw_base64": None}, "bare CR"),
        ({"raw": "x" * 1000 + "\r\n", "raw_base64": None}, "at most 998"),
        # a mail loop, as the SMTP front end finds it (RFC 5321 §6.3)
        ({"raw": "Received: x\r\n" * 101 + "\r\nx\r\n", "raw_base64": None}, "mail loop"),
        (
            {"recipients": [{"address": "b@dest.example.test", "notify": ["NEVER", "DELAY"]}]},
            "NEVER",
        ),
    ]:
        status, err = await api.call("POST", "/api/v1/inject", role="inject", json=body(**bad))
        assert status == 422 and why in err["detail"], (bad, err)
    status, page = await api.call("GET", "/api/v1/queue", role="read")
    assert page["entries"] == []  # nothing refused was stored


async def test_nats_down_is_503_never_202(
    api_harness: tuple[Harness, ApiEnv], nats_server: EmbeddedNats
) -> None:
    _, api = api_harness
    nats_server.kill()
    for key in (None, "k-1"):
        headers = {"Idempotency-Key": key} if key else {}
        status, err = await api.call(
            "POST", "/api/v1/inject", role="inject", json=body(), headers=headers
        )
        assert status == 503, err
        assert err["error"] == "unavailable"
        if key is None:  # the step that failed, not SMTP's "local error in processing"
            assert err["detail"].startswith("not queued: body failed"), err
    status, _ = await api.call("GET", "/api/v1/queue", role="read")
    assert status == 503
    status, _ = await api.call("POST", "/api/v1/actions/hold", json={"all": True})
    assert status == 503
    status, _ = await api.call("GET", "/api/v1/events", role="read")
    assert status == 503


async def test_events_as_server_sent_events(api_harness: tuple[Harness, ApiEnv]) -> None:
    _, api = api_harness
    status, result = await api.call("POST", "/api/v1/inject", role="inject", json=body())
    assert status == 202
    queue_id = result["queue_id"]
    assert (await api.call("POST", f"/api/v1/queue/{queue_id}/hold"))[0] == 200
    url = f"{api.url}/api/v1/events?from_start=true&until_end=true&queue_id={queue_id}"
    async with api.session.get(url, headers=api.auth("read")) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = (await r.read()).decode()
    frames = [f for f in text.split("\n\n") if f.startswith("id: ")]
    kinds = [f.split("\n")[1] for f in frames]
    assert kinds == ["event: received", "event: held"]
    held = json.loads(frames[1].split("\n")[2].removeprefix("data: "))
    assert held["source"] == "api:t-admin" and held["queue_id"] == queue_id
    # live: an event stored after the stream started arrives
    url = f"{api.url}/api/v1/events?queue_id={queue_id}"
    async with api.session.get(url, headers=api.auth("admin")) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")  # the opening comment: the consumer exists
        assert (await api.call("POST", f"/api/v1/queue/{queue_id}/release"))[0] == 200
        frame = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        while frame.startswith(b":"):
            frame = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
        assert b"event: released" in frame


async def test_one_key_across_two_api_processes(
    api_harness: tuple[Harness, ApiEnv], nats_server: EmbeddedNats
) -> None:
    """Two API endpoints on their own NATS connections (as two pods): retries with one key
    racing through both meet at the ingest log's claim and store one message."""
    from jsqueue.store.jetstream import open_jetstream

    _, api = api_harness
    other_stores = await open_jetstream(api.settings.nats, [nats_server.url])
    try:
        async with serve_api(api.settings, other_stores) as other_url:
            key = {"Idempotency-Key": "two-pods", **api.auth("inject")}
            urls = [api.url, other_url] * 4
            results = await asyncio.gather(
                *(api.session.post(u + "/api/v1/inject", json=body(), headers=key) for u in urls)
            )
            answers = [(r.status, await r.json()) for r in results]
    finally:
        await other_stores.close()
    assert {s for s, _ in answers} == {202}, answers
    assert len({a["queue_id"] for _, a in answers}) == 1
    assert sum(not a["duplicate"] for _, a in answers) == 1
    status, page = await api.call("GET", "/api/v1/queue", role="read")
    assert status == 200 and len(page["entries"]) == 1
