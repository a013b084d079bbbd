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
jsqueue_smtp_rejections_total{code}        counter    4yz/5yz replies of the SMTP front end, by
                                                      reply code (relay denied, too many
                                                      recipients, storage failures, sizes ...)
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
                                                      queued mail (``queue stats``: kept);
                                                      this and the next three: queue-wide,
                                                      exported by one process at a time
jsqueue_queue_scan_duration_seconds        gauge      how long the last depth scan took
jsqueue_queue_scan_timestamp_seconds       gauge      Unix time of the last depth scan
jsqueue_work_backlog_items                 gauge      work items scheduled and not settled (due,
                                                      deferred, in flight): Scheduler.backlog()
jsqueue_ack_pending_saturated              gauge      1 while the work consumer's max_ack_pending
                                                      is reached (fresh mail waits), with
                                                      ``_items``, ``_limit``, ``_ratio`` and
                                                      jsqueue_work_waiting_items: queue-wide
                                                      (jsqueue.saturation)
jsqueue_nats_connected                     gauge      1 when the last NATS probe succeeded, else 0
jsqueue_reconciler_failed_passes_total     counter    reconciler passes of this process that
                                                      failed (NATS unavailable, or a bug); each
                                                      is followed by a growing pause
jsqueue_queue_gauges_exporter              gauge      1 on the process exporting the queue-wide
                                                      gauges, else 0
=========================================  =========  ==============================================
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jsqueue.envelope import EntryState
from jsqueue.errors import JsqueueError, reason
from jsqueue.events import Event, EventKind, JetStreamPublisher
from jsqueue.pacing import Pacer
from jsqueue.saturation import SaturationWatch
from jsqueue.store.base import AckPending, Lock, Stores
from jsqueue.store.jetstream.work import JetStreamScheduler
from jsqueue.tasks import cancel_and_wait

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


class _CountCollector(Collector):
    """Exports a count another part keeps (read at scrape time) as a counter."""

    def __init__(self, name: str, doc: str, count: Callable[[], int]) -> None:
        self.name = name
        self.doc = doc
        self.count = count

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.doc, value=self.count())


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
        self.tls = Counter(
            "jsqueue_delivery_tls",
            "Recipient delivery attempts by the outbound TLS policy that applied (dane, "
            "mta-sts enforce, mta-sts testing, opportunistic, manual) and its result "
            "(success, none, or an RFC 8460 result type), and whether TLS was used.",
            ["policy", "result", "tls"],
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
        self.rejections = Counter(
            "jsqueue_smtp_rejections",
            "4yz/5yz replies the SMTP front end sent, by reply code.",
            ["code"],
            registry=r,
        )
        self.queue = QueueGauges()
        r.register(self.queue)
        self.exporter = Gauge(
            "jsqueue_queue_gauges_exporter",
            "1 while this process exports the queue-wide gauges (one process of the "
            "cluster at a time), else 0.",
            registry=r,
        )
        self.nats_connected = Gauge(
            "jsqueue_nats_connected", "1 when the last NATS probe succeeded, else 0.", registry=r
        )
        self.saturation = SaturationWatch(r)
        for layout in BODY_LAYOUTS:  # export zeros before the first message
            self.accepted_bodies.labels(layout)
        for outcome in _ATTEMPT_OUTCOMES:  # export zeros before the first attempt
            self.attempts.labels(outcome.value)
            self.duration.labels(outcome.value)

    def watch_publisher(self, publisher: JetStreamPublisher) -> None:
        """Export ``publisher``'s published / dropped / failed counts. Call once."""
        self.registry.register(_PublisherCollector(publisher))

    def watch_reconciler(self, failed_passes: Callable[[], int]) -> None:
        """Export the reconciler's failed passes (``failed_passes()``, read at scrape
        time) as ``jsqueue_reconciler_failed_passes_total``. Call once."""
        doc = "Reconciler passes of this process that failed (NATS unavailable, or a bug)."
        self.registry.register(
            _CountCollector("jsqueue_reconciler_failed_passes", doc, failed_passes)
        )

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
            note = event.reply.tls if event.reply is not None else None
            if note is not None:
                self.tls.labels(note.policy, note.result, "yes" if note.tls else "no").inc()

    def set_depth(self, counts: dict[EntryState, int], took_s: float) -> None:
        """Record a depth scan: entries per state (missing states are 0)."""
        self.queue.counts = {st: counts.get(st, 0) for st in EntryState}
        self.queue.scan_duration_s = took_s
        self.queue.scan_timestamp_s = time.time()

    def rejected(self, code: int) -> None:
        """Count one 4yz/5yz reply of the front end (its ``on_reject`` hook). Never raises."""
        self.rejections.labels(str(code)).inc()

    def set_exporting(self, exporting: bool) -> None:
        """This process does (or no longer does) export the queue-wide gauges."""
        self.queue.exporting = exporting
        self.exporter.set(1 if exporting else 0)


class QueueGauges(Collector):
    """The queue-wide gauges: entries by state, the work backlog, the last depth scan.

    They describe the whole queue, not this process, so only one process of the cluster
    exports them at a time (the holder of the ``gauges`` lock, see :class:`QueueProbe`):
    ``sum()`` or ``max()`` over every scrape target gives the queue's figure, never a
    multiple of it. A process that does not export them yields no sample at all. A
    process without a lock (memory stores, tests) exports them itself.
    """

    def __init__(self) -> None:
        self.exporting = False
        self.counts: dict[EntryState, int] | None = None
        self.backlog: int | None = None
        self.scan_duration_s: float | None = None
        self.scan_timestamp_s: float | None = None

    def collect(self) -> Iterator[Metric]:
        if not self.exporting:
            return
        if self.counts is not None:
            family = GaugeMetricFamily(
                "jsqueue_queue_entries",
                "Queue entries by derived state (done: kept DSN records, not queued mail).",
                labels=["state"],
            )
            for st, n in self.counts.items():
                family.add_metric([st.value], n)
            yield family
        for name, value, doc in (
            (
                "jsqueue_work_backlog_items",
                self.backlog,
                "Work items scheduled and not yet settled (due, deferred, in flight).",
            ),
            (
                "jsqueue_queue_scan_duration_seconds",
                self.scan_duration_s,
                "Duration of the last queue depth scan, seconds.",
            ),
            (
                "jsqueue_queue_scan_timestamp_seconds",
                self.scan_timestamp_s,
                "Unix time of the last queue depth scan, seconds.",
            ),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)


class QueueProbe:
    """Refreshes the gauges that need NATS, on a schedule, and reports NATS health.

    Every ``probe_interval_s`` seconds: ``Scheduler.backlog()`` (one consumer-info request)
    sets ``jsqueue_nats_connected`` and tells ``on_health`` whether NATS and the work
    consumer answered. The queue-wide gauges (:class:`QueueGauges`) are kept by one process
    of the cluster: the holder of ``exporter``, a cluster-wide lock taken or renewed at
    each probe (its TTL a few probe intervals, so a dead exporter is replaced within
    seconds); a process without a lock exports them itself. The exporter sets the backlog
    gauge at each probe and scans the entries by state (``EntryStore.count_by_state()``,
    which reads every entry: DESIGN.md §7) as often as the scan's cost allows: again after
    ten times the seconds the last scan worked, at least ``probe_interval_s``, and at most
    ``depth_interval_s`` after the last one unless that would break the cost bound (0 =
    never). A queue of a few thousand entries is so followed within the probe interval; a
    very large one at a tenth of one process's time, and the scan itself rests as it reads
    so that it never takes more than that tenth while it runs. A scan runs beside the probes, not
    between them, and has no bound of its own but its requests' timeouts: a scan of a
    million entries takes minutes, and the probes (readiness, the exporter lock) go on
    meanwhile.

    Args:
        stores: the queue.
        metrics: where the gauges live.
        probe_interval_s: seconds between backlog probes.
        depth_interval_s: longest time between depth scans, seconds; 0 disables them.
        timeout_s: bound of one probe, seconds.
        on_health: called with True / False after every probe.
        exporter: the lock that elects the exporter of the queue-wide gauges; None = this
            process exports them.
    """

    #: A scan is repeated after this many times its own duration (cost bound: 10 %).
    SCAN_COST_FACTOR = 10.0

    def __init__(
        self,
        stores: Stores,
        metrics: Metrics,
        *,
        probe_interval_s: float = 5.0,
        depth_interval_s: float = 300.0,
        timeout_s: float = 30.0,
        on_health: Callable[[bool], None] | None = None,
        exporter: Lock | None = None,
    ) -> None:
        self.stores = stores
        self.metrics = metrics
        self.probe_interval_s = probe_interval_s
        self.depth_interval_s = depth_interval_s
        self.timeout_s = timeout_s
        self.on_health = on_health
        self.exporter = exporter
        self.ok = False
        self.exporting = False
        self._next_scan = 0.0
        self._scan_busy_s = 0.0  # seconds the last depth scan worked (its rests not counted)

    async def probe(self) -> bool:
        """One backlog probe, and the election of the exporter. Returns whether NATS
        answered. Never raises."""
        try:
            async with asyncio.timeout(min(self.timeout_s, max(1.0, self.probe_interval_s))):
                figures: AckPending | None = None
                if isinstance(self.stores.scheduler, JetStreamScheduler):
                    figures = await self.stores.scheduler.ack_pending()
                    backlog = figures.waiting + figures.ack_pending
                else:
                    backlog = await self.stores.scheduler.backlog()
                exporting = await self._elect()
        except (JsqueueError, TimeoutError, OSError) as e:
            if self.ok:
                log.warning("NATS probe failed: %s", reason(e))
            self.ok = False
            exporting = False
        else:
            self.metrics.queue.backlog = backlog
            if figures is not None:
                self.metrics.saturation.observe(figures, exporting=exporting)
            self.ok = True
        if exporting != self.exporting:
            log.info("queue-wide gauges: %s", "exported here" if exporting else "not here")
        self.exporting = exporting
        self.metrics.set_exporting(exporting)
        self.metrics.nats_connected.set(1 if self.ok else 0)
        if self.on_health is not None:
            self.on_health(self.ok)
        return self.ok

    async def _elect(self) -> bool:
        """Take or keep the exporter lock; True when this process exports.

        Raises:
            StoreUnavailable: the lock's state is unknown.
        """
        if self.exporter is None:
            return True
        return await self.exporter.acquire()

    async def release(self) -> None:
        """Give the exporter lock up (at shutdown), so another process takes over at its
        next probe. Never raises."""
        if self.exporter is not None and self.exporting:
            with contextlib.suppress(JsqueueError, TimeoutError, OSError):
                await self.exporter.release()
        self.exporting = False
        self.metrics.set_exporting(False)

    async def scan_depth(self) -> bool:
        """One depth scan, resting as it reads (:class:`Pacer`: its work is at most
        ``1 / SCAN_COST_FACTOR`` of the time while it runs, so a scan of a million entries
        leaves the event loop to the mail). Returns whether it completed; the seconds it
        worked are kept for the next scan's time. Never raises."""
        started = time.monotonic()
        pacer = Pacer(1 / self.SCAN_COST_FACTOR)
        try:
            counts = await self.stores.entries.count_by_state(pacer)
        except (JsqueueError, TimeoutError, OSError) as e:
            self._scan_busy_s = pacer.finish()
            log.warning(
                "queue depth scan failed after %.1f s: %s", time.monotonic() - started, reason(e)
            )
            return False
        self._scan_busy_s = pacer.finish()
        self.metrics.set_depth(counts, time.monotonic() - started)
        return True

    def next_scan_after_s(self, took_s: float) -> float:
        """Seconds from a scan that took ``took_s`` seconds to the next one (see the class
        docstring)."""
        bound = self.SCAN_COST_FACTOR * took_s
        wanted = max(self.probe_interval_s, bound)
        return (
            max(min(wanted, self.depth_interval_s), bound) if self.depth_interval_s > 0 else wanted
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Probe (and scan beside the probes, while exporting) until ``stop`` is set; then
        stop a scan under way and release the lock."""
        self._next_scan = time.monotonic()
        scan: asyncio.Task[None] | None = None
        try:
            while not stop.is_set():
                await self.probe()
                idle = scan is None or scan.done()
                due = time.monotonic() >= self._next_scan
                if self.exporting and self.depth_interval_s > 0 and due and idle:
                    scan = asyncio.create_task(self._scan(), name="jsqueue-depth-scan")
                with contextlib.suppress(TimeoutError):  # the interval elapsed: probe again
                    await asyncio.wait_for(stop.wait(), self.probe_interval_s)
        finally:
            if scan is not None:
                await cancel_and_wait(scan)
                with contextlib.suppress(asyncio.CancelledError):
                    await scan
            await self.release()

    async def _scan(self) -> None:
        """:meth:`scan_depth`, then the time of the next one (from the seconds it worked:
        its rests already kept it to its share while it ran)."""
        started = time.monotonic()
        await self.scan_depth()
        self._next_scan = started + self.next_scan_after_s(self._scan_busy_s)
