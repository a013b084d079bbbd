"""``GET /api/v1/events`` (role ``read``): a live tail of the events stream as server-sent
events (the WHATWG HTML "Server-sent events" format): one ``id:``, ``event:`` (the kind)
and ``data:`` (the event's JSON, :class:`jsqueue.events.Event`) per event, a comment line
every ``api.sse_keepalive_s`` on a quiet stream.

Each client follows the stream with an ordered consumer on a NATS connection of its own
(:func:`jsqueue.events.tail`), so nothing is acked or kept for it. The response starts only
once the consumer exists: NATS unreachable is a ``503``, not an empty stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from aiohttp import web

from jsqueue.envelope import utcnow
from jsqueue.errors import StoreUnavailable
from jsqueue.events import Event, tail
from jsqueue.http.auth import Role
from jsqueue.http.context import ApiContext
from jsqueue.http.models import EventsQuery
from jsqueue.http.routing import Call, Route
from jsqueue.tasks import cancel_and_wait

#: Events buffered per client between the stream and the socket.
CLIENT_BUFFER = 1000
#: How often a quiet stream checks that its client is still there, seconds.
GONE_CHECK_S = 1.0


def _gone(request: web.Request) -> bool:
    """The client closed the connection (or the server is closing it)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def sse_frame(event: Event) -> bytes:
    """One server-sent event: ``id``, ``event`` (kind) and one ``data`` line (JSON has no
    raw newline)."""
    return f"id: {event.id}\nevent: {event.kind.value}\ndata: ".encode() + event.to_json() + b"\n\n"


def events_routes(ctx: ApiContext) -> list[Route]:
    """The events route over ``ctx``."""

    async def events(call: Call) -> web.StreamResponse:
        q: EventsQuery = call.query
        since = utcnow() - timedelta(seconds=q.since_s) if q.since_s is not None else None
        ready = asyncio.Event()
        queue: asyncio.Queue[Event | None] = asyncio.Queue(CLIENT_BUFFER)

        async def follow() -> None:
            stream = tail(
                ctx.settings.nats,
                ctx.urls,
                kinds=q.kind or (),
                since=since,
                from_start=q.from_start,
                ready=ready,
                queue_id=q.queue_id,
                until_end=q.until_end,
            )
            async with contextlib.aclosing(stream) as found:
                async for event in found:
                    await queue.put(event)
            await queue.put(None)

        task = asyncio.create_task(follow(), name="jsqueue-api-events")
        try:
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done() and not ready.is_set():
                task.result()  # raises StoreUnavailable: a 503 before the stream starts
                raise StoreUnavailable("events stream ended before it started")
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(call.request)
            await response.write(b": following the events stream\n\n")
            keepalive = ctx.settings.api.sse_keepalive_s
            loop = asyncio.get_running_loop()
            quiet_since = loop.time()
            while not _gone(call.request):
                try:
                    event = await asyncio.wait_for(queue.get(), min(keepalive, GONE_CHECK_S))
                except TimeoutError:
                    if task.done():
                        break
                    if loop.time() - quiet_since >= keepalive:
                        await response.write(b": keepalive\n\n")
                        quiet_since = loop.time()
                    continue
                if event is None:
                    break
                await response.write(sse_frame(event))
                quiet_since = loop.time()
            if task.done() and not task.cancelled() and task.exception() is not None:
                await response.write(b'event: error\ndata: {"error": "events stream failed"}\n\n')
            await response.write_eof()
            return response
        finally:
            await cancel_and_wait(task)
            with contextlib.suppress(asyncio.CancelledError, StoreUnavailable):
                await task

    return [
        Route(
            "GET",
            "/api/v1/events",
            "events",
            "Follow the events stream as server-sent events (text/event-stream).",
            Role.READ,
            events,
            query=EventsQuery,
            stream="text/event-stream",
            tag="events",
            description="New events only, unless since_s or from_start; until_end ends the "
            "stream once the events stored so far are sent.",
        )
    ]
