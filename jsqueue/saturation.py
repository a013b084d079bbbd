"""The ack-pending alert: the shared work consumer delivers nothing new while
``max_ack_pending`` items are delivered and unsettled, and a deferred recipient's item
(NAK-delayed) counts as unsettled until it comes due (DESIGN.md §2.6). A deferred backlog
that reaches the limit would stall fresh mail; this module makes that loud: gauges for the
alert and a log line when the ratio crosses a threshold, repeated while it lasts.

Gauges (exported by the process that exports the queue-wide gauges,
:class:`~jsqueue.metrics.QueueProbe`):

==================================  =====  ==================================================
``jsqueue_ack_pending_items``        gauge  work items delivered and not settled (in flight
                                            and deferred), the consumer's num_ack_pending
``jsqueue_ack_pending_limit``        gauge  the consumer's max_ack_pending
``jsqueue_ack_pending_ratio``        gauge  items / limit, 0 to 1
``jsqueue_ack_pending_saturated``    gauge  1 while items >= limit (no new item is
                                            delivered: fresh mail waits), else 0
``jsqueue_work_waiting_items``       gauge  work items not yet delivered (num_pending)
==================================  =====  ==================================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jsqueue.store.base import AckPending

log = logging.getLogger("jsqueue.saturation")

#: Ratio of ack-pending items to ``max_ack_pending`` from which a warning is logged.
WARN_RATIO = 0.8
#: While saturated (or above the warning ratio), the log line is repeated this often, seconds.
REPEAT_S = 60.0


class SaturationWatch(Collector):
    """Keeps the ack-pending gauges and logs when the consumer nears or reaches its limit.

    :meth:`observe` takes each probe's figures; the gauges are yielded only while
    ``exporting`` (one process of the cluster), and only that process logs. Logs: a
    WARNING when the ratio reaches :data:`WARN_RATIO`, an ERROR when saturated, each
    repeated every :data:`REPEAT_S` seconds while it lasts, an INFO when it is over.

    Args:
        registry: where the gauges are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.figures: AckPending | None = None
        self.exporting = False
        self._level = 0  # 0 fine, 1 warned, 2 saturated
        self._logged_at = 0.0
        registry.register(self)

    def observe(self, figures: AckPending, *, exporting: bool) -> None:
        """Take one probe's figures; log a level change (or a repeat) when ``exporting``.

        Never raises.
        """
        self.figures = figures
        self.exporting = exporting
        if not exporting:
            return
        level = 2 if figures.saturated else 1 if figures.ratio >= WARN_RATIO else 0
        now = time.monotonic()
        if level == self._level and (level == 0 or now - self._logged_at < REPEAT_S):
            return
        if level == 2:
            log.error(
                "work consumer saturated: %d of max_ack_pending %d work items delivered and "
                "not settled (deferred or in flight); %d items, fresh mail included, wait "
                "until a deferred item comes due (raise nats.max_ack_pending above the "
                "deferred backlog; DESIGN.md §2.6)",
                figures.ack_pending,
                figures.limit,
                figures.waiting,
            )
        elif level == 1:
            log.warning(
                "work consumer at %.0f %% of max_ack_pending (%d of %d items deferred or in "
                "flight); at 100 %% fresh mail waits",
                100 * figures.ratio,
                figures.ack_pending,
                figures.limit,
            )
        else:
            log.info(
                "work consumer below %.0f %% of max_ack_pending again (%d of %d)",
                100 * WARN_RATIO,
                figures.ack_pending,
                figures.limit,
            )
        self._level = level
        self._logged_at = now

    def collect(self) -> Iterator[Metric]:
        f = self.figures
        if f is None or not self.exporting:
            return
        for name, value, doc in (
            (
                "jsqueue_ack_pending_items",
                f.ack_pending,
                "Work items delivered and not settled (in flight and deferred).",
            ),
            ("jsqueue_ack_pending_limit", f.limit, "The work consumer's max_ack_pending."),
            ("jsqueue_ack_pending_ratio", f.ratio, "Ack-pending items / max_ack_pending."),
            (
                "jsqueue_ack_pending_saturated",
                1 if f.saturated else 0,
                "1 while ack-pending items reach max_ack_pending: no new work item is "
                "delivered, fresh mail waits.",
            ),
            ("jsqueue_work_waiting_items", f.waiting, "Work items not yet delivered."),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
