"""The ack-pending alert (jsqueue.saturation): a deferred backlog that reaches the work
consumer's ``max_ack_pending`` stops the delivery of new items, fresh mail included
(DESIGN.md §2.6). It must be visible: gauges and a log line, never a silent stall. Real
nats-server, a consumer with a small limit (1 000, the least the settings allow)."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from prometheus_client import generate_latest

from jsqueue.envelope import WorkItem, utcnow
from jsqueue.metrics import Metrics, QueueProbe
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream import open_jetstream
from jsqueue.store.jetstream.work import JetStreamScheduler
from support.nats import make_settings
from support.queue import eventually

LIMIT = 1000


def gauge(metrics: Metrics, name: str) -> float | None:
    value = metrics.registry.get_sample_value(name)
    return None if value is None else float(value)


async def test_saturated_consumer_is_reported_not_silent(
    nats_server: EmbeddedNats, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jsqueue.saturation")
    settings = make_settings(max_ack_pending=LIMIT, prefix=names.prefix)
    stores = await open_jetstream(settings, [nats_server.url], names=names)
    try:
        sched = stores.scheduler
        assert isinstance(sched, JetStreamScheduler)
        metrics = Metrics()
        probe = QueueProbe(stores, metrics)
        await probe.probe()
        assert gauge(metrics, "jsqueue_ack_pending_saturated") == 0
        assert gauge(metrics, "jsqueue_ack_pending_limit") == LIMIT
        assert not any(r.levelno >= logging.WARNING for r in caplog.records)

        # A deferred backlog the size of the limit: every item comes back in an hour.
        later = utcnow() + timedelta(hours=1)
        await asyncio.gather(
            *(
                sched.schedule(WorkItem(new_queue_id(), "deferred.test"), later)
                for _ in range(LIMIT)
            )
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while (await sched.ack_pending()).ack_pending < LIMIT and loop.time() < deadline:
            assert await sched.fetch(256, 0.5) == []  # not due: NAKed with the delay
        fresh = WorkItem(new_queue_id(), "fresh.test")
        await sched.schedule(fresh)
        # Fresh mail is not delivered while the consumer is saturated ...
        assert await sched.fetch(10, 1.0) == []
        await probe.probe()
        assert gauge(metrics, "jsqueue_ack_pending_saturated") == 1
        assert gauge(metrics, "jsqueue_ack_pending_items") == LIMIT
        assert gauge(metrics, "jsqueue_ack_pending_ratio") == 1.0
        assert gauge(metrics, "jsqueue_work_waiting_items") == 1
        assert b"jsqueue_ack_pending_saturated 1.0" in generate_latest(metrics.registry)
        # ... and that is said loudly, naming the setting.
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "max_ack_pending 1000" in errors[0], errors
        assert "1 items, fresh mail included, wait" in errors[0]
        await probe.probe()  # not repeated at every probe
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    finally:
        await stores.close()


async def test_warning_before_saturation_and_all_clear(
    nats_server: EmbeddedNats, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """At 80 % a warning, below it again an all-clear; gauges follow each probe."""
    caplog.set_level(logging.INFO, logger="jsqueue.saturation")
    settings = make_settings(max_ack_pending=LIMIT, prefix=names.prefix)
    stores = await open_jetstream(settings, [nats_server.url], names=names)
    try:
        sched = stores.scheduler
        assert isinstance(sched, JetStreamScheduler)
        metrics = Metrics()
        probe = QueueProbe(stores, metrics)
        for _ in range(850):
            await sched.schedule(WorkItem(new_queue_id(), "busy.test"))
        held = []
        while len(held) < 850:
            held += await sched.fetch(256, 2.0)
        await probe.probe()
        assert gauge(metrics, "jsqueue_ack_pending_ratio") == 0.85
        assert gauge(metrics, "jsqueue_ack_pending_saturated") == 0
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings and "85 % of max_ack_pending" in warnings[0]
        await asyncio.gather(*(d.ack() for d in held))

        async def settled() -> bool:
            return (await sched.ack_pending()).ack_pending == 0

        await eventually(settled, 10, what="acks settled")
        await probe.probe()
        assert gauge(metrics, "jsqueue_ack_pending_ratio") == 0
        assert "below 80 % of max_ack_pending again" in caplog.records[-1].getMessage()
    finally:
        await stores.close()
