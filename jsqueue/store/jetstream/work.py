"""Work and scheduler: :class:`JetStreamScheduler`, the scheduler on the work stream and
its shared durable pull consumer (a retry is a NAK with delay, DESIGN.md §1), and
:class:`JetStreamDue`, one fetched work item with its ack, NAK, term and in-progress.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from jsqueue.envelope import WorkItem
from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, check_domain, check_queue_id
from jsqueue.store.base import AckPending, Due
from jsqueue.store.jetstream.api import (
    HDR_MSG_ID,
    NATS_FAILURES,
    PUBLISH_ATTEMPTS,
    publish,
    translate,
    unavailable,
)

log = logging.getLogger("jsqueue.store.jetstream")

#: Header of a work item: when it is due, Unix milliseconds.
NOT_BEFORE_HEADER = "Jsq-Not-Before"


class JetStreamDue:
    """A work item fetched from the durable consumer; see :class:`~jsqueue.store.base.Due`.

    Settling twice is a no-op (like the memory scheduler). Acks are fire-and-forget: if one
    is lost the item is redelivered after the ack wait, which the KV re-check makes harmless
    (DESIGN.md §2.2).
    """

    def __init__(self, msg: Msg, item: WorkItem, deliveries: int) -> None:
        self.item = item
        self.deliveries = deliveries
        self.msg = msg
        self._settled = False

    async def _settle(self, what: str, action: Callable[[], Awaitable[None]]) -> None:
        if self._settled:
            return
        try:
            await action()
        except nats.errors.MsgAlreadyAckdError:
            pass
        except NATS_FAILURES as e:
            raise unavailable(
                f"work item {self.item.queue_id}/{self.item.domain}: {what}", e
            ) from e
        self._settled = True

    async def ack(self) -> None:
        """Done: the item is removed for good.

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("ack", self.msg.ack)

    async def retry(self, delay_s: float) -> None:
        """NAK with a delay: delivered again in ``delay_s`` seconds (>= 0).

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("nak", lambda: self.msg.nak(delay=max(0.0, delay_s)))

    async def term(self) -> None:
        """Drop the item for good without delivering it again.

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("term", self.msg.term)

    async def in_progress(self) -> None:
        """Restart the ack-wait timer. A no-op once settled.

        Raises:
            StoreUnavailable: the connection is closed.
            unavailable: the StoreUnavailable above, as built by
                :func:`~jsqueue.store.jetstream.api.unavailable`.
        """
        if self._settled:
            return
        try:
            await self.msg.in_progress()
        except NATS_FAILURES as e:
            raise unavailable(f"work item {self.item.queue_id}: in progress", e) from e


def _encode_item(item: WorkItem) -> bytes:
    return json.dumps(
        {"id": item.queue_id, "domain": item.domain, "generation": item.generation},
        separators=(",", ":"),
    ).encode()


def _not_before(msg: Msg) -> float:
    """The item's due instant (Unix seconds); 0 (due) when the header is absent or bad."""
    try:
        return int((msg.headers or {}).get(NOT_BEFORE_HEADER, "0")) / 1000
    except ValueError:
        return 0.0


def _decode_item(data: bytes) -> WorkItem:
    raw = json.loads(data)
    return WorkItem(
        queue_id=check_queue_id(raw["id"]),
        domain=raw["domain"],
        generation=int(raw.get("generation", 0)),
    )


class JetStreamScheduler:
    """:class:`~jsqueue.store.base.Scheduler` on the work stream and its durable consumer.

    A work item is a message on ``Names.work_subject(queue_id, domain)`` carrying
    ``{id, domain, generation}``, a ``Nats-Msg-Id`` (:meth:`Names.work_msg_id`) and a
    ``Jsq-Not-Before`` header (Unix ms). :meth:`fetch` NAKs items that arrive before that
    instant with the remaining delay. A retry is a NAK with delay (DESIGN.md §1): it counts
    as ack-pending, which is why ``max_ack_pending`` must exceed the deferred backlog.

    Fetches are serialised per instance (one pull request at a time on its inbox); use one
    scheduler per worker loop, or accept that concurrent callers queue.

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.names = names
        self._nc = nc
        self._timeout_s = timeout_s
        self._sub: JetStreamContext.PullSubscription | None = None
        self._fetch_lock = asyncio.Lock()

    async def _publish_item(self, item: WorkItem, at: datetime | None, msg_id: str) -> None:
        subject = self.names.work_subject(item.queue_id, item.domain)
        if at is not None and at.tzinfo is None:
            raise ValueError("schedule time must be timezone-aware")
        not_before = at.timestamp() if at is not None else time.time()
        headers = {HDR_MSG_ID: msg_id, NOT_BEFORE_HEADER: str(int(not_before * 1000))}
        what = f"work item {item.queue_id}/{item.domain}: publish"
        budget_s = PUBLISH_ATTEMPTS * self._timeout_s
        try:
            await publish(
                self.js, subject, _encode_item(item), headers, what=what, budget_s=budget_s
            )
        except nats.js.errors.APIError as e:
            raise unavailable(what, e) from e

    async def schedule(self, item: WorkItem, at: datetime | None = None) -> None:
        """See :meth:`Scheduler.schedule`. A timed-out publish is retried with the same
        ``Nats-Msg-Id``, so it is stored once.

        Raises:
            InvalidName: the item's queue id or domain is not valid.
            ValueError: ``at`` is naive.
            StoreUnavailable: the publish was refused, or every try failed.
        """
        msg_id = self.names.work_msg_id(item.queue_id, item.domain, item.generation)
        await self._publish_item(item, at, msg_id)

    async def flush(self, item: WorkItem) -> None:
        """See :meth:`Scheduler.flush`: purge the (queue id, domain) subject, publish due now.

        The new message gets its own ``Nats-Msg-Id`` so the dedupe window cannot swallow it
        when ``item`` equals the purged one.
        """
        subject = self.names.work_subject(item.queue_id, item.domain)
        with translate(f"work item {item.queue_id}/{item.domain}: flush"):
            await self.js.purge_stream(self.names.work_stream, subject=subject)
        base = self.names.work_msg_id(item.queue_id, item.domain, item.generation)
        await self._publish_item(item, None, f"{base}:flush:{uuid.uuid4().hex}")

    async def cancel(self, queue_id: str) -> None:
        """See :meth:`Scheduler.cancel`."""
        subject = self.names.work_subjects_of(queue_id)
        with translate(f"work items of {queue_id}: cancel"):
            await self.js.purge_stream(self.names.work_stream, subject=subject)

    async def backlog(self) -> int:
        """See :meth:`Scheduler.backlog`: consumer num_pending + num_ack_pending."""
        figures = await self.ack_pending()
        return figures.waiting + figures.ack_pending

    async def ack_pending(self) -> AckPending:
        """The consumer's num_ack_pending, num_pending and max_ack_pending (one consumer
        info request), for the saturation alert (:mod:`jsqueue.saturation`).

        Raises:
            StoreUnavailable: the request failed.
        """
        with translate("work consumer: info"):
            info = await self.js.consumer_info(self.names.work_stream, self.names.work_consumer)
        return AckPending(
            ack_pending=int(info.num_ack_pending or 0),
            waiting=int(info.num_pending or 0),
            limit=int(info.config.max_ack_pending or 0),
        )

    async def _subscription(self) -> JetStreamContext.PullSubscription:
        if self._sub is None:
            with translate("work consumer: bind"):
                self._sub = await self.js.pull_subscribe_bind(
                    durable=self.names.work_consumer, stream=self.names.work_stream
                )
        return self._sub

    async def fetch(self, batch: int, timeout_s: float) -> list[Due]:
        """See :meth:`Scheduler.fetch`.

        Items whose ``Jsq-Not-Before`` lies in the future are NAKed with the remaining delay
        and not returned; undecodable items are terminated (logged).

        Raises:
            StoreUnavailable: the connection is closed or the consumer is gone.
            unavailable: the StoreUnavailable above, as built by
                :func:`~jsqueue.store.jetstream.api.unavailable`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._fetch_lock:
            sub = await self._subscription()
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0.001:
                    return []
                if self._nc.is_closed:
                    raise StoreUnavailable("work consumer: fetch: connection closed")
                try:
                    msgs = await sub.fetch(max(1, batch), timeout=remaining)
                except TimeoutError:  # nats-py raises its own and asyncio's: nothing due
                    return []
                except NATS_FAILURES as e:
                    raise unavailable("work consumer: fetch", e) from e
                out: list[Due] = []
                for msg in msgs:
                    due = await self._accept(msg)
                    if due is not None:
                        out.append(due)
                if out:
                    return out

    async def _accept(self, msg: Msg) -> JetStreamDue | None:
        try:
            item = _decode_item(msg.data)
            check_domain(item.domain)
        except (ValueError, KeyError, TypeError) as e:
            log.error("terminating undecodable work item on %s: %s", msg.subject, e)
            with translate("work item: term"):
                await msg.term()
            return None
        wait_s = _not_before(msg) - time.time()
        if wait_s > 0:
            with translate(f"work item {item.queue_id}/{item.domain}: nak"):
                await msg.nak(delay=wait_s)
            return None
        return JetStreamDue(msg, item, msg.metadata.num_delivered)
