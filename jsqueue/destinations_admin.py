"""What operators see of the destination sites (``jsqueue dest ls`` / ``dest show SITE``, and
later the HTTP API): :class:`~jsqueue.views.DestinationView` models read from the
destinations bucket, so the view is the cluster's, not one worker's.

Cost: a listing is one stream-info request over the destinations bucket (one subject per
slot, rate bucket, site state and probe key), a direct get per key found (slots, states),
and, with ``queued``, one filtered stream-info request on the work stream per site whose
reply grows with the site's queue (one subject per queued item, about 70 octets each). No
consumer is created and no entry is read.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime

from jsqueue import limits
from jsqueue.config import DestinationSettings
from jsqueue.config.destinations import check_site
from jsqueue.errors import InvalidName
from jsqueue.limits import SiteState
from jsqueue.names import site_key, site_of_key
from jsqueue.store.base import DestinationStore
from jsqueue.views import DestinationView

__all__ = ["list_destinations", "show_destination"]


def _at(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


async def _view(
    store: DestinationStore,
    settings: DestinationSettings,
    site: str,
    slots: list[str],
    *,
    queued: bool,
    holders: bool,
    now_s: float,
) -> DestinationView:
    state = SiteState.from_json((await store.get(site_key(site))).value)
    limit = settings.sessions_of(site)
    owners: Counter[str] = Counter()
    if holders:
        for key in slots:
            value = (await store.get(key)).value or {}
            owners[str(value.get("owner", "?"))] += 1
    count: int | None = None
    if queued and site not in settings.groups:
        try:
            count = await store.queued(site)
        except InvalidName:
            count = None
    status = limits.status(state, now_s)
    return DestinationView(
        site=site,
        sessions=len(slots),
        holders=dict(owners),
        limit=limit,
        allowed=limits.allowed_sessions(state, limit, now_s, settings.throttle_grow_s),
        status=status.value,
        down_until=_at(state.down_until) if status is not limits.SiteStatus.UP else None,
        failures=state.failures,
        throttled_until=_at(state.throttled_until),
        message_rate=settings.site_message_rates.get(site, settings.message_rate),
        connection_rate=settings.site_connection_rates.get(site, settings.connection_rate),
        queued=count,
    )


async def list_destinations(
    store: DestinationStore,
    settings: DestinationSettings,
    *,
    queued: bool = True,
    now_s: float | None = None,
) -> list[DestinationView]:
    """Every site the cluster holds something for (a slot, a rate bucket, a state), by
    name. Read-only.

    Args:
        store: the destinations bucket.
        settings: the ``[destinations]`` section (limits, rates, groups).
        queued: count each site's queued work items (one request per site, see the
            module's cost note).
        now_s: Unix seconds; the current time when None.

    Raises:
        StoreUnavailable: NATS unreachable or a request failed.
    """
    now = time.time() if now_s is None else now_s
    slots: dict[str, list[str]] = {}
    for key in await store.keys(""):
        found = site_of_key(key)
        if found is not None:
            kind, site = found
            slots.setdefault(site, [])
            if kind == "slot":
                slots[site].append(key)
    return [
        await _view(store, settings, site, keys, queued=queued, holders=False, now_s=now)
        for site, keys in sorted(slots.items())
    ]


async def show_destination(
    store: DestinationStore,
    settings: DestinationSettings,
    site: str,
    *,
    now_s: float | None = None,
) -> DestinationView:
    """One site in full: slots by holder, limit, status, rates, queued count. A site the
    cluster holds nothing for is shown up with no sessions. Read-only.

    Args:
        site: a domain or a site group's name, any case (:func:`~jsqueue.names.check_site`).

    Raises:
        InvalidName: ``site`` names no site (a wildcard, white space ...).
        StoreUnavailable: NATS unreachable or a request failed.
    """
    site = check_site(site)
    now = time.time() if now_s is None else now_s
    keys = [k for k in await store.keys("slot.") if site_of_key(k) == ("slot", site)]
    return await _view(store, settings, site, keys, queued=True, holders=True, now_s=now)
