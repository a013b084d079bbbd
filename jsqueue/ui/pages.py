"""What each dashboard page shows, read from the queue operations of :mod:`jsqueue.admin`
(the code the CLI and the HTTP API use) and from the in-memory history of
:mod:`jsqueue.ui.history`; the HTTP side (login, CSRF, roles, templates) is
:mod:`jsqueue.ui.app`.

Costs per page view: the overview reads memory only; the list one page of
``Admin.page`` (one key listing and about a page of entry reads, the filters of
``queue ls``); a message page one entry read and at most ``ui.history_budget_s`` of the
events stream from the message's arrival on (its attempts and actions).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from jsqueue.admin import Admin, EntryFilter
from jsqueue.config import Settings
from jsqueue.destinations_admin import list_destinations
from jsqueue.envelope import EntryState, utcnow
from jsqueue.events import Event, tail
from jsqueue.names import Names, queue_id_time
from jsqueue.store.base import DestinationStore, Stores
from jsqueue.ui.charts import bar_chart, line_chart
from jsqueue.ui.history import OUTCOMES, DepthHistory, OutcomeCounter
from jsqueue.views import EntryDetail, EntrySummary

#: Entries per store page of a filtered search (the first is smaller, see :func:`listing`).
SEARCH_PAGE = 2000
#: Events read at most for one message's history.
HISTORY_EVENTS = 1000


class Destinations(Protocol):
    """The hook for a destinations section (limits, up/down per destination): a coroutine
    returning one mapping per destination (column → value), shown as a table at
    ``/ui/destinations`` when one is given to :class:`jsqueue.ui.app.Dashboard`."""

    async def __call__(self) -> list[Mapping[str, Any]]:
        """One row per destination."""
        ...


def destination_rows(settings: Settings, stores: Stores) -> Destinations | None:
    """The dashboard's destinations hook over the destinations bucket (what ``jsqueue dest
    ls`` shows: sessions, limit, allowed, up / down until, throttle, rates, queued), or None
    when destination limits are off (``destinations.enabled``) and so there is no section."""
    store = stores.destinations
    if not settings.destinations.enabled or store is None:
        return None
    found: DestinationStore = store

    async def rows() -> list[Mapping[str, Any]]:
        views = await list_destinations(found, settings.destinations)
        return [v.model_dump(mode="json", exclude={"holders"}) for v in views]

    return rows


def age(seconds: float | None) -> str:
    """``"3d 4h"``, ``"2h 5m"``, ``"4m 10s"``, ``"12s"``; ``"-"`` for None."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    for unit, size, sub, sub_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "m", 60),
        ("m", 60, "s", 1),
    ):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size}{sub}"
    return f"{s}s"


def overview(history: DepthHistory, outcomes: OutcomeCounter) -> dict[str, Any]:
    """The overview's template values from memory only (no NATS request)."""
    samples = list(history.samples)
    latest = samples[-1] if samples else None
    now = utcnow()
    x_labels = (
        (samples[0].at.strftime("%H:%M:%S"), samples[-1].at.strftime("%H:%M:%S"))
        if samples
        else ("", "")
    )
    states = [st for st in EntryState if st is not EntryState.DONE]
    by_state = {st.value: [float(s.by_state.get(st, 0)) for s in samples] for st in states}
    domains = list(latest.by_domain) if latest else []
    by_domain = {d: [float(s.by_domain.get(d, 0)) for s in samples] for d in domains}
    series = outcomes.series(now)
    kinds = [k.value for k in OUTCOMES]
    bars = [{k.value: n for k, n in counts.items()} for _, counts in series]
    minute_labels = (
        (series[0][0].strftime("%H:%M"), series[-1][0].strftime("%H:%M")) if series else ("", "")
    )
    return {
        "latest": latest,
        "samples": len(samples),
        "sample_age_s": (now - latest.at).total_seconds() if latest else None,
        "sample_error": history.last_error,
        "states": [st.value for st in states],
        "state_chart": line_chart(by_state, x_labels, "Queued messages by state"),
        "domain_chart": line_chart(by_domain, x_labels, "Open recipients by destination"),
        "domains": domains,
        "outcome_chart": bar_chart(bars, kinds, minute_labels, "Recipient outcomes per minute"),
        "outcome_kinds": kinds,
        "last_minute": {k.value: n for k, n in outcomes.totals(1, now).items()},
        "last_hour": {k.value: n for k, n in outcomes.totals(outcomes.minutes, now).items()},
        "following": outcomes.following,
        "outcome_minutes": outcomes.minutes,
    }


@dataclass
class Search:
    """The list's search form: the filters of ``queue ls`` and a recipient to look for.

    Attributes:
        state: one derived state, or ``""`` for every queued one.
        domain: destination domain.
        sender: reverse-path (``<>``, ``@domain``).
        recipient: part of a forward-path, case-insensitive.
        after: the page starts after this queue id.
    """

    state: str = ""
    domain: str = ""
    sender: str = ""
    recipient: str = ""
    after: str | None = None
    query: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, query: Mapping[str, str]) -> Search:
        """The search of a request's query (unknown keys ignored, values stripped)."""
        values = {k: query.get(k, "").strip() for k in ("state", "domain", "sender", "recipient")}
        kept = {k: v for k, v in values.items() if v}
        return cls(**values, after=query.get("after") or None, query=kept)

    def entry_filter(self) -> EntryFilter:
        """The :class:`EntryFilter` of this search.

        Raises:
            pydantic.ValidationError: a state or domain that cannot be one (the state is
                checked there too, as the domain: never a bare ValueError).
        """
        return EntryFilter.model_validate(
            {
                "states": [self.state] if self.state else None,
                "domain": self.domain or None,
                "sender": self.sender or None,
            }
        )


@dataclass
class Listing:
    """One page of the list: the entries, the next page's start, whether a recipient
    search was cut short by its time budget."""

    entries: list[EntrySummary]
    next_after: str | None
    cut_short: bool = False


async def listing(admin: Admin, search: Search, limit: int, budget_s: float) -> Listing:
    """One page of entries matching ``search``.

    Without a filter: ``Admin.page`` (one key listing, about ``limit`` entry reads). With
    one: ``Admin.scan`` under the filters of ``queue ls`` in store pages of
    :data:`SEARCH_PAGE` (each store page costs a key listing, so fewer, larger ones),
    keeping the entries whose forward-paths match ``recipient`` too, for at most
    ``budget_s`` seconds; the listing says when it was cut short.

    Raises:
        pydantic.ValidationError: a bad state or domain.
        InvalidName: ``after`` is not a queue id.
        StoreUnavailable: NATS failed.
    """
    flt = search.entry_filter()
    if flt.is_empty and not search.recipient:
        page = await admin.page(flt, after=search.after, limit=limit)
        return Listing(page.entries, page.next_after)
    needle = search.recipient.casefold()
    out: list[EntrySummary] = []
    scan = admin.scan(
        flt, after=search.after, page_size=SEARCH_PAGE, first_page=max(limit, 100) * 5
    )
    try:
        async with asyncio.timeout(budget_s), contextlib.aclosing(scan):
            async for v in scan:
                if not needle or any(needle in r.address.casefold() for r in v.entry.recipients):
                    out.append(EntrySummary.of(v.entry))
                    if len(out) >= limit:
                        return Listing(out, out[-1].id)
    except TimeoutError:
        return Listing(out, out[-1].id if out else None, cut_short=True)
    return Listing(out, None)


@dataclass
class History:
    """A message's events (attempts with their replies, operator actions), oldest first,
    and whether reading them was cut short."""

    events: list[Event]
    complete: bool


async def history(settings: Settings, urls: list[str], queue_id: str, budget_s: float) -> History:
    """The events of ``queue_id`` from the events stream, from its arrival on (the queue id
    carries it), for at most ``budget_s`` seconds and :data:`HISTORY_EVENTS` events.

    Raises:
        StoreUnavailable: NATS unreachable or no events stream.
    """
    since = queue_id_time(queue_id) - timedelta(seconds=1)
    found: list[Event] = []
    events: AsyncGenerator[Event, None] = tail(
        settings.nats,
        urls,
        names=Names(settings.nats.prefix),
        since=since,
        queue_id=queue_id,
        until_end=True,
    )
    try:
        async with asyncio.timeout(budget_s), contextlib.aclosing(events):
            async for e in events:
                found.append(e)
                if len(found) >= HISTORY_EVENTS:
                    return History(found, False)
    except TimeoutError:
        return History(found, False)
    return History(found, True)


def message(detail: EntryDetail | None, hist: History, now: datetime) -> dict[str, Any]:
    """The message page's template values: the entry (None once it left the queue), its
    history, its live leases."""
    leases = []
    if detail is not None:
        for domain, lease in sorted(detail.leases.items()):
            left = (lease.until - now).total_seconds()
            leases.append(
                {"domain": domain, "owner": lease.owner, "until": lease.until, "left_s": left}
            )
    return {"entry": detail, "events": hist.events, "complete": hist.complete, "leases": leases}
