"""Destination routes (role ``read``): the sites of the cluster-wide destination limits as
``jsqueue dest ls`` / ``dest show SITE`` print them (:mod:`jsqueue.destinations_admin`,
read from the destinations bucket, so cluster-wide): sessions open, limit, sessions allowed
now, up / down until (RFC 5321 §4.5.4.1), throttle, rates, queued work items.
"""

from __future__ import annotations

from pydantic import BaseModel

from jsqueue.config.destinations import SITE_PATTERN
from jsqueue.destinations_admin import list_destinations, show_destination
from jsqueue.errors import EntryNotFound
from jsqueue.http.auth import Role
from jsqueue.http.context import ApiContext
from jsqueue.http.models import DestinationsQuery
from jsqueue.http.routing import Call, Route
from jsqueue.store.base import DestinationStore
from jsqueue.views import DestinationList, DestinationView


def destination_routes(ctx: ApiContext) -> list[Route]:
    """The destination routes over ``ctx``; they answer 404 when destination limits are off
    (``destinations.enabled`` false)."""

    def store() -> DestinationStore:
        """The destinations bucket.

        Raises:
            EntryNotFound: destination limits are off (HTTP 404).
        """
        if not ctx.settings.destinations.enabled or ctx.stores.destinations is None:
            raise EntryNotFound("destination limits are off (destinations.enabled)")
        return ctx.stores.destinations

    async def list_sites(call: Call) -> BaseModel:
        q: DestinationsQuery = call.query
        sites = await list_destinations(store(), ctx.settings.destinations, queued=q.queued)
        return DestinationList(sites=sites)

    async def show_site(call: Call) -> BaseModel:
        return await show_destination(store(), ctx.settings.destinations, call.path["site"])

    return [
        Route(
            "GET",
            "/api/v1/destinations",
            "list_destinations",
            "Destination sites (dest ls): sessions, limit, allowed, up/down, rates, queued.",
            Role.READ,
            list_sites,
            response=DestinationList,
            query=DestinationsQuery,
            errors=(404,),
            tag="destinations",
        ),
        Route(
            "GET",
            "/api/v1/destinations/{site}",
            "show_destination",
            "One destination site in full (dest show SITE), slots by holder.",
            Role.READ,
            show_site,
            response=DestinationView,
            path_params={"site": {"type": "string", "pattern": SITE_PATTERN}},
            errors=(404,),
            tag="destinations",
        ),
    ]
