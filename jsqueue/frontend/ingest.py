"""The ingest path: make one received message durable, then name the queue id for the 250.

No socket here: the SMTP session (:mod:`jsqueue.frontend.session`) writes the message into
a :class:`BodyUpload` as it arrives and hands it to :meth:`Ingest.commit` with the
transaction (:class:`Submission`); commit stores body, entry and work items and returns the
queue id, or raises :exc:`NotQueued` carrying the ``451 4.3.0`` reply to send, never a 250
for what is not stored (DESIGN.md §2.1). How the steps, the cleanup after a failure and the
resend protection of the ingest log fit together: docs/architecture.md, "The SMTP front end".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Container, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsqueue.config import SmtpSettings
from jsqueue.envelope import Entry, Recipient, WorkItem, utcnow
from jsqueue.errors import EntryDeleted, EntryNotFound, JsqueueError, StoreFull, reason
from jsqueue.events import NULL_OBSERVER, Observer, received_event
from jsqueue.replies import R451_LOCAL_ERROR, R452_STORAGE_FULL, Reply
from jsqueue.store.base import BodyInfo, BodyStore, IngestLog, Stores
from jsqueue.store.deadline import retry_store_for
from jsqueue.store.layout import one_chunk
from jsqueue.tasks import cancel_and_wait

log = logging.getLogger(__name__)

#: Octets handed to the body store per chunk (DESIGN.md §7: 256 KiB-1 MiB chunks are fast).
BODY_CHUNK = 256 * 1024

#: Seconds a cancelled upload has to take back its chunks before it is cancelled again
#: (:func:`jsqueue.tasks.cancel_and_wait`): one cancellation can be lost, and the upload
#: would then wait for ever for the next chunk of a session that ended.
CANCEL_AGAIN_S = 10.0


def ingest_key(
    *,
    reverse_path: str,
    recipients: Sequence[Recipient],
    ret: str | None,
    envid: str | None,
    smtputf8: bool,
    auth_user: str | None,
    client_address: str | None,
    content_sha256: bytes,
) -> str:
    """The idempotent-ingest key: SHA-256 hex of the client, the envelope and its content.

    Pure: the same transaction always gives the same key.

    Args:
        reverse_path: the MAIL FROM address (``""`` for ``<>``).
        recipients: the accepted recipients, in RCPT order (address, ORCPT and NOTIFY count).
        ret: the RET parameter (RFC 3461 §4.3), or None.
        envid: the ENVID parameter, decoded (RFC 3461 §4.4), or None.
        smtputf8: MAIL carried SMTPUTF8 (RFC 6531 §3.4).
        auth_user: the authenticated user (RFC 4954), or None.
        client_address: the client's IP address, or None. A resend comes from the client
            that lost the ``250`` (RFC 5321 §6.1); the same text from another client (two
            hosts sending one alert) is a message of its own. Should a client resend from
            another address, it is stored twice: a duplicate, never a loss.
        content_sha256: the 32-octet digest of the message as the client sent it (dots
            unstuffed), without our ``Received:`` header, which differs on every attempt.

    Returns:
        64 lower-case hex digits.
    """
    envelope = [
        reverse_path,
        [[r.address, r.orcpt, sorted(r.notify or ())] for r in recipients],
        ret,
        envid,
        smtputf8,
        auth_user,
        client_address,
    ]
    h = hashlib.sha256(json.dumps(envelope, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update(content_sha256)
    return h.hexdigest()


async def _stopped(fut: asyncio.Future[Any] | None) -> None:
    """Cancel ``fut`` unless done and wait until it has stopped; its outcome is not needed
    (a failure is reported by whoever noticed first)."""
    if fut is None:
        return
    await cancel_and_wait(fut, again_s=CANCEL_AGAIN_S)
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not report it as lost


class NotQueued(Exception):
    """The message was not stored; ``reply`` is what the client gets instead of a 250
    (DESIGN.md §2.1): 452 4.3.1 when the store is full (RFC 5321 §4.2.3 "insufficient
    system storage", RFC 3463 X.3.1), else 451 4.3.0; ``reason`` says which step failed
    (for logs and the HTTP API's 503, not for SMTP clients)."""

    def __init__(self, queue_id: str, reason: str, *, full: bool = False) -> None:
        super().__init__(f"{queue_id}: not queued: {reason}")
        self.queue_id = queue_id
        self.reason = reason
        self.reply: Reply = R452_STORAGE_FULL if full else R451_LOCAL_ERROR


@dataclass(frozen=True)
class Submission:
    """One mail transaction as the client submitted it, all that the entry needs beside the
    body.

    Attributes:
        reverse_path: the MAIL FROM address (``""`` for the null reverse-path ``<>``).
        recipients: the accepted recipients (at least one), repeats already removed.
        ret: RET (RFC 3461 §4.3), or None.
        envid: ENVID, decoded (RFC 3461 §4.4), or None.
        smtputf8: MAIL carried SMTPUTF8 (RFC 6531 §3.4).
        helo: the client's HELO/EHLO argument, or None.
        client_address: the client's IP address as text, or None.
        auth_user: the authenticated user (RFC 4954), or None.
        eight_bit: some octet of the stored message (``Received:`` included) is not
            US-ASCII (RFC 6152).
        content_sha256: digest of the content as the client sent it (see :func:`ingest_key`).
        request_digest: the HTTP inject request's digest (``Entry.request_digest``), or
            None.
    """

    reverse_path: str
    recipients: Sequence[Recipient]
    content_sha256: bytes
    ret: Literal["FULL", "HDRS"] | None = None
    envid: str | None = None
    smtputf8: bool = False
    helo: str | None = None
    client_address: str | None = None
    auth_user: str | None = None
    eight_bit: bool = False
    request_digest: str | None = None


class BodyUpload:
    """Streams one message into :meth:`BodyStore.put` in :data:`BODY_CHUNK` chunks.

    The put starts when the first chunk is full (or at :meth:`finish`), so a small or
    rejected message never touches the store before the end of DATA. Every hand-over waits
    at most ``timeout_s`` seconds for the store; after a failure further writes are dropped
    and :attr:`error` says why. A message of at most ``inline_max`` octets (never more than
    :data:`BODY_CHUNK`) is not stored: :meth:`finish` leaves it in :attr:`inline`.

    Attributes:
        queue_id: the object name the body is stored under.
        error: what stopped the upload, None while it goes on.
        inline: the whole message after :meth:`finish` when it is kept inline, else None.
    """

    def __init__(
        self, bodies: BodyStore, queue_id: str, timeout_s: float, inline_max: int = 0
    ) -> None:
        """Args:
        bodies: the body store.
        queue_id: the new message's queue id (a fresh object name: ``put(fresh=True)``).
        timeout_s: longest wait for the store to take one chunk, seconds.
        inline_max: largest message kept inline, octets (0: none).
        """
        self.queue_id = queue_id
        self._bodies = bodies
        self._timeout_s = timeout_s
        self._inline_max = min(inline_max, BODY_CHUNK)
        self._buf = bytearray()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)
        self._task: asyncio.Task[BodyInfo] | None = None
        self._touched = False
        self.error: BaseException | None = None
        self.inline: bytes | None = None

    async def write(self, data: bytes) -> None:
        """Append message octets (CRLF line ends); hands full chunks to the store.

        Never raises for a store failure: that is kept in :attr:`error` and raised by
        :meth:`finish`, so the session can read the rest of DATA first.
        """
        if self.error is not None:
            return
        self._buf += data
        while len(self._buf) >= BODY_CHUNK and self.error is None:
            chunk = bytes(self._buf[:BODY_CHUNK])
            del self._buf[:BODY_CHUNK]
            await self._hand(chunk)
        if self.error is not None:
            self._buf.clear()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def _hand(self, item: bytes | None) -> None:
        if self._task is None:
            self._touched = True
            self._task = asyncio.create_task(
                self._bodies.put(self.queue_id, self._chunks(), fresh=True)
            )
        put = asyncio.ensure_future(self._queue.put(item))
        done, _ = await asyncio.wait(
            (put, self._task), timeout=self._timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if put in done:
            return
        put.cancel()
        if self._task.done() and not self._task.cancelled():
            self.error = self._task.exception() or RuntimeError("body store stopped reading")
        else:
            self.error = TimeoutError(f"body store took no chunk within {self._timeout_s} s")

    async def finish(self) -> BodyInfo:
        """Hand over the rest and wait for the store's answer; a message small enough to be
        kept inline is not stored but left in :attr:`inline` (size and digest computed here).

        Returns:
            size (octets) and SHA-256 hex digest of the whole message.

        Raises:
            StoreError: the body store failed (the stored error, or the store's own).
            TimeoutError: the store took no chunk within ``timeout_s``.
            OSError: the store's connection failed.
        """
        if self.error is not None:
            raise self.error
        if self._task is None:
            data = bytes(self._buf)
            self._buf.clear()
            if len(data) <= self._inline_max:
                self.inline = data
                return BodyInfo(size=len(data), digest=hashlib.sha256(data).hexdigest())
            self._touched = True
            return await self._bodies.put(self.queue_id, one_chunk(data), fresh=True)
        for item in (bytes(self._buf), None):
            if item != b"":
                await self._hand(item)
            if self.error is not None:
                raise self.error
        self._buf.clear()
        return await self._task

    async def store_inline(self) -> BodyInfo:
        """Store the body :meth:`finish` left inline after all (the entry would be too large
        with it); :attr:`inline` is None afterwards.

        Raises:
            StoreError: the body store failed.
        """
        assert self.inline is not None
        data, self.inline = self.inline, None
        self._touched = True
        return await self._bodies.put(self.queue_id, one_chunk(data), fresh=True)

    async def abort(self) -> None:
        """Stop the upload and delete whatever reached the store. Best effort: a failing
        delete is logged (the orphan sweep collects the body), nothing is raised.
        Idempotent."""
        self._buf.clear()
        self.inline = None
        if self._task is not None:
            await cancel_and_wait(self._task, again_s=CANCEL_AGAIN_S)
            if not self._task.cancelled():
                self._task.exception()  # retrieved: the failure is reported by the caller
        if not self._touched:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._bodies.delete(self.queue_id)
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning(
                "body %s: delete after a failed ingest failed (%s); left for the "
                "queue's orphan sweep",
                self.queue_id,
                reason(e),
            )


class Ingest:
    """Commits received messages to the stores (docs/architecture.md, "The SMTP front end").

    One per front end; shared by all its sessions. With ``settings.dedupe_window_s`` > 0 and
    an ingest log in ``stores``, a resend of an identical transaction within the window is
    answered with the first copy's queue id and not stored again.
    """

    def __init__(
        self, settings: SmtpSettings, stores: Stores, observer: Observer = NULL_OBSERVER
    ) -> None:
        """Args:
        settings: the ``smtp`` settings section (``store_timeout_s``, ``inline_body_max``,
            ``dedupe_window_s``).
        stores: body store, entry store, scheduler and (optionally) ingest log.
        observer: receives a ``received`` event per message queued (jsqueue.events).
        """
        self._settings = settings
        self._stores = stores
        self._observer = observer
        self._log: IngestLog | None = stores.ingest if settings.dedupe_window_s > 0 else None

    def upload(self, queue_id: str) -> BodyUpload:
        """A new upload of message ``queue_id`` into the body store (nothing stored yet)."""
        s = self._settings
        return BodyUpload(
            self._stores.bodies, queue_id, s.store_timeout_s, inline_max=s.inline_body_max
        )

    async def _earlier_copy(self, key: str, queue_id: str, mine: Container[str]) -> str | None:
        """The queue id of an identical message queued within the window, if any; else
        ``queue_id`` is recorded under ``key`` (one write: :meth:`IngestLog.claim`).

        Best effort: a failing lookup counts as "none" (the message is then queued anew).
        A record whose entry was deleted (delivered and removed, or deleted by an operator:
        the entry store keeps a delete marker) names a copy that was stored: the resend is
        that copy (RFC 5321 §6.1). A record whose entry was never stored, or was discarded
        after its ingest failed (answered 451, :meth:`EntryStore.discard` leaves no marker),
        is replaced by ours.
        """
        assert self._log is not None
        try:
            found = await self._log.claim(key, queue_id, self._settings.dedupe_window_s)
            if found is None or found in mine:
                return None
            await self._stores.entries.get(found)
        except EntryDeleted:
            return found
        except EntryNotFound:
            await self._record(key, queue_id)
            return None
        except (JsqueueError, OSError) as e:
            log.warning("ingest log lookup failed (%s); queueing as new", e)
            return None
        return found

    def key_for(self, mail: Submission) -> str | None:
        """The content key of ``mail`` in the ingest log (:func:`ingest_key`); None when
        resend protection is off (``smtp.dedupe_window_s`` = 0 or no ingest log)."""
        if self._log is None:
            return None
        return ingest_key(
            reverse_path=mail.reverse_path,
            recipients=mail.recipients,
            ret=mail.ret,
            envid=mail.envid,
            smtputf8=mail.smtputf8,
            auth_user=mail.auth_user,
            client_address=mail.client_address,
            content_sha256=mail.content_sha256,
        )

    async def forget(self, key: str, queue_id: str) -> None:
        """The client saw the ``250`` for ``queue_id``: it sent a further command or QUIT
        on that session. The resend protection of that message ends (RFC 5321 §6.1: only a
        client that may have lost the ``250`` sends the same transaction again), so an
        identical transaction later is queued as the new message it is. Best effort within
        ``smtp.store_timeout_s``: a failure is logged, and at worst a later identical
        message is answered with the first one's id. Never raises.
        """
        if self._log is None:
            return
        try:
            async with asyncio.timeout(self._settings.store_timeout_s):
                await self._log.forget(key, queue_id)
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning("%s: ingest record kept (forgetting it failed: %s)", queue_id, reason(e))

    async def commit(self, upload: BodyUpload, mail: Submission, mine: Container[str] = ()) -> str:
        """Store body, entry and work items of one message; the queue id for the 250.

        Steps, all within ``smtp.store_timeout_s``: finish the body upload while claiming
        the ingest key (resend protection); once the body is stored, create the entry and
        publish one work item per recipient domain at the same time. Every write of these
        steps retries temporary failures until ``smtp.store_timeout_s`` has passed
        (:func:`~jsqueue.store.deadline.retry_store_for`), each try with the same message
        id: with one node of three lost, the client sees the election's stall (~4–9 s,
        DESIGN.md §6), not a ``451``. On failure the entry, work items and body are
        removed again, best effort (DESIGN.md §2.1; RFC 5321 §6.1: the 250 is the moment
        responsibility passes).

        Args:
            upload: the message written so far (``Received:`` first); finished or aborted
                here, so it must not be used afterwards.
            mail: the transaction (at least one recipient).
            mine: queue ids the same client session queued before: an identical message
                naming one of them is not a resend (a client resends on a new connection,
                RFC 5321 §6.1) but a message of its own, as when a script sends the same
                text twice in one session, pipelined (RFC 2920 §3.1).

        Returns:
            ``upload.queue_id``, or the queue id of an identical message queued within
            ``smtp.dedupe_window_s`` (the body is then discarded). Idempotent in that sense:
            a resend within the window is stored once.

        Raises:
            NotQueued: some store failed or timed out (or an unexpected error); its
                ``reply`` is ``452 4.3.1`` when a store was full, else ``451 4.3.0``, and
                nothing of the message remains stored (cleanup failures are logged and left
                for the orphan sweep).
        """
        queue_id = upload.queue_id
        key = self.key_for(mail)
        stage = "body"
        body: asyncio.Future[BodyInfo] | None = None
        try:
            with retry_store_for(self._settings.store_timeout_s):
                async with asyncio.timeout(self._settings.store_timeout_s):
                    # Body and ingest-log claim at the same time; the entry and the work items
                    # once the body is stored (an entry never names a body that failed).
                    body = asyncio.ensure_future(upload.finish())
                    earlier = await self._earlier_copy(key, queue_id, mine) if key else None
                    if earlier is not None:
                        await _stopped(body)
                        await upload.abort()
                        log.info("%s: resend of %s within the dedupe window", queue_id, earlier)
                        return earlier
                    info = await body
                    entry = Entry(
                        id=queue_id,
                        reverse_path=mail.reverse_path,
                        recipients=list(mail.recipients),
                        created_at=utcnow(),
                        size=info.size,
                        digest=info.digest,
                        helo=mail.helo,
                        client_address=mail.client_address,
                        envid=mail.envid,
                        ret=mail.ret,
                        smtputf8=mail.smtputf8,
                        body_8bit=mail.eight_bit,
                        inline_body=upload.inline,
                        request_digest=mail.request_digest,
                    )
                    if upload.inline is not None and not self._fits(entry):
                        entry.inline_body = None
                        info = await upload.store_inline()
                    stage = "entry and work items"
                    # Both at once: two round trips before the 250, not three. A worker that
                    # gets an item before the entry is stored tries it again shortly
                    # (jsqueue.state.CREATE_GRACE_S). Should either fail, the entry and items
                    # are removed without a trace; a resend then finds the ingest record of this
                    # id without its entry and takes its place.
                    stored = await asyncio.gather(
                        self._stores.entries.create(entry),
                        *(
                            self._stores.scheduler.schedule(WorkItem(queue_id, d))
                            for d in entry.domains
                        ),
                        return_exceptions=True,
                    )
                    for result in stored:
                        if isinstance(result, BaseException):
                            raise result
        except (JsqueueError, TimeoutError, OSError) as e:
            log.warning("%s: not queued (%s failed: %r); answering 451", queue_id, stage, e)
            await _stopped(body)
            await self._cleanup(queue_id, upload, stage)
            full = isinstance(e, StoreFull)
            raise NotQueued(queue_id, f"{stage} failed: {e!r}", full=full) from e
        except Exception as e:  # a bug: still never 250 for what is not stored; say so loudly
            log.exception("%s: not queued (%s failed unexpectedly); answering 451", queue_id, stage)
            await _stopped(body)
            await self._cleanup(queue_id, upload, stage)
            raise NotQueued(queue_id, f"{stage} failed unexpectedly: {e!r}") from e
        log.info(
            "%s: queued from=<%s> nrcpt=%d size=%d",
            queue_id,
            mail.reverse_path,
            len(mail.recipients),
            info.size,
        )
        self._observer.emit(received_event(entry))
        return queue_id

    def _fits(self, entry: Entry) -> bool:
        """Whether ``entry`` with its inline body stays within half the entry store's
        largest value (room for the replies and leases it gathers as it is delivered)."""
        return len(entry.to_json()) <= self._stores.entries.max_value_size // 2

    async def _record(self, key: str, queue_id: str) -> None:
        assert self._log is not None
        try:
            async with asyncio.timeout(self._settings.store_timeout_s):
                await self._log.record(key, queue_id)
        except (JsqueueError, TimeoutError, OSError) as e:
            # The message is queued; only the resend protection is missing.
            log.warning("%s: queued, but the ingest record failed (%s)", queue_id, reason(e))

    async def _cleanup(self, queue_id: str, upload: BodyUpload, stage: str) -> None:
        """Remove what a failed ingest stored: entry and work items first (so no worker
        starts on them), then the body. Best effort: a work item left behind is dropped
        once its grace ends, an entry left behind is the orphan sweep's."""
        if stage != "body":
            try:
                async with asyncio.timeout(self._settings.store_timeout_s):
                    discarded, _ = await asyncio.gather(
                        # no delete marker: to a resend, this message was never stored
                        self._stores.entries.discard(queue_id),
                        self._stores.scheduler.cancel(queue_id),
                        return_exceptions=True,
                    )
                failed = discarded
            except TimeoutError as e:
                failed = e
            if isinstance(failed, BaseException):
                # The entry may still be there, and a resend may be answered with its id:
                # it keeps its body, so the reconciler delivers it (once) rather than the
                # resend getting an id with nothing behind it.
                log.warning(
                    "%s: removing the entry after a failed ingest failed (%s); entry and "
                    "body left for the reconciler",
                    queue_id,
                    reason(failed),
                )
                return
        await upload.abort()
