"""State-change events: what happened to which message, for other systems to consume.

Every state change of a queued message becomes one :class:`Event` (DESIGN.md §3, the
``events`` stream): received by the front end; delivered, deferred, bounced or expired per
recipient by a worker; held, released, flushed, deleted or bounced by an operator. Events
are JSON on ``Names.event_subject(kind)`` in the limits-retention events stream, so a
consumer can follow them live or replay them from any point (:func:`tail`).

The seam is :class:`Observer`: the worker, the front end and the admin operations call
``observer.emit(event)`` where a state change has been stored (after the compare-and-set,
never before). Implementations:

* :class:`NullObserver` - does nothing (the default everywhere);
* :class:`JetStreamPublisher` - publishes to the events stream in the background;
* :class:`Fanout` - hands each event to several observers (e.g. the publisher and
  :class:`jsqueue.metrics.Metrics`), isolating them from each other.

Publishing never blocks or fails delivery: :meth:`Observer.emit` is synchronous and only
appends to a bounded buffer; a background task publishes from it. When the buffer is full
the event is dropped; when a publish fails it is not retried. Both are logged (rate
limited) and counted (``dropped``, ``failed``), and the counts are exported as metrics.
Events are therefore a best-effort record, not the source of truth (KV is, DESIGN.md §2.2).

The front end and the worker import this module for the model and the Protocol only; the
NATS client is imported by the JetStream parts when they run (pure layers know nothing of
NATS, STYLE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry, Recipient, RecipientState, UTCDateTime, utcnow
from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names
from jsqueue.replies import Reply
from jsqueue.tasks import cancel_and_wait

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

log = logging.getLogger("jsqueue.events")

#: Events held in memory waiting to be published; further events are dropped (counted).
BUFFER_SIZE = 10_000
#: Events published concurrently by the background task.
PUBLISH_WINDOW = 64
#: Minimum pause between two warnings about dropped or failed events, seconds.
WARN_INTERVAL_S = 10.0


class EventKind(StrEnum):
    """What happened. Recipient-level kinds carry ``recipient``; the others do not."""

    RECEIVED = "received"  # the front end stored the message and answered 250
    DELIVERED = "delivered"  # a recipient was accepted by the next hop (2yz)
    DEFERRED = "deferred"  # a recipient failed temporarily (4yz) and will be retried
    BOUNCED = "bounced"  # a recipient failed permanently (5yz) or was bounced by an operator
    EXPIRED = "expired"  # a recipient's queue lifetime ran out (RFC 5321 §4.5.4.1)
    HELD = "held"  # an operator put the message on hold
    RELEASED = "released"  # an operator released a held message
    FLUSHED = "flushed"  # an operator asked for delivery now, overriding the backoff
    DELETED = "deleted"  # an operator deleted the message (no DSN)
    REQUEUED = "requeued"  # an operator requeued the message (leases dropped, due now)
    # the entry store refused an entry as too large: a worker recorded the replies cut
    # further, or held the message (detail says which and why)
    TOO_LARGE = "too_large"
    # a destination site is down (dead site, RFC 5321 §4.5.4.1) or answers again; these
    # carry ``site`` and no queue id
    SITE_DOWN = "site_down"
    SITE_UP = "site_up"
    # a delivery attempt ended without its outcome recorded (its worker stopped at the
    # drain bound, or crashed and its lease was taken over) and is sent again; with
    # ``uncertain`` the next hop may have the message already (RFC 5321 §6.1)
    INTERRUPTED = "interrupted"


class Event(BaseModel):
    """One state change, as published (JSON) on ``Names.event_subject(kind)``.

    Attributes:
        id: unique event id (32 hex characters); consumers may deduplicate on it.
        kind: what happened.
        at: when it was stored, aware UTC.
        queue_id: the message's queue id; empty for site events.
        site: the destination site (site events), else None.
        recipient: the forward-path concerned (recipient-level kinds), else None.
        domain: the recipient's routing domain (recipient-level kinds), else None.
        state: the recipient's state after the change (e.g. ``failed`` for a bounce that
            owes no DSN because the reverse-path is null), else None.
        reply: the SMTP reply recorded (with ``remote_host``, the MX that gave it).
        attempts: the recipient's attempt count after the change.
        next_attempt_at: when a deferred recipient is tried next.
        duration_s: how long the delivery attempt took, seconds (attempt outcomes only).
        reverse_path: the envelope sender (``""`` is ``<>``).
        recipients: every forward-path of the message (``received`` only).
        size: message size, octets (``received`` only).
        body_inline: ``received`` only: True when the front end kept the body inline in
            the KV entry (``smtp.inline_body_max``), False when it is in the object store.
        source: who changed the state: ``frontend``, ``worker:<owner>`` or ``admin``.
        detail: free text, e.g. why an admin action did what it did.
        uncertain: attempt outcomes only: True when the final ``.`` of DATA was sent and no
            usable reply came back (connection lost, timeout; RFC 5321 §4.5.3.2.6, §6.1):
            the recipient is retried, yet the next hop may have the message already, so it
            may be delivered twice. None otherwise.
        dkim: attempt outcomes only: the DKIM signing of the message sent (``d=… s=…
            a=…`` per signature, ``unsigned: <why>``; RFC 6376), None when no key applied.
    """

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    kind: EventKind
    at: UTCDateTime = Field(default_factory=utcnow)
    queue_id: str = ""
    site: str | None = None
    recipient: str | None = None
    domain: str | None = None
    state: RecipientState | None = None
    reply: Reply | None = None
    attempts: int | None = None
    next_attempt_at: UTCDateTime | None = None
    duration_s: float | None = None
    reverse_path: str | None = None
    recipients: list[str] | None = None
    size: int | None = None
    body_inline: bool | None = None
    source: str | None = None
    detail: str | None = None
    uncertain: bool | None = None
    dkim: str | None = None

    def to_json(self) -> bytes:
        """UTF-8 JSON without null fields (the published payload)."""
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Event:
        """Parse a published event.

        Raises:
            pydantic.ValidationError: not an event.
        """
        return cls.model_validate_json(data)


def received_event(entry: Entry, *, source: str = "frontend") -> Event:
    """The ``received`` event of a newly stored entry (its body layout as stored)."""
    return Event(
        kind=EventKind.RECEIVED,
        at=entry.created_at,
        queue_id=entry.id,
        reverse_path=entry.reverse_path,
        recipients=[r.address for r in entry.recipients],
        size=entry.size,
        body_inline=entry.inline_body is not None,
        source=source,
    )


def recipient_event(
    kind: EventKind,
    entry: Entry,
    recipient: Recipient,
    *,
    source: str,
    at: datetime | None = None,
    duration_s: float | None = None,
    detail: str | None = None,
    reply: Reply | None = None,
    uncertain: bool | None = None,
    dkim: str | None = None,
) -> Event:
    """A recipient-level event (delivered, deferred, bounced, expired) from the stored
    recipient: its state, reply, attempts and next attempt after the change. ``reply``
    replaces the stored reply (which an entry keeps bounded, :meth:`Reply.bounded`) by the
    whole one the attempt got; ``uncertain`` marks an outcome after a final ``.`` whose
    reply never came (see :attr:`Event.uncertain`); ``dkim`` is the attempt's signing."""
    return Event(
        kind=kind,
        at=at or utcnow(),
        queue_id=entry.id,
        recipient=recipient.address,
        domain=recipient.domain,
        state=recipient.state,
        reply=reply or recipient.last_reply,
        attempts=recipient.attempts,
        next_attempt_at=recipient.next_attempt_at,
        duration_s=duration_s,
        reverse_path=entry.reverse_path,
        source=source,
        detail=detail,
        uncertain=uncertain,
        dkim=dkim,
    )


def entry_event(
    kind: EventKind,
    entry: Entry,
    *,
    source: str = "admin",
    at: datetime | None = None,
    detail: str | None = None,
) -> Event:
    """A message-level event (held, released, flushed, deleted)."""
    return Event(
        kind=kind,
        at=at or utcnow(),
        queue_id=entry.id,
        reverse_path=entry.reverse_path,
        recipients=[r.address for r in entry.recipients],
        source=source,
        detail=detail,
    )


@runtime_checkable
class Observer(Protocol):
    """Receives every state change after it has been stored."""

    def emit(self, event: Event) -> None:
        """Take one event. Must return at once, never block on I/O and never raise."""
        ...


class NullObserver:
    """An :class:`Observer` that ignores everything (the default)."""

    def emit(self, event: Event) -> None:
        """Ignore ``event``."""


NULL_OBSERVER: Observer = NullObserver()
"""The shared no-op observer; stateless, so one instance serves everyone."""


class Fanout:
    """Hands each event to several observers; one that raises is logged and skipped, so it
    cannot break the caller or the other observers.

    Args:
        observers: the observers, called in order.
    """

    def __init__(self, *observers: Observer) -> None:
        self.observers: tuple[Observer, ...] = observers
        self.errors = 0

    def emit(self, event: Event) -> None:
        """Give ``event`` to every observer. Never raises."""
        for observer in self.observers:
            try:
                observer.emit(event)
            except Exception:
                self.errors += 1
                log.exception("observer %r failed on a %s event", observer, event.kind.value)


class _Throttle:
    """At most one log line per ``interval_s`` seconds, with the count of what was held back."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -float("inf")
        self._held_back = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return
        suffix = f" ({self._held_back} similar messages suppressed)" if self._held_back else ""
        self._last, self._held_back = now, 0
        log.warning(message + suffix, *args)


class JetStreamPublisher:
    """An :class:`Observer` that publishes events to the events stream in the background.

    :meth:`emit` appends to a buffer of at most ``buffer_size`` events (dropping the new event
    when full) and wakes the publishing task started by :meth:`start`. The task publishes
    up to ``PUBLISH_WINDOW`` events at a time, confirmed by one ack of the stream (for the
    last of them: :meth:`_publish`); a failed batch is counted and logged, never retried
    (no delivery waits for it). Use
    :func:`open_publisher` for a publisher with its own NATS connection, so event traffic
    never queues behind (or in front of) work-item acks.

    Attributes:
        published: events of batches whose last event the stream acknowledged (an event
            sent without a reply that the stream refused, e.g. during a leader election or
            over a limit, is counted here all the same: only the order is confirmed).
        dropped: events discarded because the buffer was full or the publisher closed.
        failed: events of batches whose ack failed (timeout, no stream, connection
            closed); some of them may be stored.

    Args:
        nc: a connected client (not closed by the publisher).
        names: object names (events stream and subjects).
        buffer_size: events held at most while waiting to be published.
        timeout_s: publish timeout per event, seconds.
    """

    def __init__(
        self,
        nc: NATS,
        names: Names,
        *,
        buffer_size: int = BUFFER_SIZE,
        timeout_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.names = names
        self.buffer_size = buffer_size
        self.published = 0
        self.dropped = 0
        self.failed = 0
        self._buffer: deque[Event] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._in_flight = 0
        self._task: asyncio.Task[None] | None = None
        self._warn_drop = _Throttle()
        self._warn_fail = _Throttle()

    @property
    def pending(self) -> int:
        """Events buffered or being published right now."""
        return len(self._buffer) + self._in_flight

    def emit(self, event: Event) -> None:
        """Buffer ``event`` for publishing. Never blocks, never raises."""
        if self._closed or len(self._buffer) >= self.buffer_size:
            self.dropped += 1
            self._warn_drop.warn(
                "events: buffer full or publisher closed; dropped a %s event of %s (%d dropped)",
                event.kind.value,
                event.queue_id,
                self.dropped,
            )
            return
        self._buffer.append(event)
        self._idle.clear()
        self._wake.set()

    def start(self) -> None:
        """Start the background publishing task on the running loop. Idempotent."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="jsqueue-events")

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything buffered so far has been published (or failed).

        Returns:
            True when the buffer drained within ``timeout_s`` seconds.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is buffered (within ``timeout_s`` seconds), then stop; events still
        buffered after that are counted as dropped. Idempotent."""
        if self._task is None or self._closed:
            self._closed = True
            self.dropped += len(self._buffer)
            self._buffer.clear()
            return
        await self.flush(timeout_s)
        self._closed = True
        await cancel_and_wait(self._task)
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.dropped += len(self._buffer)
        self._buffer.clear()

    async def _run(self) -> None:
        while True:
            if not self._buffer:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._buffer.popleft() for _ in range(min(PUBLISH_WINDOW, len(self._buffer)))]
            self._in_flight = len(batch)
            try:
                await self._publish(batch)
            except Exception as e:  # any failure of the client or the stream: counted, logged
                self.failed += len(batch)
                self._warn_fail.warn(
                    "events: publishing %d event(s) (the last a %s event of %s) failed: %r "
                    "(%d failed)",
                    len(batch),
                    batch[-1].kind.value,
                    batch[-1].queue_id,
                    e,
                    self.failed,
                )
            else:
                self.published += len(batch)
            finally:
                self._in_flight = 0

    async def _publish(self, batch: list[Event]) -> None:
        """Every event of ``batch`` but the last without a reply subject (nats-server
        stores it and answers nothing), then the last as a request for the stream's ack.
        nats-server handles one connection's messages, and a stream its messages, in order,
        so that ack says the server has handled the batch (not that it stored every event:
        a refusal of one sent without a reply is not seen, events being best effort): one
        request-reply per batch instead of per event.

        Raises:
            Exception: any failure of the ack's request (timeout, no stream, closed).
        """
        stream = self.names.events_stream
        headers = {"Nats-Expected-Stream": stream}  # as js.publish(stream=...) sets it
        for event in batch[:-1]:
            subject = self.names.event_subject(event.kind.value)
            await self.nc.publish(subject, event.to_json(), headers=dict(headers))
        last = batch[-1]
        await self.js.publish(
            self.names.event_subject(last.kind.value), last.to_json(), stream=stream
        )


@contextlib.asynccontextmanager
async def open_publisher(
    settings: NatsSettings, urls: list[str], names: Names | None = None
) -> AsyncIterator[JetStreamPublisher]:
    """A started :class:`JetStreamPublisher` on its own NATS connection; closed (buffer
    published within the request timeout) and disconnected on exit.

    The events stream must exist (:func:`jsqueue.store.jetstream.provision` creates it).

    Raises:
        StoreUnavailable: NATS unreachable within the connect timeout.
    """
    from jsqueue.store.jetstream import close_nats, connect_nats

    names = names or Names(settings.prefix)
    nc = await connect_nats(settings, urls)
    publisher = JetStreamPublisher(nc, names, timeout_s=settings.request_timeout_s)
    publisher.start()
    try:
        yield publisher
    finally:
        await publisher.close(settings.request_timeout_s)
        await close_nats(nc)


async def tail(
    settings: NatsSettings,
    urls: list[str],
    *,
    names: Names | None = None,
    kinds: Iterable[EventKind] = (),
    since: datetime | None = None,
    from_start: bool = False,
    ready: asyncio.Event | None = None,
    queue_id: str | None = None,
    until_end: bool = False,
) -> AsyncGenerator[Event, None]:
    """Follow the events stream (an ordered, ephemeral consumer: nothing is acked or kept).

    Args:
        settings: the ``nats`` settings section.
        urls: server URLs.
        names: object names; ``Names(settings.prefix)`` when None.
        kinds: only these kinds (all when empty).
        since: start with the events stored at or after this instant.
        from_start: start with the oldest event kept (the stream keeps 7 days).
        ready: set once the consumer exists (events stored later are certainly seen).
        queue_id: only the events of this message.
        until_end: stop once every event stored when the consumer caught up was yielded
            (no event pending), instead of following forever.

    Yields:
        events in stream order, forever (stop by closing the generator); without ``since``
        or ``from_start`` only events stored after the call. Payloads that are not events
        are logged and skipped.

    Raises:
        StoreUnavailable: NATS unreachable, or the events stream does not exist.
    """
    import nats.errors
    from nats.js import api

    from jsqueue.store.jetstream import close_nats, connect_nats

    names = names or Names(settings.prefix)
    wanted = {k.value for k in kinds}
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
    if from_start:
        config.deliver_policy = api.DeliverPolicy.ALL
    elif since is not None:
        config.deliver_policy = api.DeliverPolicy.BY_START_TIME
        config.opt_start_time = since
    nc = await connect_nats(settings, urls)
    try:
        js = nc.jetstream(timeout=settings.request_timeout_s)
        try:
            sub = await js.subscribe(
                names.event_subject(">"),
                stream=names.events_stream,
                ordered_consumer=True,
                config=config,
            )
        except (nats.errors.Error, TimeoutError, OSError) as e:
            raise StoreUnavailable(f"events stream {names.events_stream}: {e!r}") from e
        if ready is not None:
            ready.set()
        prefix = names.event_subject("")
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                if until_end and await _caught_up(sub):
                    return
                continue
            except nats.errors.Error as e:
                raise StoreUnavailable(f"events stream {names.events_stream}: {e!r}") from e
            kind = msg.subject[len(prefix) :]
            if not wanted or kind in wanted:
                try:
                    event = Event.from_json(msg.data)
                except ValidationError as e:
                    log.warning("events: skipping a non-event on %s: %s", msg.subject, e)
                else:
                    if queue_id is None or event.queue_id == queue_id:
                        yield event
            if until_end and msg.metadata.num_pending == 0:
                return
    finally:
        await close_nats(nc)


async def _caught_up(sub: Any) -> bool:
    """Whether the ordered consumer behind ``sub`` has nothing pending (after a quiet
    second with no message: an empty stream, or a start point past the last event).

    Raises:
        StoreUnavailable: the consumer info request failed (NATS error, timeout, socket).
    """
    import nats.errors

    try:
        info = await sub.consumer_info()
    except (nats.errors.Error, TimeoutError, OSError) as e:
        raise StoreUnavailable(f"events stream: {e!r}") from e
    return bool(info.num_pending == 0)


def attempt_events(
    entry: Entry,
    groups: Sequence[tuple[EventKind, Sequence[Recipient]]],
    *,
    source: str,
    at: datetime,
    duration_s: float | None,
    replies: Mapping[str, Reply] | None = None,
    uncertain: Collection[str] = (),
    dkim: str | None = None,
) -> list[Event]:
    """The events of one recorded delivery attempt, one per recipient (worker helper).

    ``replies`` are the attempt's replies by address, whole: an event carries them instead
    of the bounded ones the entry keeps (:meth:`Reply.bounded`). The events of the
    addresses in ``uncertain`` carry ``uncertain=True`` (RFC 5321 §6.1); each carries
    ``dkim``, the attempt's DKIM signing.
    """
    whole = replies or {}
    return [
        recipient_event(
            kind,
            entry,
            r,
            source=source,
            at=at,
            duration_s=duration_s,
            reply=whole.get(r.address),
            uncertain=True if r.address in uncertain else None,
            dkim=dkim,
        )
        for kind, rcpts in groups
        for r in rcpts
    ]
