"""Prometheus metrics of one jsqueue process (STYLE.md habit 11: metrics at hook points).

:class:`Metrics` owns a private registry (no globals: several workers in one test process
do not share counters) and is itself an :class:`~jsqueue.events.Observer`: it counts the
events the front end and the workers emit, so no metric call is sprinkled through the
queue logic. :class:`QueueProbe` refreshes the gauges that need a request to NATS, on its
own schedule, never per scrape. ``jsqueue.health`` serves the registry on ``/metrics``.

Metrics (names carry their unit; counters end in ``_total``):

=========================================  =========  ==============================================
name                                       type       meaning
=========================================  =========  ==============================================
jsqueue_messages_accepted_total            counter    messages stored and answered 250
jsqueue_accepted_bytes_total               counter    octets of those messages
jsqueue_accepted_recipients_total          counter    recipients of those messages
jsqueue_accepted_bodies_total{layout}      counter    those messages by where the body was stored:
                                                      ``inline`` in the KV entry
                                                      (``smtp.inline_body_max``) or
                                                      ``object_store``
jsqueue_delivery_attempts_total{outcome}   counter    recipient delivery attempts by outcome
                                                      (delivered, deferred, bounced, expired)
jsqueue_delivery_duration_seconds{outcome} histogram  duration of the SMTP attempt, per recipient
jsqueue_delivery_uncertain_total           counter    recipient attempts (also counted above, as
                                                      deferred) whose final ``.`` was sent and
                                                      no reply came back: perhaps delivered
                                                      already, may be delivered twice
                                                      (RFC 5321 §6.1; events ``uncertain``)
jsqueue_state_changes_total{kind}          counter    every event this process emitted, by kind
jsqueue_entry_too_large_total              counter    entries the entry store refused as too large
                                                      after an attempt: recorded with the replies
                                                      cut further, or held (``too_large`` events)
jsqueue_events_published_total             counter    events the events stream acknowledged
jsqueue_events_dropped_total               counter    events dropped (buffer full, closing)
jsqueue_events_failed_total                counter    events whose publish failed
jsqueue_queue_entries{state}               gauge      entries by derived state (periodic scan);
                                                      ``done`` are kept DSN records, not
                                                      queued mail (``queue stats``: kept)
jsqueue_queue_scan_duration_seconds        gauge      how long the last depth scan took
jsqueue_queue_scan_timestamp_seconds       gauge      Unix time of the last depth scan
jsqueue_work_backlog_items                 gauge      work items scheduled and not settled (due,
                                                      deferred, in flight): Scheduler.backlog()
jsqueue_nats_connected                     gauge      1 when the last NATS probe succeeded, else 0
=========================================  =========  ==============================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from jsqueue.envelope import EntryState
from jsqueue.errors import JsqueueError
from jsqueue.events import Event, EventKind, JetStreamPublisher
from jsqueue.store.base import Stores

log = logging.getLogger("jsqueue.metrics")

#: Histogram buckets of the delivery duration, seconds (a local sink takes milliseconds, a
#: tarpitting MX minutes; RFC 5321 §4.5.3.2 allows 10 minutes for the final reply).
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: ``layout`` label values of ``jsqueue_accepted_bodies_total``: body kept inline in the
#: KV entry, or stored in the object store.
BODY_LAYOUTS = ("inline", "object_store")

_ATTEMPT_OUTCOMES = (
    EventKind.DELIVERED,
    EventKind.DEFERRED,
    EventKind.BOUNCED,
    EventKind.EXPIRED,
)


class _PublisherCollector(Collector):
    """Exports a :class:`JetStreamPublisher`'s own counters at scrape time."""

    def __init__(self, publisher: JetStreamPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        p = self.publisher
        for name, value, doc in (
            ("jsqueue_events_published", p.published, "Events the events stream acknowledged."),
            ("jsqueue_events_dropped", p.dropped, "Events dropped: buffer full or closing."),
            ("jsqueue_events_failed", p.failed, "Events whose publish failed."),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    """The Prometheus metrics of one process; an :class:`~jsqueue.events.Observer`.

    Args:
        registry: where to register; a new private registry when None.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.accepted = Counter(
            "jsqueue_messages_accepted", "Messages stored and answered 250.", registry=r
        )
        self.accepted_bytes = Counter(
            "jsqueue_accepted_bytes", "Octets of the messages accepted.", registry=r
        )
        self.accepted_recipients = Counter(
            "jsqueue_accepted_recipients", "Recipients of the messages accepted.", registry=r
        )
        self.accepted_bodies = Counter(
            "jsqueue_accepted_bodies",
            "Messages accepted, by where the body was stored: inline in the KV entry "
            "(smtp.inline_body_max) or in the object store.",
            ["layout"],
            registry=r,
        )
        self.attempts = Counter(
            "jsqueue_delivery_attempts",
            "Recipient delivery attempts by outcome.",
            ["outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "jsqueue_delivery_duration_seconds",
            "Duration of the SMTP attempt, observed once per recipient, seconds.",
            ["outcome"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.uncertain = Counter(
            "jsqueue_delivery_uncertain",
            "Recipient attempts whose final dot was sent and no reply came back (perhaps "
            "delivered already; may be delivered twice).",
            registry=r,
        )
        self.state_changes = Counter(
            "jsqueue_state_changes",
            "Events emitted by this process, by kind.",
            ["kind"],
            registry=r,
        )
        self.entry_too_large = Counter(
            "jsqueue_entry_too_large",
            "Entries the entry store refused as too large after an attempt: recorded with "
            "the replies cut further, or held.",
            registry=r,
        )
        self.queue_entries = Gauge(
            "jsqueue_queue_entries",
            "Queue entries by derived state (done: kept DSN records, not queued mail).",
            ["state"],
            registry=r,
        )
        self.scan_duration = Gauge(
            "jsqueue_queue_scan_duration_seconds",
            "Duration of the last queue depth scan, seconds.",
            registry=r,
        )
        self.scan_timestamp = Gauge(
            "jsqueue_queue_scan_timestamp_seconds",
            "Unix time of the last queue depth scan, seconds.",
            registry=r,
        )
        self.backlog = Gauge(
            "jsqueue_work_backlog_items",
            "Work items scheduled and not yet settled (due, deferred, in flight).",
            registry=r,
        )
        self.nats_connected = Gauge(
            "jsqueue_nats_connected", "1 when the last NATS probe succeeded, else 0.", registry=r
        )
        for layout in BODY_LAYOUTS:  # export zeros before the first message
            self.accepted_bodies.labels(layout)
        for outcome in _ATTEMPT_OUTCOMES:  # export zeros before the first attempt
            self.attempts.labels(outcome.value)
            self.duration.labels(outcome.value)

    def watch_publisher(self, publisher: JetStreamPublisher) -> None:
        """Export ``publisher``'s published / dropped / failed counts. Call once."""
        self.registry.register(_PublisherCollector(publisher))

    def emit(self, event: Event) -> None:
        """Count one event (the :class:`~jsqueue.events.Observer` hook). Never raises."""
        self.state_changes.labels(event.kind.value).inc()
        if event.kind is EventKind.RECEIVED:
            self.accepted.inc()
            self.accepted_bytes.inc(event.size or 0)
            self.accepted_recipients.inc(len(event.recipients or ()))
            if event.body_inline is not None:
                layout = "inline" if event.body_inline else "object_store"
                self.accepted_bodies.labels(layout).inc()
        elif event.kind is EventKind.TOO_LARGE:
            self.entry_too_large.inc()
        elif event.kind in _ATTEMPT_OUTCOMES and event.duration_s is not None:
            self.attempts.labels(event.kind.value).inc()
            self.duration.labels(event.kind.value).observe(max(0.0, event.duration_s))
            if event.uncertain:
                self.uncertain.inc()

    def set_depth(self, counts: dict[EntryState, int], took_s: float) -> None:
        """Record a depth scan: entries per state (missing states are 0)."""
        for st in EntryState:
            self.queue_entries.labels(st.value).set(counts.get(st, 0))
        self.scan_duration.set(took_s)
        self.scan_timestamp.set(time.time())


class QueueProbe:
    """Refreshes the gauges that need NATS, on a schedule, and reports NATS health.

    Every ``probe_interval_s`` seconds: ``Scheduler.backlog()`` (one consumer-info request)
    sets ``jsqueue_work_backlog_items`` and ``jsqueue_nats_connected`` and tells
    ``on_health`` whether NATS and the work consumer answered. Every ``depth_interval_s``
    seconds (0 = never): ``EntryStore.count_by_state()`` sets ``jsqueue_queue_entries``.
    That scan reads every entry (DESIGN.md §7: never on a hot path), so run it on few
    processes and not too often; its cost is exported as a gauge.

    Args:
        stores: the queue.
        metrics: where the gauges live.
        probe_interval_s: seconds between backlog probes.
        depth_interval_s: seconds between depth scans; 0 disables them.
        timeout_s: bound of one probe or scan, seconds.
        on_health: called with True / False after every probe.
    """

    def __init__(
        self,
        stores: Stores,
        metrics: Metrics,
        *,
        probe_interval_s: float = 5.0,
        depth_interval_s: float = 300.0,
        timeout_s: float = 30.0,
        on_health: Callable[[bool], None] | None = None,
    ) -> None:
        self.stores = stores
        self.metrics = metrics
        self.probe_interval_s = probe_interval_s
        self.depth_interval_s = depth_interval_s
        self.timeout_s = timeout_s
        self.on_health = on_health
        self.ok = False

    async def probe(self) -> bool:
        """One backlog probe. Returns whether NATS answered. Never raises."""
        try:
            async with asyncio.timeout(min(self.timeout_s, max(1.0, self.probe_interval_s))):
                backlog = await self.stores.scheduler.backlog()
        except (JsqueueError, TimeoutError, OSError) as e:
            if self.ok:
                log.warning("NATS probe failed: %s", e)
            self.ok = False
        else:
            self.metrics.backlog.set(backlog)
            self.ok = True
        self.metrics.nats_connected.set(1 if self.ok else 0)
        if self.on_health is not None:
            self.on_health(self.ok)
        return self.ok

    async def scan_depth(self) -> bool:
        """One depth scan. Returns whether it completed. Never raises."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                counts = await self.stores.entries.count_by_state()
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning("queue depth scan failed: %s", e)
            return False
        self.metrics.set_depth(counts, time.monotonic() - started)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Probe (and scan) until ``stop`` is set."""
        next_scan = time.monotonic()
        while not stop.is_set():
            await self.probe()
            if self.depth_interval_s > 0 and time.monotonic() >= next_scan:
                await self.scan_depth()
                next_scan = time.monotonic() + self.depth_interval_s
            with contextlib.suppress(TimeoutError):  # the interval elapsed: probe again
                await asyncio.wait_for(stop.wait(), self.probe_interval_s)
