"""TLS reporting (RFC 8460) and "every decision visible", through the whole queue: real
nats-server, the SMTP front end, workers, our DNS server, an HTTPS MTA-STS policy server and
an HTTPS report receiver with trustme certificates, scripted MXes. A day with both outcomes
under an MTA-STS testing policy is reported to an ``https:`` rua (POST) and a ``mailto:``
rua (a message queued and delivered by jsqueue itself); both validate against the JSON
schema of RFC 8460 §4.4. ``queue show``, the attempt log and the metrics say which policy
applied."""

from __future__ import annotations

import asyncio
import email
import email.policy
import gzip
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp import web

from jsqueue.admin import Admin
from jsqueue.cli.render import render_detail
from jsqueue.config import NatsSettings, Settings, TlsReportSettings
from jsqueue.delivery.policy.reporting import SentReport, TlsReporter, _report_once, report_loop
from jsqueue.delivery.policy.tlsrpt import build_report, parse_rua, sessions_by_domain
from jsqueue.envelope import Entry, Recipient
from jsqueue.events import EventKind, Fanout, open_publisher, recipient_event
from jsqueue.metrics import Metrics
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.replies import Reply, TlsNote
from jsqueue.store.base import Stores
from support.mx import Certs, ScriptedMx
from support.queue import Harness, eventually

MX = "127.0.2.21"
REPORT_MX = "127.0.2.22"
POLICY_HOST = "127.0.2.162"
RECEIVER_HOST = "127.0.2.163"
MX_NAME = "mx.strict.example.test"
MESSAGE = b"From: a@example.test\r\nTo: user@strict.example.test\r\nSubject: t\r\n\r\nbody\r\n"

#: RFC 8460 §4.4 (fields, types, required members) and §4.3 (result types) as JSON Schema.
RESULT_TYPES = [
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
]
COUNT = {"type": "integer", "minimum": 0}
STAMP = {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["organization-name", "date-range", "contact-info", "report-id", "policies"],
    "properties": {
        "organization-name": {"type": "string"},
        "contact-info": {"type": "string"},
        "report-id": {"type": "string"},
        "date-range": {
            "type": "object",
            "required": ["start-datetime", "end-datetime"],
            "properties": {"start-datetime": STAMP, "end-datetime": STAMP},
        },
        "policies": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["policy", "summary"],
                "properties": {
                    "policy": {
                        "type": "object",
                        "required": ["policy-type", "policy-domain"],
                        "properties": {
                            "policy-type": {"enum": ["tlsa", "sts", "no-policy-found"]},
                            "policy-string": {"type": "array", "items": {"type": "string"}},
                            "policy-domain": {"type": "string"},
                            "mx-host": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    "summary": {
                        "type": "object",
                        "required": [
                            "total-successful-session-count",
                            "total-failure-session-count",
                        ],
                        "properties": {
                            "total-successful-session-count": COUNT,
                            "total-failure-session-count": COUNT,
                        },
                    },
                    "failure-details": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["result-type", "failed-session-count"],
                            "properties": {
                                "result-type": {"enum": RESULT_TYPES},
                                "sending-mta-ip": {"type": "string"},
                                "receiving-mx-hostname": {"type": "string"},
                                "receiving-mx-helo": {"type": "string"},
                                "receiving-ip": {"type": "string"},
                                "failed-session-count": COUNT,
                                "additional-information": {"type": "string"},
                                "failure-reason-code": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}


def policy(mode: str, mx: str = MX_NAME) -> str:
    return f"version: STSv1\r\nmode: {mode}\r\nmx: {mx}\r\nmax_age: 86400\r\n"


class Https:
    """An HTTPS server on loopback: serves the MTA-STS policy and takes report POSTs."""

    def __init__(self, certs: Certs, host: str, name: str) -> None:
        self.host = host
        self.context = certs.server_context(name)
        self.policy = policy("testing")
        self.posts: list[tuple[str, bytes]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _policy(self, request: web.Request) -> web.Response:
        return web.Response(text=self.policy, content_type="text/plain")

    async def _report(self, request: web.Request) -> web.Response:
        self.posts.append((request.headers.get("Content-Type", ""), await request.read()))
        return web.Response(status=201)

    async def start(self) -> Https:
        app = web.Application()
        app.router.add_get("/.well-known/mta-sts.txt", self._policy)
        app.router.add_post("/v1/tlsrpt", self._report)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=self.context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def https(tmp_path: Path) -> AsyncIterator[tuple[Certs, Https, Https]]:
    certs = Certs()
    policy_server = await Https(certs, POLICY_HOST, "mta-sts.strict.example.test").start()
    receiver = await Https(certs, RECEIVER_HOST, "reports.example.test").start()
    try:
        yield certs, policy_server, receiver
    finally:
        await policy_server.stop()
        await receiver.stop()


def set_up(h: Harness, certs: Certs, policy_server: Https, receiver: Https, tmp: Path) -> None:
    ca = certs.ca_file(tmp)
    rua = (
        f"mailto:tlsrpt@reports.example.test,https://reports.example.test:{receiver.port}/v1/tlsrpt"
    )
    h.dns.add(
        f"""
        strict.example.test. 300 IN MX 10 {MX_NAME}.
        {MX_NAME}. 300 IN A {MX}
        _mta-sts.strict.example.test. 300 IN TXT "v=STSv1; id=1;"
        mta-sts.strict.example.test. 300 IN A {POLICY_HOST}
        _smtp._tls.strict.example.test. 300 IN TXT "v=TLSRPTv1; rua={rua}"
        reports.example.test. 300 IN A {RECEIVER_HOST}
        reports.example.test. 300 IN MX 10 mx.reports.example.test.
        mx.reports.example.test. 300 IN A {REPORT_MX}
        """
    )
    report = TlsReportSettings(enabled=True, organization="jsqueue-test", https_ca_file=ca)
    h.configure(
        outbound_tls={"mta_sts_port": policy_server.port, "mta_sts_ca_file": ca, "report": report}
    )


def validate(report: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(report, SCHEMA)
    assert len(report["policies"]) == 1, json.dumps(report["policies"])
    (item,) = report["policies"]
    return item


async def test_day_with_both_outcomes_reported_by_https_and_mailto(
    queue_harness: Harness,
    nats_server: EmbeddedNats,
    https: tuple[Certs, Https, Https],
    tmp_path: Path,
) -> None:
    """RFC 8460 §4-§5: MTA-STS testing, one session with a valid certificate and one with
    an untrusted one (both delivered, RFC 8461 §5); the day's report has one success and
    one ``certificate-not-trusted`` failure, is POSTed gzipped to the https rua and mailed
    through the queue to the mailto rua; both copies validate against the schema."""
    h = queue_harness
    certs, policy_server, receiver = https
    set_up(h, certs, policy_server, receiver, tmp_path)
    h.configure(worker={"connection_cache_s": 0.0})  # two sessions, not one reused
    good = certs.server_context(MX_NAME)
    async with (
        open_publisher(h.settings.nats, [nats_server.url]) as publisher,
        ScriptedMx(MX, h.mx_port, name=MX_NAME, tls=good) as mx,
        ScriptedMx(REPORT_MX, h.mx_port, name="mx.reports.example.test") as report_mx,
        h.running(h.worker(observer=publisher)),
    ):
        first = await h.submit(MESSAGE, ["user@strict.example.test"])
        await eventually(lambda: len(mx.delivered) == 1, what="first delivery")
        mx.tls = certs.server_context(MX_NAME, untrusted=True)
        second = await h.submit(MESSAGE, ["user@strict.example.test"])
        await eventually(lambda: len(mx.delivered) == 2, what="second delivery")
        for queue_id in (first, second):  # settled: its attempt's events are published

            async def gone(q: str = queue_id) -> bool:
                return await h.entry(q) is None

            await eventually(gone, what="the message settled")
        await publisher.flush()
        host, port = h.frontend.address  # type: ignore[union-attr]
        reporter = TlsReporter(
            h.settings, [nats_server.url], h.stores, submit_host=host, submit_port=port
        )
        sent = await reporter.report_day(datetime.now(UTC).date())
        await eventually(lambda: len(report_mx.delivered) == 1, what="mailed report")
    assert {s.uri.split(":")[0] for s in sent} == {"mailto", "https"}
    assert all(s.ok for s in sent), sent
    ((ctype, body),) = receiver.posts
    assert ctype == "application/tlsrpt+gzip"
    item = validate(json.loads(gzip.decompress(body)))
    assert item["policy"]["policy-type"] == "sts"
    assert item["policy"]["mx-host"] == [MX_NAME]
    assert item["policy"]["policy-string"][0] == "version: STSv1"
    assert item["summary"] == {
        "total-successful-session-count": 1,
        "total-failure-session-count": 1,
    }
    (failure,) = item["failure-details"]
    assert failure["result-type"] == "certificate-not-trusted"
    assert failure["receiving-mx-hostname"] == MX_NAME
    raw = report_mx.delivered[0].content
    assert raw is not None
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg.get_content_type() == "multipart/report"
    assert msg.get_param("report-type") == "tlsrpt"
    assert msg["TLS-Report-Domain"] == "strict.example.test"
    (attachment,) = [p for p in msg.iter_attachments()]
    assert attachment.get_content_type() == "application/tlsrpt+gzip"
    assert attachment.get_filename().startswith("jsqueue-test!strict.example.test!")
    mailed = validate(json.loads(gzip.decompress(attachment.get_content())))
    assert mailed["summary"] == item["summary"]


async def test_queue_show_log_and_metrics_say_which_policy(
    queue_harness: Harness,
    https: tuple[Certs, Https, Https],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every decision visible: an MX outside an enforced MTA-STS policy is deferred 4.7.5
    and ``queue show``, the attempt log line and the metrics name ``mta-sts enforce`` and
    why; the MX sees no connection."""
    h = queue_harness
    certs, policy_server, receiver = https
    set_up(h, certs, policy_server, receiver, tmp_path)
    policy_server.policy = policy("enforce", mx="*.elsewhere.example.test")
    metrics = Metrics()
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    async with (
        ScriptedMx(MX, h.mx_port, name=MX_NAME, tls=certs.server_context(MX_NAME)) as mx,
        h.running(h.worker(observer=Fanout(metrics))),
    ):
        queue_id = await h.submit(MESSAGE, ["user@strict.example.test"])

        async def deferred() -> bool:
            entry = await h.entry(queue_id)
            return entry is not None and entry.recipients[0].attempts >= 1

        await eventually(deferred, what="a deferred attempt")
    assert mx.connections == 0
    shown = "\n".join(render_detail(await Admin(h.stores).show(queue_id)))
    assert "4.7.5" in shown
    assert "tls:     mta-sts enforce: no TLS; MTA-STS policy 1" in shown
    assert "matches no mx pattern" in shown
    lines = [r.getMessage() for r in caplog.records if "outcome=deferred" in r.getMessage()]
    assert lines and "tls='mta-sts enforce: no TLS" in lines[0]
    value = metrics.registry.get_sample_value(
        "jsqueue_delivery_tls_total",
        {"policy": "mta-sts enforce", "result": "validation-failure", "tls": "no"},
    )
    assert value is not None and value >= 1


def test_report_of_synthetic_events_and_rua_parsing() -> None:
    """RFC 8460 §3 rua parsing; §4.4 aggregation: one attempt of two recipients counts its
    sessions once; earlier failed sessions of an attempt count as failures; manual
    sessions are not reported."""
    assert parse_rua(["v=TLSRPTv1; rua=mailto:a@example.test,https://r.example.test/x"]) == [
        "mailto:a@example.test",
        "https://r.example.test/x",
    ]
    assert parse_rua(["v=TLSRPTv1; rua=mailto:a@x.test", "v=TLSRPTv1; rua=mailto:b@x.test"]) == []
    assert parse_rua(["v=spf1 -all"]) == []
    at = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    failed = TlsNote(policy="dane", result="validation-failure", detail="no match", mx="mx1.d.test")
    ok = TlsNote(policy="dane", result="success", tls=True, mx="mx2.d.test", earlier=(failed,))
    manual = TlsNote(policy="manual", result="none", tls=True, mx="mx.m.test")
    reply = Reply(code=250, enhanced="2.0.0", text="ok", tls=ok)
    entry = Entry.model_validate(
        {
            "id": "q1",
            "reverse_path": "a@example.test",
            "recipients": [
                Recipient.from_address("x@d.test").model_dump(),
                Recipient.from_address("y@d.test").model_dump(),
                Recipient.from_address("z@m.test").model_dump(),
            ],
            "size": 10,
            "created_at": at,
        }
    )
    events = [
        recipient_event(EventKind.DELIVERED, entry, r, source="t", at=at, reply=reply)
        for r in entry.recipients[:2]
    ]
    events.append(
        recipient_event(
            EventKind.DELIVERED,
            entry,
            entry.recipients[2],
            source="t",
            at=at,
            reply=Reply(code=250, text="ok", tls=manual),
        )
    )
    day_start, day_end = datetime(2026, 12, 1, tzinfo=UTC), datetime(2026, 12, 2, tzinfo=UTC)
    found = sessions_by_domain(events, day_start, day_end)
    assert set(found) == {"d.test"} and len(found["d.test"]) == 2
    report = build_report(
        "d.test", found["d.test"], date(2026, 12, 1), organization="o", contact="c@o.test"
    )
    item = validate(report)
    assert item["policy"]["policy-type"] == "tlsa"
    assert item["summary"]["total-successful-session-count"] == 1
    assert item["failure-details"][0]["receiving-mx-hostname"] == "mx1.d.test"
    assert report["date-range"]["start-datetime"] == "2026-12-01T00:00:00Z"


async def test_yesterday_is_reported_once_across_workers(
    js_stores: Stores, nats_server: EmbeddedNats, nats_settings: NatsSettings, names: Names
) -> None:
    """The daily task: whichever worker checks first (under the ``tls-report`` lock)
    reports yesterday and leaves a mark in the policy bucket; later checks, by it or by
    another worker, send nothing; the loop ends when asked to stop."""
    calls: list[date] = []

    class Counting(TlsReporter):
        async def report_day(self, day: date, events: object = None) -> list[SentReport]:
            calls.append(day)
            return []

    settings = Settings(nats=nats_settings.model_copy(update={"prefix": names.prefix}))
    one = Counting(settings, [nats_server.url], js_stores)
    two = Counting(settings, [nats_server.url], js_stores)
    for reporter in (one, two, one):
        await _report_once(reporter, js_stores)
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date()
    assert calls == [yesterday]
    assert js_stores.policies is not None
    assert await js_stores.policies.get(f"tlsrpt-{yesterday.isoformat()}") is not None
    stop = asyncio.Event()
    loop = asyncio.create_task(report_loop(two, js_stores, stop))
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert calls == [yesterday]
