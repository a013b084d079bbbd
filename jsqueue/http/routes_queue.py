"""Queue routes: list, show, stats (role ``read``) and the actions flush, hold, release,
delete, bounce, requeue by id or by filter (role ``admin``), all through the queue
operations of :mod:`jsqueue.admin` (``Admin.page``, ``show``, ``stats``, ``act``,
``select``, ``apply``), so every change is the same compare-and-set as the CLI's and emits
the same events, with ``api:<token name>`` as their source.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from jsqueue.admin import EntryFilter
from jsqueue.errors import EntryNotFound, RequestRejected, StoreUnavailable
from jsqueue.http.auth import Role
from jsqueue.http.context import ApiContext
from jsqueue.http.models import QUEUE_ID_PATTERN, ActionBody, BulkBody, ListQuery
from jsqueue.http.routing import Call, Route
from jsqueue.views import (
    Action,
    ActionResult,
    BulkResult,
    EntryDetail,
    Outcome,
    Page,
    QueueStats,
)

log = logging.getLogger("jsqueue.http")

_QUEUE_ID = {"type": "string", "pattern": QUEUE_ID_PATTERN}

_ACTION_TEXT = {
    Action.FLUSH: "Deliver now, overriding the backoff (postqueue -i); a live worker's lease "
    "is left alone unless break_lease.",
    Action.HOLD: "Put on hold (postsuper -h): nothing is attempted until released.",
    Action.RELEASE: "Release from hold (postsuper -H) and deliver now.",
    Action.DELETE: "Delete with body and work items (postsuper -d); no DSN.",
    Action.BOUNCE: "Bounce every open recipient with 550 5.7.1 and send the DSN.",
    Action.REQUEUE: "Requeue (postsuper -r): leases dropped, due now, attempts kept; a live "
    "worker's transaction cannot be recalled (RFC 5321 §6.1).",
}


def queue_routes(ctx: ApiContext) -> list[Route]:
    """The queue routes over ``ctx``."""

    async def list_entries(call: Call) -> BaseModel:
        q: ListQuery = call.query
        flt = EntryFilter(
            states=frozenset(q.state) if q.state else None,
            domain=q.domain,
            sender=q.sender,
            min_age_s=q.min_age_s,
            max_age_s=q.max_age_s,
        )
        limit = min(q.limit, ctx.settings.api.max_page)
        return await ctx.admin(call.token).page(flt, after=q.after, limit=limit)

    async def show(call: Call) -> BaseModel:
        return await ctx.admin(call.token).show(call.path["queue_id"])

    async def stats(call: Call) -> BaseModel:
        return await ctx.admin(call.token).stats()

    def one(action: Action) -> Route:
        async def act(call: Call) -> BaseModel:
            opts: ActionBody = call.body or ActionBody()
            queue_id = call.path["queue_id"]
            flush = action is Action.FLUSH
            result = await ctx.admin(call.token).act(
                action,
                queue_id,
                domain=_domain(opts.domain) if flush else None,
                break_lease=opts.break_lease and flush,
            )
            log.info(
                "api %s %s by %s: %s",
                action.value,
                queue_id,
                call.token.name,
                result.outcome.value,
            )
            return _checked(result)

        return Route(
            "POST",
            f"/api/v1/queue/{{queue_id}}/{action.value}",
            f"{action.value}_entry",
            _ACTION_TEXT[action],
            Role.ADMIN,
            act,
            response=ActionResult,
            body=ActionBody,
            body_required=False,
            path_params={"queue_id": _QUEUE_ID},
            errors=(404,),
            tag="actions",
        )

    def bulk(action: Action) -> Route:
        async def act(call: Call) -> BaseModel:
            req: BulkBody = call.body
            adm = ctx.admin(call.token)
            domain: str | None = None
            if req.ids is not None:
                ids = list(dict.fromkeys(req.ids))
            else:
                f = req.filter
                flt = (
                    EntryFilter(
                        states=frozenset(f.states) if f.states else None,
                        domain=f.domain,
                        sender=f.sender,
                        min_age_s=f.min_age_s,
                        max_age_s=f.max_age_s,
                    )
                    if f is not None
                    else EntryFilter()
                )
                if f is not None and flt.is_empty:
                    # As the CLI: a filter with no condition would match every entry;
                    # "everything" must be asked for as such.
                    raise RequestRejected(
                        "the filter has no condition (states, domain, sender, min_age_s, "
                        'max_age_s) and would select every entry: give one, or "all": true'
                    )
                domain = flt.domain if action is Action.FLUSH else None
                ids = await adm.select(flt)
            if len(ids) > ctx.settings.api.max_bulk:
                raise RequestRejected(
                    f"the filter selects {len(ids)} entries; at most "
                    f"{ctx.settings.api.max_bulk} (api.max_bulk)"
                )
            result: BulkResult = await adm.apply(
                action, ids, domain=domain, break_lease=req.break_lease and action is Action.FLUSH
            )
            log.info(
                "api %s (bulk, %d entries) by %s: %s",
                action.value,
                len(ids),
                call.token.name,
                {k.value: v for k, v in result.counts.items()},
            )
            return result

        return Route(
            "POST",
            f"/api/v1/actions/{action.value}",
            f"{action.value}_bulk",
            _ACTION_TEXT[action] + " By ids, by filter or every entry; one result each.",
            Role.ADMIN,
            act,
            response=BulkResult,
            body=BulkBody,
            tag="actions",
        )

    routes = [
        Route(
            "GET",
            "/api/v1/queue",
            "list_entries",
            "List the queue (queue ls): filters and paging; pass next_after as after.",
            Role.READ,
            list_entries,
            response=Page,
            query=ListQuery,
        ),
        Route(
            "GET",
            "/api/v1/queue/{queue_id}",
            "show_entry",
            "One entry (queue show): every recipient's attempts, last reply, schedule, leases.",
            Role.READ,
            show,
            response=EntryDetail,
            path_params={"queue_id": _QUEUE_ID},
            errors=(404,),
        ),
        Route(
            "GET",
            "/api/v1/stats",
            "queue_stats",
            "Counts by state and destination, the oldest entry, the backlog (queue stats); "
            "reads every entry once.",
            Role.READ,
            stats,
            response=QueueStats,
        ),
    ]
    routes += [one(a) for a in Action]
    routes += [bulk(a) for a in Action]
    return routes


def _domain(domain: str | None) -> str | None:
    """A flush's domain as a routing domain (A-label), as EntryFilter makes it.

    Raises:
        pydantic.ValidationError: not a routing domain (HTTP 422).
    """
    return EntryFilter(domain=domain).domain if domain is not None else None


def _checked(result: ActionResult) -> ActionResult:
    """The result of one action, or the error it stands for.

    Raises:
        EntryNotFound: NOT_FOUND (HTTP 404).
        StoreUnavailable: FAILED: a storage error or too many conflicts (HTTP 503: re-run).
    """
    if result.outcome is Outcome.NOT_FOUND:
        raise EntryNotFound(f"no such entry: {result.queue_id}")
    if result.outcome is Outcome.FAILED:
        raise StoreUnavailable(result.detail)
    return result
