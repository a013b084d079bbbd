"""Metrics, health and logs: the HTTP endpoint scraped over loopback while a real queue
delivers, the probe's gauges, readiness, ``run_services`` wiring, and the JSON log line of
a delivery attempt."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_admin import DEST_ZONE, MESSAGE, RCPT, entry_at, store_all

from jsqueue.config import HttpSettings, LogSettings, NatsSettings, SmarthostSettings, SmtpSettings
from jsqueue.envelope import EntryState, RecipientState, WorkItem
from jsqueue.errors import ListenError
from jsqueue.frontend.server import SmtpServer
from jsqueue.health import Health, HttpServer
from jsqueue.logs import JsonFormatter
from jsqueue.metrics import Metrics, QueueProbe
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.pacing import Pacer
from jsqueue.runtime import run_services
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import open_jetstream
from support.frontend import FaultyStores, Wire, dot_stuff, frontend_settings, running
from support.mx import SmtpdMx
from support.nats import make_entry, wait_until
from support.queue import Harness, eventually


async def scrape(url: str) -> dict[str, float]:
    """GET /metrics and flatten it: ``name{label="v"}`` → value."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def test_metrics_endpoint_shows_counters_moving(queue_harness: Harness) -> None:
    """Scraped over HTTP: accepted and delivery-attempt counters and the duration histogram
    are 0 before and move after one message is deferred once and then delivered."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    metrics = Metrics()
    server = HttpServer(HttpSettings(port=0), metrics, Health())
    await server.start()
    try:
        before = await scrape(server.url)
        assert before["jsqueue_messages_accepted_total"] == 0
        assert before['jsqueue_delivery_attempts_total{outcome="delivered"}'] == 0
        async with SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 x"}) as mx:
            h.frontend = SmtpServer(h.settings.smtp, h.stores, metrics)
            await h.frontend.start()
            qid = await h.submit(MESSAGE, [RCPT])
            async with h.running(h.worker(observer=metrics)):

                async def deferred_once() -> bool:  # (not the connection: its RCPT may be ahead)
                    e = await h.entry(qid)
                    return e is not None and e.recipients[0].attempts == 1

                await eventually(deferred_once, what="first attempt recorded")
                mx.rcpt_replies.clear()
                await eventually(lambda: len(mx.delivered) == 1, what="delivered")

                async def delivered_counted() -> bool:  # counted just after the record
                    got = await scrape(server.url)
                    return got['jsqueue_delivery_attempts_total{outcome="delivered"}'] == 1

                await eventually(delivered_counted, what="the delivery counted")
        after = await scrape(server.url)
    finally:
        await server.stop()
    assert after["jsqueue_messages_accepted_total"] == 1
    assert after["jsqueue_accepted_recipients_total"] == 1
    assert after["jsqueue_accepted_bytes_total"] > len(MESSAGE)
    assert after['jsqueue_delivery_attempts_total{outcome="deferred"}'] == 1
    assert after['jsqueue_delivery_attempts_total{outcome="delivered"}'] == 1
    assert after['jsqueue_delivery_attempts_total{outcome="bounced"}'] == 0
    assert after['jsqueue_delivery_duration_seconds_count{outcome="delivered"}'] == 1
    assert after['jsqueue_state_changes_total{kind="received"}'] == 1


async def test_probe_readiness_and_gauges(js_stores: Stores) -> None:
    """The probe sets the backlog and NATS gauges and the ``nats`` readiness; the depth scan
    sets entries per state; /healthz is 200 throughout, /readyz only when all is ready."""
    entries = [
        entry_at(3, "a.example.test"),
        entry_at(2, "a.example.test", RecipientState.DEFERRED),
        entry_at(1, "a.example.test", held_=True),
    ]
    await store_all(js_stores, entries)
    await js_stores.scheduler.schedule(WorkItem(entries[0].id, "a.example.test", 0))
    metrics, health = Metrics(), Health()
    health.require("nats", "worker")
    probe = QueueProbe(js_stores, metrics, on_health=lambda ok: health.set("nats", ok))
    server = HttpServer(HttpSettings(port=0), metrics, health)
    await server.start()
    try:
        assert (await get(server.url + "/healthz"))[0] == 200
        status, body = await get(server.url + "/readyz")
        assert status == 503
        assert json.loads(body) == {"ready": False, "components": {"nats": False, "worker": False}}
        assert await probe.probe() and await probe.scan_depth()
        health.set("worker", True)
        assert (await get(server.url + "/readyz"))[0] == 200
        values = await scrape(server.url)
        assert values["jsqueue_nats_connected"] == 1
        assert values["jsqueue_work_backlog_items"] == 1
        assert values['jsqueue_queue_entries{state="pending"}'] == 1
        assert values['jsqueue_queue_entries{state="deferred"}'] == 1
        assert values['jsqueue_queue_entries{state="held"}'] == 1
        assert values['jsqueue_queue_entries{state="done"}'] == 0
        health.stopping()
        assert (await get(server.url + "/readyz"))[0] == 503
        assert (await get(server.url + "/healthz"))[0] == 200
    finally:
        await server.stop()


async def test_probe_reports_nats_loss(
    js_stores: Stores, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """With the nats-server gone the probe fails within its bound: gauge 0, not ready,
    and one warning that says why (a timeout has no text of its own)."""
    metrics, health = Metrics(), Health()
    probe = QueueProbe(
        js_stores, metrics, probe_interval_s=1.0, on_health=lambda ok: health.set("nats", ok)
    )
    assert await probe.probe() and health.ready
    nats_server.kill()
    assert not await probe.probe()
    assert not health.ready
    assert metrics.registry.get_sample_value("jsqueue_nats_connected") == 0
    [line] = [r.getMessage() for r in caplog.records if "NATS probe failed" in r.getMessage()]
    assert line.split("NATS probe failed: ", 1)[1].strip(), line


async def test_run_services_serves_health_and_metrics(
    nats_server: EmbeddedNats,
    nats_settings: NatsSettings,
    names: Names,
    queue_harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The runtime wires it together: front end, worker, probe and HTTP endpoint; ready
    once NATS answered, and it shuts down cleanly when stopped."""
    caplog.set_level(logging.INFO, logger="jsqueue")
    settings = queue_harness.settings.model_copy(
        update={
            "nats": nats_settings.model_copy(
                update={"urls": [nats_server.url], "prefix": names.prefix}
            ),
            "http": HttpSettings(port=0, probe_interval_s=0.2, queue_depth_interval_s=0.5),
        }
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_services(settings, stop, smtp=True, worker=True, embedded=False))

    def http_url() -> str | None:
        for record in caplog.records:
            m = re.search(r"HTTP endpoint on (http://\S+)/metrics", record.getMessage())
            if m:
                return m.group(1)
        return None

    try:
        await eventually(lambda: http_url() is not None or task.done(), what="HTTP endpoint")
        url = http_url()
        assert url is not None, task

        async def is_ready() -> bool:
            return (await get(url + "/readyz"))[0] == 200

        await eventually(is_ready, what="ready")
        values = await scrape(url)
        assert values["jsqueue_nats_connected"] == 1
        assert "jsqueue_events_published_total" in values

        async def scanned() -> bool:
            return (await scrape(url)).get("jsqueue_queue_scan_timestamp_seconds", 0) > 0

        await eventually(scanned, what="depth scan")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert task.exception() is None


async def test_attempt_log_line_as_json(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """One log line per delivery attempt and recipient; as JSON (log.json_format) it carries
    the queue id, recipient, outcome, MX, reply, attempts and delays as fields."""
    h = queue_harness
    h.dns.add(DEST_ZONE)
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    async with SmtpdMx("127.0.2.20", h.mx_port) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running():
            await eventually(lambda: len(mx.delivered) == 1, what="delivered")
    lines = [r for r in caplog.records if getattr(r, "outcome", None) == "delivered"]
    assert len(lines) == 1
    data = json.loads(JsonFormatter().format(lines[0]))
    assert data["level"] == "INFO" and data["logger"] == "jsqueue.worker"
    assert data["queue_id"] == qid and data["recipient"] == RCPT
    assert data["domain"] == "dest.example.test"
    assert data["mx"] == "mx.dest.example.test"
    assert data["reply"].startswith("250")
    assert data["attempts"] == 1
    assert data["took_s"] >= 0 and data["delay_s"] >= data["took_s"]
    assert data["next_attempt_at"] is None
    # the TLS policy note as its fields (RFC 8461 / 7672 policy; no STARTTLS offered here)
    assert data["tls"]["policy"] == "opportunistic" and "tls" not in data["tls"]
    assert f"queue={qid}" in data["message"] and "outcome=delivered" in data["message"]
    assert re.match(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}", data["time"])
    assert LogSettings(json_format=True).json_format  # the switch that selects this format


async def test_attempt_log_line_names_the_host_tried(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A smarthost that does not answer: the recipient is deferred with ``451 4.4.1`` "No
    answer from the smarthost" (its host:port in the text, RFC 3463 §3.5), and the attempt's
    log line names the relay tried (``mx=relay.example.test``). An attempt that reached no
    host (SERVFAIL on the MX lookup, MX routing) logs ``mx=-``, never ``mx=None``."""
    h = queue_harness
    relay_address = "127.0.2.39"  # on the harness's MX port, but nothing listens there
    h.dns.add(f"relay.example.test. 300 IN A {relay_address}\nservfail.example.test. MX SERVFAIL\n")
    caplog.set_level(logging.INFO, logger="jsqueue.worker")

    def deferred_lines(queue_id: str) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if getattr(r, "queue_id", None) == queue_id
            and getattr(r, "outcome", None) == "deferred"
        ]

    h.configure(worker={"smarthost": SmarthostSettings(host="relay.example.test", port=h.mx_port)})
    relayed = await h.submit(MESSAGE, [RCPT])
    async with h.running():
        await eventually(lambda: bool(deferred_lines(relayed)), what="deferred via the relay")
    entry = await h.entry(relayed)
    assert entry is not None
    reply = entry.recipients[0].last_reply
    assert reply is not None and (reply.code, reply.enhanced) == (451, "4.4.1")
    assert reply.text.startswith("No answer from the smarthost (")
    assert f"relay.example.test [{relay_address}]:{h.mx_port}" in reply.text
    line = deferred_lines(relayed)[0]
    assert " mx=relay.example.test " in line.getMessage()
    assert getattr(line, "mx", None) == "relay.example.test"

    h.configure(worker={"smarthost": None})
    unreached = await h.submit(MESSAGE, ["user@servfail.example.test"])
    async with h.running():
        await eventually(lambda: bool(deferred_lines(unreached)), what="deferred, DNS failure")
    line = deferred_lines(unreached)[0]
    assert " mx=- " in line.getMessage() and "mx=None" not in line.getMessage()
    assert "4.4.3" in line.getMessage()


@pytest.mark.parametrize("inline_max", [0, 1024], ids=["inline off", "inline on"])
async def test_accepted_bodies_counted_by_layout(queue_harness: Harness, inline_max: int) -> None:
    """``jsqueue_accepted_bodies_total{layout}`` counts where the front end stored each
    accepted body: ``inline`` in its KV entry (``smtp.inline_body_max``) or ``object_store``.
    Both labels are exported as 0 before the first message; a body over the inline limit goes
    to the object store even with the setting on."""
    h = queue_harness
    h.settings.smtp.inline_body_max = inline_max
    metrics = Metrics()

    def count(layout: str) -> float | None:
        return metrics.registry.get_sample_value(
            "jsqueue_accepted_bodies_total", {"layout": layout}
        )

    assert (count("inline"), count("object_store")) == (0, 0)
    h.frontend = SmtpServer(h.settings.smtp, h.stores, metrics)
    await h.frontend.start()
    small = await h.submit(MESSAGE, [RCPT])
    large = await h.submit(MESSAGE + (b"z" * 78 + b"\r\n") * 40, [RCPT])  # 3.3 KB
    layouts = {}
    for qid in (small, large):
        entry = await h.entry(qid)
        assert entry is not None
        layouts[qid] = "inline" if entry.inline_body is not None else "object_store"
    assert layouts == {small: "inline" if inline_max else "object_store", large: "object_store"}
    assert count("inline") == (1 if inline_max else 0)
    assert count("object_store") == (1 if inline_max else 2)
    assert metrics.registry.get_sample_value("jsqueue_messages_accepted_total") == 2


def test_depth_gauge_covers_every_state() -> None:
    """A scan that found nothing in a state reports 0 for it, not a stale value."""
    metrics = Metrics()
    metrics.set_exporting(True)
    metrics.set_depth({EntryState.PENDING: 4}, 0.1)
    metrics.set_depth({EntryState.DEFERRED: 2}, 0.1)
    got = {
        s: metrics.registry.get_sample_value("jsqueue_queue_entries", {"state": s.value})
        for s in EntryState
    }
    assert got[EntryState.PENDING] == 0 and got[EntryState.DEFERRED] == 2


async def test_a_port_in_use_names_the_settings(mem_stores: Stores) -> None:
    """A listener that cannot bind says which settings to change (``http.host/http.port``,
    ``smtp.host/smtp.port``) instead of a bare errno, in one line (the CLI prints it)."""
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = blocker.sockets[0].getsockname()[1]
    try:
        http = HttpServer(HttpSettings(port=port), Metrics(), Health())
        where = rf"cannot listen on 127\.0\.0\.1:{port}: "
        with pytest.raises(ListenError, match=rf"^http\.host/http\.port: {where}"):
            await http.start()
        await http.stop()
        smtp = SmtpServer(SmtpSettings(port=port), mem_stores)
        with pytest.raises(ListenError, match=rf"^smtp\.host/smtp\.port: {where}"):
            await smtp.start()
    finally:
        blocker.close()
        await blocker.wait_closed()


def _exported(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("jsqueue_work_backlog_items")


async def test_one_process_of_the_cluster_exports_the_queue_wide_gauges(
    js_stores: Stores, nats_settings: NatsSettings, nats_server: EmbeddedNats, names: Names
) -> None:
    """Two processes probing one queue: exactly one exports ``jsqueue_queue_entries`` and
    the backlog (``sum()`` over targets is the queue's figure, not twice it); when it stops,
    the other takes over at its next probe."""
    other_stores = await open_jetstream(nats_settings, [nats_server.url], names=names)
    try:
        await js_stores.entries.create(make_entry())
        probes = []
        for stores in (js_stores, other_stores):
            assert stores.lock is not None
            lock = await stores.lock(names.gauges_lock_key, 30.0)
            probes.append(QueueProbe(stores, Metrics(), exporter=lock))
        for probe in probes:
            assert await probe.probe() and await probe.scan_depth()
        exporting = [p for p in probes if p.exporting]
        assert len(exporting) == 1
        [first] = exporting
        [second] = [p for p in probes if p is not first]
        assert _exported(first.metrics) == 0
        entries = first.metrics.registry.get_sample_value(
            "jsqueue_queue_entries", {"state": "pending"}
        )
        assert entries == 1
        assert _exported(second.metrics) is None
        assert second.metrics.registry.get_sample_value("jsqueue_queue_gauges_exporter") == 0
        await first.release()
        assert _exported(first.metrics) is None
        assert await second.probe() and second.exporting
        assert _exported(second.metrics) == 0
    finally:
        await other_stores.close()


async def test_the_depth_gauge_follows_changes_within_the_probe_interval(
    js_stores: Stores,
) -> None:
    """A small queue is scanned again at every probe (a scan costs little), not after
    ``queue_depth_interval_s``: a new entry shows within a probe interval or two."""
    metrics = Metrics()
    probe = QueueProbe(js_stores, metrics, probe_interval_s=0.2, depth_interval_s=300.0)
    assert probe.next_scan_after_s(0.001) == 0.2
    assert probe.next_scan_after_s(5.0) == 50.0
    assert probe.next_scan_after_s(20.0) == 200.0
    assert probe.next_scan_after_s(60.0) == 600.0  # the cost bound over the 300 s cap
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))

    def pending(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            got = metrics.registry.get_sample_value("jsqueue_queue_entries", {"state": "pending"})
            return got == n

        return check

    try:
        await wait_until(pending(0), timeout_s=10)
        await js_stores.entries.create(make_entry())
        await wait_until(pending(1), timeout_s=10)
    finally:
        stop.set()
        await task


async def test_a_long_depth_scan_runs_beside_the_probes(
    js_stores: Stores, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """A depth scan of a large queue takes minutes (every entry is read): it runs beside
    the probes, so the readiness probe and the exporter lock (TTL three probes) go on
    meanwhile, and its result is exported when it ends; a failed scan says why and after
    how long. Before, a scan ran between two probes under a 30 s bound: at a million
    entries it never ended in time, its failure line gave no reason, and the exporter
    lock lapsed during it."""
    caplog.set_level(logging.INFO, logger="jsqueue.metrics")
    await js_stores.entries.create(make_entry())
    release = asyncio.Event()
    count = js_stores.entries.count_by_state
    scans = 0

    async def slow_count(pacer: Pacer | None = None) -> dict[EntryState, int]:
        nonlocal scans
        scans += 1
        if scans == 1:
            await release.wait()  # the first scan lasts as long as the test wants
            return await count(pacer)
        raise TimeoutError()  # a request of the second one times out

    js_stores.entries.count_by_state = slow_count  # type: ignore[method-assign]
    assert js_stores.lock is not None
    lock = await js_stores.lock(names.gauges_lock_key, 0.6)  # three probes of 0.2 s
    metrics = Metrics()
    probed: list[bool] = []
    probe = QueueProbe(
        js_stores,
        metrics,
        probe_interval_s=0.2,
        depth_interval_s=0.2,
        exporter=lock,
        on_health=probed.append,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(probe.run(stop))
    try:
        await eventually(lambda: scans == 1, what="a scan under way")
        seen = len(probed)
        await eventually(lambda: len(probed) >= seen + 5, what="five probes during the scan")
        assert all(probed) and probe.exporting  # lock kept, ready, while the scan runs
        assert "not here" not in caplog.text
        pending = {"state": "pending"}
        assert metrics.registry.get_sample_value("jsqueue_queue_entries", pending) is None
        release.set()
        await eventually(
            lambda: metrics.registry.get_sample_value("jsqueue_queue_entries", pending) == 1,
            what="the long scan's result exported",
        )
        await eventually(lambda: "queue depth scan failed after" in caplog.text, what="fail")
        assert "TimeoutError" in caplog.text  # a reason, not an empty message
    finally:
        stop.set()
        await task


async def test_front_end_rejections_are_logged_and_counted_by_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every refusal the front end answers is one log line with the client address and one
    count of ``jsqueue_smtp_rejections_total{code}``: relay denied (554), too many
    recipients (452), bad syntax (501), bare line ending (550), storage failure (451)."""
    metrics = Metrics()
    faulty = FaultyStores()
    settings = frontend_settings(relay_networks=["127.0.0.0/8"], max_recipients=1)
    caplog.set_level(logging.INFO, logger="jsqueue.frontend")
    async with running(settings, faulty.stores, on_reject=metrics.rejected) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test", 501)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 250)
        await w.expect("RCPT TO:<c@dest.example.test>", 452)
        await w.expect("DATA", 354)
        await w.send(b"Subject: x\r\n\r\nbare\nline\r\n.\r\n")
        assert (await w.reply()).code == 550
        faulty.fault("put").fail = True
        faulty.fault("create").fail = True
        r = await w.transaction(
            "a@example.test", ["b@dest.example.test"], dot_stuff(b"x\r\n"), ehlo=False
        )
        assert r.code == 451
        await w.expect("QUIT", 221)
        await w.close()
    async with running(
        frontend_settings(relay_networks=["192.0.2.0/24"]), faulty.inner, on_reject=metrics.rejected
    ) as server:
        w = await Wire.connect(server.port)
        await w.expect("EHLO client.example.test", 250)
        await w.expect("MAIL FROM:<a@example.test>", 250)
        await w.expect("RCPT TO:<b@dest.example.test>", 554)
        await w.close()

    def count(code: str) -> float | None:
        return metrics.registry.get_sample_value("jsqueue_smtp_rejections_total", {"code": code})

    assert {c: count(c) for c in ("501", "452", "550", "451", "554")} == dict.fromkeys(
        ("501", "452", "550", "451", "554"), 1.0
    )
    lines = [r.getMessage() for r in caplog.records if "smtp rejection" in r.getMessage()]
    assert len(lines) == 5
    assert all("client=127.0.0.1" in line for line in lines)
    assert any("reply='554 5.7.1" in line and "from=<a@example.test>" in line for line in lines)
    # after the data too: whose message was refused (the envelope is reset only after it)
    after_data = [line for line in lines if "reply='550 5.6.11" in line or "reply='451" in line]
    assert len(after_data) == 2
    assert all("from=<a@example.test> rcpts=1" in line for line in after_data), after_data
