"""The HTTP API over real HTTP on loopback against a real nats-server: authentication and
roles, the queue routes through the admin operations, injection through the ingest path."""

from __future__ import annotations

import base64
import json

from jsqueue.envelope import EntryState
from jsqueue.events import EventKind, tail
from jsqueue.names import slot_key
from support.api import ApiEnv
from support.nats import make_entry, read_body

RAW = (
    b"From: Alice <alice@example.org>\r\n"
    b"To: bob@example.net\r\n"
    b"Subject: over HTTP\r\n"
    b"Message-ID: <1@example.org>\r\n"
    b"\r\n"
    b"Hello Bob.\r\n"
    b".leading dot stays\r\n"
)


def raw_body(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "reverse_path": "alice@example.org",
        "recipients": [{"address": "bob@example.net", "notify": ["FAILURE"]}],
        "raw_base64": base64.b64encode(RAW).decode(),
    }
    body.update(extra)
    return body


async def test_no_token_is_401_and_health_stays_anonymous(api_env: ApiEnv) -> None:
    status, body = await api_env.call("GET", "/api/v1/queue", role=None)
    assert status == 401 and body["error"] == "unauthorized"
    status, _ = await api_env.call(
        "GET", "/api/v1/queue", role=None, headers={"Authorization": "Bearer jsq_wrong"}
    )
    assert status == 401
    status, _ = await api_env.call("GET", "/api/openapi.json", role=None)
    assert status == 401
    for path in ("/healthz", "/metrics"):
        status, _ = await api_env.call("GET", path, role=None)
        assert status == 200


async def test_roles(api_env: ApiEnv) -> None:
    assert (await api_env.call("GET", "/api/v1/queue", role="read"))[0] == 200
    assert (await api_env.call("GET", "/api/v1/queue", role="admin"))[0] == 200  # implies read
    assert (await api_env.call("GET", "/api/v1/queue", role="inject"))[0] == 403
    status, body = await api_env.call(
        "POST", "/api/v1/actions/hold", role="read", json={"all": True}
    )
    assert status == 403 and "lacks role admin" in body["detail"]
    assert (await api_env.call("POST", "/api/v1/inject", role="admin", json=raw_body()))[0] == 403
    assert (await api_env.call("GET", "/api/v1/whoami", role="inject"))[1] == {
        "name": "t-inject",
        "role": "inject",
    }


async def test_inject_stores_as_smtp_does_and_actions_go_through_admin(api_env: ApiEnv) -> None:
    status, body = await api_env.call("POST", "/api/v1/inject", role="inject", json=raw_body())
    assert status == 202, body
    queue_id = body["queue_id"]
    stored = await read_body(api_env.stores, queue_id)
    received, found, _ = stored.partition(
        b"\r\n\tby relay.jsqueue.example.test (jsqueue) with HTTP"
    )
    assert found
    assert received.startswith(b"Received: from [127.0.0.1] ([127.0.0.1])")
    assert stored.endswith(RAW)
    status, detail = await api_env.call("GET", f"/api/v1/queue/{queue_id}", role="read")
    assert status == 200
    assert detail["reverse_path"] == "alice@example.org"
    assert detail["recipients"][0]["address"] == "bob@example.net"

    status, page = await api_env.call("GET", "/api/v1/queue?domain=example.net", role="read")
    assert status == 200 and [e["id"] for e in page["entries"]] == [queue_id]
    status, page = await api_env.call("GET", "/api/v1/queue?domain=example.com", role="read")
    assert status == 200 and page["entries"] == []

    status, result = await api_env.call("POST", f"/api/v1/queue/{queue_id}/hold")
    assert status == 200 and result["outcome"] == "done" and result["state"] == "held"
    entry = (await api_env.stores.entries.get(queue_id)).entry
    assert entry.state is EntryState.HELD
    status, bulk = await api_env.call(
        "POST", "/api/v1/actions/release", json={"filter": {"states": ["held"]}}
    )
    assert status == 200 and bulk["counts"] == {"done": 1}
    status, stats = await api_env.call("GET", "/api/v1/stats", role="read")
    assert status == 200 and stats["entries"] == 1

    events = tail(
        api_env.settings.nats,
        list(api_env.settings.nats.urls),
        from_start=True,
        until_end=True,
        queue_id=queue_id,
    )
    seen = [(e.kind, e.source) async for e in events]
    assert (EventKind.RECEIVED, "api:t-inject") in seen
    assert (EventKind.HELD, "api:t-admin") in seen
    assert (EventKind.RELEASED, "api:t-admin") in seen

    status, result = await api_env.call("POST", f"/api/v1/queue/{queue_id}/delete")
    assert status == 200 and result["outcome"] == "done"
    status, _ = await api_env.call("GET", f"/api/v1/queue/{queue_id}", role="read")
    assert status == 404
    status, _ = await api_env.call("POST", f"/api/v1/queue/{queue_id}/delete")
    assert status == 404


async def test_bulk_filter_without_a_condition_is_refused(api_env: ApiEnv) -> None:
    # A filter that says nothing matches every entry: "delete" would empty the queue. As
    # the CLI, every entry must be asked for as "all", never as an empty filter.
    kept = make_entry(domain="example.com")
    other = make_entry(domain="example.net")
    for e in (kept, other):
        await api_env.stores.entries.create(e)
    empty = {"states": None, "domain": None, "sender": None, "min_age_s": None, "max_age_s": None}
    for flt in ({}, empty, {"states": []}, {"sender": ""}):
        for action in ("delete", "bounce", "hold"):
            status, body = await api_env.call(
                "POST", f"/api/v1/actions/{action}", json={"filter": flt}
            )
            assert status == 422, (flt, action, body)
            assert "no condition" in body["detail"] and '"all"' in body["detail"], body
    for e in (kept, other):
        assert (await api_env.stores.entries.get(e.id)).entry.state is EntryState.PENDING
    status, bulk = await api_env.call(
        "POST", "/api/v1/actions/delete", json={"filter": {"domain": "example.net"}}
    )
    assert status == 200 and [r["queue_id"] for r in bulk["results"]] == [other.id], bulk
    assert (await api_env.stores.entries.get(kept.id)).entry.state is EntryState.PENDING


async def test_idempotency_key(api_env: ApiEnv) -> None:
    key = {"Idempotency-Key": "order-4711"}
    first = await api_env.call(
        "POST", "/api/v1/inject", role="inject", json=raw_body(), headers=key
    )
    again = await api_env.call(
        "POST", "/api/v1/inject", role="inject", json=raw_body(), headers=key
    )
    other = await api_env.call(
        "POST", "/api/v1/inject", role="inject", json=raw_body(), headers={"Idempotency-Key": "x"}
    )
    assert first[0] == again[0] == other[0] == 202
    assert again[1]["queue_id"] == first[1]["queue_id"] and again[1]["duplicate"] is True
    assert other[1]["queue_id"] != first[1]["queue_id"]
    status, page = await api_env.call("GET", "/api/v1/queue", role="read")
    assert status == 200 and len(page["entries"]) == 2


async def test_openapi_document(api_env: ApiEnv) -> None:
    status, doc = await api_env.call("GET", "/api/openapi.json", role="inject")
    assert status == 200 and doc["openapi"] == "3.1.0"
    assert "/api/v1/inject" in doc["paths"] and "InjectBody" in doc["components"]["schemas"]


async def test_destinations_as_dest_ls_and_dest_show(api_env: ApiEnv) -> None:
    """``GET /api/v1/destinations`` and ``/destinations/{site}`` read the destinations bucket
    as ``jsqueue dest ls`` / ``dest show`` do (role read; an inject token gets 403)."""
    store = api_env.stores.destinations
    assert store is not None
    for n, owner in enumerate(("w-one", "w-one", "w-two")):
        value: dict[str, object] = {"owner": owner, "at": 0.0}
        assert await store.put(slot_key("busy.example.test", n), value, revision=0, ttl_s=60)
    status, body = await api_env.call("GET", "/api/v1/destinations?queued=false", role="read")
    assert status == 200, body
    sites = {s["site"]: s for s in body["sites"]}
    busy = sites["busy.example.test"]
    assert busy["sessions"] == 3 and busy["status"] == "up" and busy["queued"] is None
    assert busy["limit"] == api_env.settings.destinations.sessions_of("busy.example.test")
    status, one = await api_env.call("GET", "/api/v1/destinations/busy.example.test", role="read")
    assert status == 200 and one["holders"] == {"w-one": 2, "w-two": 1} and one["queued"] == 0
    status, quiet = await api_env.call("GET", "/api/v1/destinations/quiet.example.test")
    assert status == 200 and quiet["sessions"] == 0 and quiet["status"] == "up"
    assert (await api_env.call("GET", "/api/v1/destinations", role="inject"))[0] == 403
    assert (await api_env.call("GET", "/api/v1/destinations/a b", role="read"))[0] == 422


async def test_a_body_declared_as_something_other_than_json_is_415(api_env: ApiEnv) -> None:
    """RFC 9110 §15.5.16, §8.3: a request body whose Content-Type says it is not JSON (a
    form, text, XML, multipart, or JSON in a charset other than UTF-8, RFC 8259 §8.1) is
    refused with 415 naming ``application/json`` (and ``Accept: application/json``), even
    when its octets happen to parse as JSON, and nothing is stored; ``application/json``
    with or without ``charset=utf-8``, a ``+json`` type, or no Content-Type at all is
    read as JSON."""
    payload = json.dumps(raw_body()).encode()
    for wrong in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
        "application/json; charset=iso-8859-1",
        "application/jsonx",
    ):
        status, err = await api_env.call(
            "POST",
            "/api/v1/inject",
            role="inject",
            data=payload,
            headers={"Content-Type": wrong},
        )
        assert status == 415, (wrong, status, err)
        assert err["error"] == "unsupported media type"
        assert "application/json" in err["detail"] and wrong.split(";")[0] in err["detail"]
        status, err = await api_env.call(
            "POST", "/api/v1/actions/hold", data=b'{"all": true}', headers={"Content-Type": wrong}
        )
        assert status == 415, (wrong, status, err)
    async with api_env.session.post(
        api_env.url + "/api/v1/inject",
        data=payload,
        headers={**api_env.auth("inject"), "Content-Type": "text/plain"},
    ) as r:
        assert r.headers.get("Accept") == "application/json"
    assert await api_env.stores.entries.page() == []
    for right in ("application/json", "Application/JSON; charset=UTF-8", "application/x+json"):
        status, body = await api_env.call(
            "POST", "/api/v1/inject", role="inject", data=payload, headers={"Content-Type": right}
        )
        assert status == 202, (right, body)
    async with api_env.session.post(
        api_env.url + "/api/v1/inject",
        data=payload,
        headers=api_env.auth("inject"),
        skip_auto_headers=["Content-Type"],  # none at all: read as JSON (RFC 9110 §8.3)
    ) as r:
        assert r.status == 202, await r.text()
    assert len(await api_env.stores.entries.page()) == 4
