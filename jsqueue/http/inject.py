"""HTTP injection through the SMTP front end's ingest path (:mod:`jsqueue.frontend.ingest`),
with ``Idempotency-Key`` resend protection in the ingest log.

A message injected over HTTP is stored exactly as one received over SMTP: a ``Received:``
trace field (RFC 5321 §4.4, ``with HTTP``) is prepended, the body streams into the body
store (or inline, ``smtp.inline_body_max``), the entry and one work item per destination
domain are created, and only then is the queue id returned, as SMTP's ``250`` (DESIGN.md
§2.1). A store failure raises :class:`NotQueued` (HTTP 503), never a queue id.

Idempotency (``Idempotency-Key``, scoped to the token's name, ``api.idempotency_window_s``):

1. a *stored* record (written after the message is durable) answers with the first queue id,
   even when that message has been delivered and removed meanwhile;
2. otherwise the key is claimed in the ingest log (one create-if-absent write), so two
   requests with the same key race for one claim; the loser waits (up to
   ``smtp.store_timeout_s`` from the winner's last write of the claim) for the winner's
   stored record, or its entry, and answers with its id; if neither comes (the winner
   failed or died), it takes the claim over with a compare-and-set, so that of several
   waiters one stores and the others wait for it; the winner renews its claim the same way
   before its entry is written, and a winner that finds its claim taken over stores
   nothing (503; its retry then gets the id of the request that took over);
3. a different key never merges: SMTP's content-based resend protection is off here;
4. the same key with a different request (another envelope or message: the request's
   SHA-256 ``fingerprint`` differs) is refused with :class:`RequestRejected` (HTTP 422, as
   draft-ietf-httpapi-idempotency-key-header §2.7 has it) and stores nothing, rather than
   answering with the first queue id and dropping the second message. The winner records
   its fingerprint *before* it stores (and again just before its stored record), and the
   verdict reads that record through the stream leader (``consistent``), so whatever a
   loser has seen of the first message (its stored record or its entry), the fingerprint
   record is there to compare with: a retry is never refused, and a different request is
   never taken for a retry.

Requests with the same key are also serialised within one process (a lock per key). The
records live in the NATS servers' memory (the ingest log): a full NATS restart forgets
them, and a retry after that is stored again (a duplicate, never a loss).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from jsqueue.config import Settings
from jsqueue.envelope import utcnow
from jsqueue.errors import EntryNotFound, RequestRejected, StoreUnavailable
from jsqueue.events import Event, Observer
from jsqueue.frontend.data import received_count
from jsqueue.frontend.ingest import Ingest, NotQueued, Submission
from jsqueue.frontend.received import received_header
from jsqueue.http.auth import Token
from jsqueue.http.message import Transaction
from jsqueue.http.models import InjectResult
from jsqueue.names import new_queue_id
from jsqueue.store.base import Stores

log = logging.getLogger("jsqueue.http.inject")

#: The ``Idempotency-Key`` header: 1-255 visible ASCII characters.
IDEMPOTENCY_KEY_RE = re.compile(r"^[!-~]{1,255}$")
#: Pause between two looks for a concurrent request's stored record, seconds.
POLL_S = 0.1

__all__ = ["IDEMPOTENCY_KEY_RE", "Injector", "NotQueued", "Submitter"]


class _Relabel:
    """An :class:`Observer` that names the token as the ``source`` of the events it passes on
    (the ingest path emits ``received`` as the front end)."""

    def __init__(self, observer: Observer, source: str) -> None:
        self._observer = observer
        self._source = source

    def emit(self, event: Event) -> None:
        self._observer.emit(event.model_copy(update={"source": self._source}))


@dataclass(frozen=True)
class Submitter:
    """Who injects: the name idempotency keys are scoped to (and the ingest's
    ``auth_user``), the events' ``source``, and the ``Received:`` field's client and
    ``with`` keyword.

    Attributes:
        name: a token's name, or ``local:<user>`` for ``jsqueue inject``.
        source: the events' ``source`` (``api:<token>``, ``local:<user>@<host>``).
        client_ip: the client's address (``127.0.0.1`` for local submission).
        protocol: ``HTTP`` (the API), ``local`` (``jsqueue inject``, as Exim writes it).
    """

    name: str
    source: str
    client_ip: str
    protocol: str = "HTTP"

    @classmethod
    def of(cls, token: Token, client_ip: str) -> Submitter:
        """The submitter of an API request made with ``token`` from ``client_ip``."""
        return cls(token.name, token.source, client_ip)


def _keys(who: Submitter, idempotency_key: str, fingerprint: str) -> tuple[str, str, str]:
    """(claim key, stored key, stored-for-this-request key) in the ingest log: SHA-256 hex
    of the submitter and key (and, for the last, the request's fingerprint)."""
    base = b"\0".join([b"jsqueue-http", who.name.encode(), idempotency_key.encode()])
    return (
        hashlib.sha256(base + b"\0claim").hexdigest(),
        hashlib.sha256(base + b"\0stored").hexdigest(),
        hashlib.sha256(base + b"\0stored\0" + fingerprint.encode()).hexdigest(),
    )


def _reused(idempotency_key: str, queue_id: str) -> str:
    """The 422 detail of a key reused for a different request."""
    return (
        f"Idempotency-Key {idempotency_key!r} was used for a different request "
        f"(queued as {queue_id}); use a new key for a new message"
    )


class Injector:
    """Stores injected messages (see the module docstring). One per API.

    Args:
        settings: all settings (``smtp`` limits and timeouts, ``api`` window).
        stores: the queue.
        observer: receives the ``received`` events (source ``api:<token>``).
    """

    def __init__(self, settings: Settings, stores: Stores, observer: Observer) -> None:
        self._settings = settings
        # The same ingest path as the front end, without its content-based resend check
        # (a different Idempotency-Key never merges).
        self._smtp = settings.smtp.model_copy(update={"dedupe_window_s": 0.0})
        self._stores = stores
        self._observer = observer
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def _serialised(self, key: str) -> AsyncIterator[None]:
        """Hold the in-process lock of ``key`` (dropped when nobody else waits for it)."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def inject(
        self,
        tx: Transaction,
        who: Submitter,
        *,
        idempotency_key: str | None = None,
        fingerprint: str = "",
    ) -> InjectResult:
        """Store ``tx`` durably and return its queue id.

        Args:
            tx: the checked transaction.
            who: the caller (the ingest's ``auth_user``, the events' source, the
                ``Received:`` field's client).
            idempotency_key: the ``Idempotency-Key`` header, or None.
            fingerprint: a digest of the request (hex): a retry with the same key must
                carry the same one.

        Returns:
            the queue id; ``duplicate`` when an earlier request with the same key stored it.

        Raises:
            NotQueued: a store failed or timed out, or another request with the same key
                took this one's claim over (it was slower than ``smtp.store_timeout_s``):
                nothing is stored (HTTP 503; a retry gets the other request's id, or 422).
            StoreUnavailable: the ingest log could not be read or written (HTTP 503).
            RequestRejected: the key was used for a request with another fingerprint, or
                the message has more ``Received:`` fields than ``smtp.max_received`` (a
                mail loop, RFC 5321 §6.3) (HTTP 422); nothing is stored.
        """
        hops = received_count(tx.data)
        if hops > self._smtp.max_received:  # as the SMTP front end (RFC 5321 §6.3)
            raise RequestRejected(
                f"the message has {hops} Received: fields, more than smtp.max_received "
                f"({self._smtp.max_received}): a mail loop"
            )
        log_ = self._stores.ingest
        if idempotency_key is None or log_ is None:
            return await self._store(tx, who, new_queue_id())
        claim, stored, same = _keys(who, idempotency_key, fingerprint)
        window = self._settings.api.idempotency_window_s
        async with self._serialised(claim):
            earlier = await log_.lookup(stored, window)
            if earlier is not None:
                return await self._verdict(earlier, same, fingerprint, idempotency_key, tx)
            queue_id = new_queue_id()
            other = await log_.claim(claim, queue_id, window)
            if other is not None:
                found = await self._wait_stored(claim, stored, queue_id, window)
                if found is not None:
                    return await self._verdict(found, same, fingerprint, idempotency_key, tx)
            try:
                result = await self._store(tx, who, queue_id, (claim, same, fingerprint))
            except (NotQueued, StoreUnavailable):
                try:
                    await log_.forget(claim, queue_id)
                except (StoreUnavailable, OSError) as e:
                    log.warning("%s: idempotency claim kept (%s)", queue_id, e)
                raise
            try:
                held = await log_.holder(claim, window)
                # None: the log was lost meanwhile (a NATS restart): claim the key again
                # first, so that of this message and a retry stored meanwhile only one
                # writes the records
                if held.queue_id == queue_id or (
                    held.queue_id is None and await log_.replace(claim, held.version, queue_id)
                ):
                    # The fingerprint again (it was lost with the log, or would expire
                    # store_timeout_s before the stored record), and before it: whoever
                    # sees the stored record finds the fingerprint to compare with.
                    await log_.record(same, queue_id)
                    await log_.record(stored, queue_id)
                else:  # only when the claim was lost (a NATS restart) while storing
                    log.warning(
                        "%s: queued, but another request holds its idempotency key now "
                        "(a duplicate)",
                        queue_id,
                    )
            except StoreUnavailable as e:  # stored; a retry finds the entry instead
                log.warning("%s: queued, but its idempotency record failed (%s)", queue_id, e)
            return result

    async def _verdict(
        self, found: str, same: str, fingerprint: str, idempotency_key: str, tx: Transaction
    ) -> InjectResult:
        """A retry of the request that stored ``found`` (a duplicate), or a different
        request reusing its key (422). Decided by the entry's ``request_digest`` while the
        entry exists (it survives a NATS restart, the ingest log does not); else by the
        fingerprint record ``same`` (read through the leader; written before the message
        was stored and again just before its stored record, so up to
        ``smtp.store_timeout_s`` older when the second write failed).

        Raises:
            RequestRejected: the key was used for a request with another fingerprint.
            StoreUnavailable: the entry or the ingest log could not be read.
        """
        assert self._stores.ingest is not None
        try:
            digest = (await self._stores.entries.get(found)).entry.request_digest
        except EntryNotFound:  # delivered and removed
            digest = None
        if digest is not None:
            same_request = digest == fingerprint
        else:
            max_age_s = (
                self._settings.api.idempotency_window_s + self._settings.smtp.store_timeout_s
            )
            mine = await self._stores.ingest.lookup(same, max_age_s, consistent=True)
            same_request = mine == found
        if not same_request:
            raise RequestRejected(_reused(idempotency_key, found))
        return self._duplicate(found, tx)

    async def _wait_stored(
        self, claim: str, stored: str, queue_id: str, window: float
    ) -> str | None:
        """The queue id a concurrent request with the same key stored: its stored record,
        or its entry once it exists (written after its fingerprint record). None: this
        request (``queue_id``) holds the claim now and stores.

        The claim's holder has ``smtp.store_timeout_s`` from its last write of the claim
        (its claim, or the refresh before its entry is written) to store; after that the
        claim is taken over with a compare-and-set on the version last seen, so of two
        requests waiting for a holder that died exactly one takes over, and the other waits
        for it in turn. A holder that comes back late finds its claim taken and stores
        nothing (:meth:`_renew`).

        Raises:
            StoreUnavailable: the ingest log or the entry could not be read.
        """
        ingest = self._stores.ingest
        assert ingest is not None
        loop = asyncio.get_running_loop()
        bound = self._settings.smtp.store_timeout_s
        seen = await ingest.holder(claim, window)
        deadline = loop.time() + bound
        while True:
            if seen.queue_id == queue_id:  # ours after all (a retried write)
                return None
            found = await ingest.lookup(stored, window)
            if found is not None:
                return found
            if seen.queue_id is not None and await self._has_entry(seen.queue_id):
                return seen.queue_id
            if seen.queue_id is None or loop.time() >= deadline:
                if await ingest.replace(claim, seen.version, queue_id):
                    log.info("idempotency key: %s takes over from %s", queue_id, seen.queue_id)
                    return None
            else:
                await asyncio.sleep(POLL_S)
            held = await ingest.holder(claim, window)
            if held.version != seen.version:  # refreshed, or taken by another: wait anew
                seen, deadline = held, loop.time() + bound

    async def _has_entry(self, queue_id: str) -> bool:
        try:
            await self._stores.entries.get(queue_id)
        except EntryNotFound:
            return False
        return True

    async def _renew(self, claim: str, queue_id: str) -> None:
        """Refresh this request's claim before its entry is written (a compare-and-set):
        a waiting request then gives it ``smtp.store_timeout_s`` more, the bound of the
        commit that follows.

        Raises:
            NotQueued: another request took the claim over (this one was slower than the
                bound, or lost its claim in a NATS restart and another took the key).
            StoreUnavailable: the ingest log failed.
        """
        assert self._stores.ingest is not None
        window = self._settings.api.idempotency_window_s
        held = await self._stores.ingest.holder(claim, window)
        if held.queue_id not in (None, queue_id) or not await self._stores.ingest.replace(
            claim, held.version, queue_id
        ):
            raise NotQueued(queue_id, "its Idempotency-Key was taken over by a retry")

    def _duplicate(self, queue_id: str, tx: Transaction) -> InjectResult:
        log.info("%s: inject retried with the same Idempotency-Key", queue_id)
        return InjectResult(
            queue_id=queue_id, recipients=len(tx.recipients), size=len(tx.data), duplicate=True
        )

    async def _store(
        self,
        tx: Transaction,
        who: Submitter,
        queue_id: str,
        keys: tuple[str, str, str] | None = None,
    ) -> InjectResult:
        """The ingest path of the SMTP front end: trace field, body, entry, work items.
        With ``keys`` (claim, fingerprint record, fingerprint), once the body is written:
        the claim is renewed (:meth:`_renew`) and the fingerprint recorded, before the entry
        (which carries the fingerprint too, ``Entry.request_digest``) exists.

        Raises:
            NotQueued: a store failed, or the claim was taken over; nothing of the message
                is kept.
            StoreUnavailable: the ingest log failed; nothing of the message is kept.
        """
        ingest = Ingest(self._smtp, self._stores, _Relabel(self._observer, who.source))
        client_ip = who.client_ip
        literal = f"[IPv6:{client_ip}]" if ":" in client_ip else f"[{client_ip}]"
        received = received_header(
            helo=literal,
            client_ip=client_ip,
            hostname=self._smtp.hostname,
            protocol=who.protocol,
            queue_id=queue_id,
            recipient=tx.recipients[0].address if len(tx.recipients) == 1 else None,
            tls=None,
            when=utcnow(),
        )
        upload = ingest.upload(queue_id)
        await upload.write(received)
        await upload.write(tx.data)
        mail = Submission(
            reverse_path=tx.reverse_path,
            recipients=tx.recipients,
            content_sha256=hashlib.sha256(tx.data).digest(),
            ret=tx.ret,
            envid=tx.envid,
            smtputf8=tx.smtputf8,
            helo=None,
            client_address=client_ip,
            auth_user=who.name,
            eight_bit=not (tx.data.isascii() and received.isascii()),
            request_digest=None if keys is None else keys[2] or None,
        )
        if keys is not None:
            assert self._stores.ingest is not None
            try:
                await self._renew(keys[0], queue_id)
                # Before the message exists: whoever sees it can compare fingerprints.
                await self._stores.ingest.record(keys[1], queue_id)
            except (NotQueued, StoreUnavailable):
                await upload.abort()
                raise
        stored = await ingest.commit(upload, mail)
        return InjectResult(queue_id=stored, recipients=len(tx.recipients), size=len(tx.data))
