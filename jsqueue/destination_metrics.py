"""The destination limits in ``/metrics``: a Prometheus collector over what one worker holds
per site (:class:`~jsqueue.limits.SiteSnapshot`), read at each scrape. Per process, so the
cluster's figures are sums over the pods (``sum by (site)``). The label set is bounded: the
``top`` sites by slots held, then by deferrals, are named; the rest are summed as ``other``.

- ``jsqueue_destination_sessions{site}``: session slots held (open or idle-cached sessions);
- ``jsqueue_destination_active{site}``: deliveries under way;
- ``jsqueue_destination_allowed_sessions{site}``: sessions allowed now (after throttling);
- ``jsqueue_destination_down{site}``: 1 while the site is down (dead site) or probed;
- ``jsqueue_destination_deferrals_total{site,reason}``: items put back without an attempt
  (``full``: the site's sessions are taken; ``capped``: this worker keeps the rest of its
  concurrency for other sites, :func:`jsqueue.limits.per_site_cap`, a busy site's normal
  traffic, no sign of trouble; ``rate``, ``down``, ``probing``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jsqueue.limits import SiteSnapshot, SiteStatus

__all__ = ["OTHER", "DestinationCollector"]

#: The label of every site beyond the top ones.
OTHER = "other"


class DestinationCollector(Collector):
    """Collects the destination metrics from ``snapshot`` at each scrape.

    Args:
        snapshot: returns this worker's per-site view (:meth:`Destinations.snapshot
            <jsqueue.destinations.Destinations.snapshot>`).
        top: sites named in labels; the others count as :data:`OTHER`.
    """

    def __init__(self, snapshot: Callable[[], list[SiteSnapshot]], top: int = 20) -> None:
        self.snapshot = snapshot
        self.top = top

    def collect(self) -> Iterator[Metric]:
        """The five families above; never raises."""
        sites = sorted(self.snapshot(), key=lambda s: (-s.slots, -sum(s.deferred.values()), s.site))
        named, rest = sites[: self.top], sites[self.top :]
        sessions = GaugeMetricFamily(
            "jsqueue_destination_sessions", "Session slots held per site.", labels=["site"]
        )
        active = GaugeMetricFamily(
            "jsqueue_destination_active", "Deliveries under way per site.", labels=["site"]
        )
        allowed = GaugeMetricFamily(
            "jsqueue_destination_allowed_sessions",
            "Sessions a site may have open now, cluster-wide (after throttle feedback).",
            labels=["site"],
        )
        down = GaugeMetricFamily(
            "jsqueue_destination_down",
            "1 while a site is down (dead site, RFC 5321 4.5.4.1) or being probed.",
            labels=["site"],
        )
        deferrals = CounterMetricFamily(
            "jsqueue_destination_deferrals",
            "Work items put back without a delivery attempt, by site and reason.",
            labels=["site", "reason"],
        )
        for s in named:
            sessions.add_metric([s.site], s.slots)
            active.add_metric([s.site], s.active)
            allowed.add_metric([s.site], s.allowed)
            down.add_metric([s.site], 0 if s.status is SiteStatus.UP else 1)
            for reason, n in sorted(s.deferred.items()):
                deferrals.add_metric([s.site, reason], n)
        if rest:
            sessions.add_metric([OTHER], sum(s.slots for s in rest))
            active.add_metric([OTHER], sum(s.active for s in rest))
            down.add_metric([OTHER], sum(1 for s in rest if s.status is not SiteStatus.UP))
            merged: dict[str, int] = {}
            for s in rest:
                for reason, n in s.deferred.items():
                    merged[reason] = merged.get(reason, 0) + n
            for reason, n in sorted(merged.items()):
                deferrals.add_metric([OTHER, reason], n)
        yield from (sessions, active, allowed, down, deferrals)
