"""Bodies: :class:`JetStreamBodyStore`, the body store on a JetStream object store, written
in the nats object-store wire format and read chunk by chunk with direct gets, so that no
read creates a consumer (DESIGN.md §7: ``ObjectStore.get`` leaves one behind per read).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api
from nats.nuid import NUID

from jsqueue.errors import BodyCorrupt, BodyNotFound, StoreError, StoreUnavailable
from jsqueue.names import (
    Names,
    check_queue_id,
    js_api_subject,
    object_chunk_subject,
    object_meta_subject,
    object_name_token,
    object_token_subjects,
)
from jsqueue.store.base import BodyInfo
from jsqueue.store.jetstream.api import (
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_MSG_ID,
    HDR_ROLLUP,
    NATS_FAILURES,
    PUBLISH_ATTEMPTS,
    PipelinedPublisher,
    describe,
    get_confirmed,
    get_stored,
    is_temporary,
    is_wrong_last_seq,
    publish,
    translate,
    unavailable,
)

log = logging.getLogger("jsqueue.store.jetstream")

#: Object-store chunk size, octets (DESIGN.md §7: 256 KiB–1 MiB beat the 128 KiB default).
CHUNK_SIZE = 512 * 1024
#: Chunk publishes in flight per body put.
PUT_WINDOW = 4
#: Bodies whose chunk-set nuid a body store remembers after opening them (for delete).
OPENED_MEMORY = 4096
#: Tries of the stream leader for a body read a replica could not answer (a miss, a
#: timeout), within one delivery attempt (:func:`~jsqueue.store.jetstream.api.get_confirmed`).
READ_TRIES = 3


@dataclass
class _Sent:
    """A chunk written and not yet acknowledged: its ack, and what to write again."""

    ack: asyncio.Future[api.PubAck]
    subject: str
    data: bytes
    headers: dict[str, str]


class _SourceFailed(Exception):
    """The body's chunk stream (the caller's) raised; the cause is re-raised unchanged."""


def _hex_digest(object_digest: str) -> str:
    """``SHA-256=<base64url>`` (object-store meta) → lower-case hex."""
    raw = object_digest.split("=", 1)[1] if object_digest.upper().startswith("SHA-256=") else ""
    try:
        return base64.urlsafe_b64decode(raw).hex()
    except ValueError:
        return ""


class JetStreamBodyStore:
    """:class:`~jsqueue.store.base.BodyStore` on a JetStream object store.

    Bodies are written in the nats object-store format (chunks on ``$O.<bucket>.C.<nuid>``,
    one meta message on ``$O.<bucket>.M.<base64url(queue id)>``), so ``nats object`` tools
    can read them. Reads never create a consumer (DESIGN.md §7: every ``ObjectStore.get``
    leaves an ephemeral consumer behind): the meta by direct get-last, then each chunk by
    direct get-next-by-subject. Deleting removes chunks and meta without leaving a marker.

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
        chunk_size: chunk size, octets (capped at the server's max payload).
    """

    def __init__(
        self, nc: NATS, names: Names, *, timeout_s: float = 5.0, chunk_size: int = CHUNK_SIZE
    ) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = names.bodies_bucket
        self.stream = names.bodies_stream
        self._nc = nc
        self._acked = PipelinedPublisher(nc)
        self._timeout_s = timeout_s
        self._chunk_size = chunk_size
        self._nuid = NUID()
        # Chunk-set nuid of bodies this process opened lately: delete() of a body just
        # delivered then needs no meta read (one round trip less per message).
        self._opened: OrderedDict[str, str] = OrderedDict()

    def meta_subject(self, queue_id: str) -> str:
        """Subject of a body's meta message."""
        return object_meta_subject(self.bucket, queue_id)

    def chunk_subject(self, nuid: str) -> str:
        """Subject of the chunks of one stored version of a body."""
        return object_chunk_subject(self.bucket, nuid)

    async def meta(self, queue_id: str) -> dict[str, Any] | None:
        """The stored meta record of a body (object-store JSON), None when absent/deleted.

        A direct get (any replica); a miss or a failure is asked again of the stream leader
        (:func:`~jsqueue.store.jetstream.api.get_confirmed`, :data:`READ_TRIES` tries): a
        replica catching up after a restart or a pause answers "not found" for bodies that
        are stored. Read-only.

        Raises:
            BodyCorrupt: the meta record cannot be parsed.
            StoreUnavailable: the read failed.
        """
        msg = await get_confirmed(
            self.js,
            self.stream,
            self.meta_subject(queue_id),
            what=f"body {queue_id}: meta",
            tries=READ_TRIES,
            budget_s=PUBLISH_ATTEMPTS * self._timeout_s,
        )
        if msg is None:
            return None
        try:
            meta = json.loads(msg.data or b"{}")
        except ValueError as e:
            raise BodyCorrupt(f"body {queue_id}: object meta is not JSON") from e
        if not isinstance(meta, dict):
            raise BodyCorrupt(f"body {queue_id}: object meta is not a JSON object")
        if meta.get("deleted"):
            return None
        if not (
            isinstance(meta.get("nuid"), str)
            and isinstance(meta.get("digest"), str)
            and isinstance(meta.get("size", 0), int)
            and isinstance(meta.get("chunks", 0), int)
        ):
            raise BodyCorrupt(f"body {queue_id}: object meta lacks nuid/digest/size/chunks")
        return meta

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        """See :meth:`BodyStore.put`. Holds at most ``PUT_WINDOW`` chunks in memory.

        A ``fresh`` body's chunk set is named like its meta (``$O.<bucket>.C.<token>`` beside
        ``$O.<bucket>.M.<token>``), so :meth:`delete` purges both with one wildcard filter;
        any other gets a random chunk-set name, as the object store does.

        Chunks go out ``PUT_WINDOW`` at a time without waiting for each ack. Each carries a
        ``Nats-Msg-Id`` of its own (put and chunk number), so a chunk written again after a
        temporary failure (a timeout, no stream leader during an election: ~4–9 s,
        DESIGN.md §6) is stored once. After such a failure the chunks still unacknowledged
        and the rest are written one at a time, each retried
        (:func:`~jsqueue.store.jetstream.api.publish`: for what is left of an enclosing
        :func:`~jsqueue.store.deadline.retry_store_for` block), and the chunk set is read
        back from the stream leader before the meta counts: should a retried chunk have been
        stored after a later one, the put fails rather than store a body out of order.

        Raises:
            InvalidName: bad queue id.
            StoreUnavailable: a chunk or the meta could not be stored (every retry timed
                out or found no stream leader, the connection failed, or the chunks were
                stored out of order); the chunks sent and a stored meta are removed.
            unavailable: the StoreUnavailable above, as built by
                :func:`~jsqueue.store.jetstream.api.unavailable`.
            Exception: whatever ``chunks`` raises, re-raised unchanged once the chunks sent
                are removed.
            _SourceFailed: never out of this method: wraps an error of ``chunks`` on its
                way to the cleanup, which re-raises the error itself.
        """
        check_queue_id(queue_id)
        self._opened.pop(queue_id, None)
        nuid = object_name_token(queue_id) if fresh else self._nuid.next().decode()
        subject = self.chunk_subject(nuid)
        size = max(1, min(self._chunk_size, self._nc.max_payload or self._chunk_size))
        digest = hashlib.sha256()
        total = 0
        buf = bytearray()
        what = f"body {queue_id}: store"
        writer = _ChunkWriter(self, subject, f"{nuid}.{uuid.uuid4().hex[:12]}", what)
        source = aiter(chunks)
        try:
            while True:
                try:
                    piece = await anext(source)
                except StopAsyncIteration:
                    break
                except BaseException as e:
                    raise _SourceFailed() from e
                digest.update(piece)
                total += len(piece)
                buf += piece
                while len(buf) >= size:
                    await writer.send(bytes(buf[:size]))
                    del buf[:size]
            if buf:
                await writer.send(bytes(buf))
            meta = {
                "name": queue_id,
                "bucket": self.bucket,
                "nuid": nuid,
                "size": total,
                "chunks": writer.count,
                "digest": "SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
                "mtime": datetime.now(UTC).isoformat(),
                "options": {"max_chunk_size": size},
            }
            # The meta goes out right behind the last chunks, before their acks are in: one
            # connection, one stream, so it is stored after them (a round trip less per
            # body). Should a chunk fail after all, a stored meta is taken back.
            meta_put = asyncio.ensure_future(self._put_meta(queue_id, meta, writer.token))
            try:
                await writer.finish()
            except BaseException:
                await self._withdraw_meta(queue_id, meta_put)
                raise
            await meta_put
        except _SourceFailed as e:
            # The caller's stream failed (client gone, size limit ...): its error, not ours.
            await self._discard(subject, writer.pending)
            assert e.__cause__ is not None
            raise e.__cause__ from None
        except NATS_FAILURES as e:
            await self._discard(subject, writer.pending)
            raise unavailable(what, e) from e
        except BaseException:
            await self._discard(subject, writer.pending)
            raise
        return BodyInfo(size=total, digest=digest.hexdigest())

    async def _put_meta(self, queue_id: str, meta: dict[str, Any], token: str) -> None:
        """Store the meta record of a new chunk set, retried like the chunks (the same
        ``Nats-Msg-Id`` each time). A retry refused because the name holds a record is
        ours when the record names our chunk set (the earlier try was stored, its reply
        lost); a record of another chunk set (a body stored anew) is replaced and its chunks
        purged.

        Raises:
            nats.js.errors.APIError: the stream refused the record.
            StoreUnavailable: every try failed.
        """
        subject = self.meta_subject(queue_id)
        data = json.dumps(meta).encode()
        what = f"body {queue_id}: store meta"
        budget_s = PUBLISH_ATTEMPTS * self._timeout_s
        headers = {HDR_ROLLUP: "sub", HDR_MSG_ID: f"{token}.meta"}
        try:
            # Fast path: no body under this id yet (queue ids are unique).
            fast = {**headers, HDR_EXPECTED_LAST_SUBJ_SEQ: "0"}
            await publish(self.js, subject, data, fast, what=what, budget_s=budget_s)
            return
        except nats.js.errors.APIError as e:
            if not is_wrong_last_seq(e):
                raise
        old = await self.meta(queue_id)
        if old is not None and old.get("nuid") == meta["nuid"]:
            return  # our own earlier try, stored after all
        headers[HDR_MSG_ID] = f"{token}.meta.replace"
        await publish(self.js, subject, data, headers, what=what, budget_s=budget_s)
        if old is not None and old.get("nuid") != meta["nuid"]:
            await self.js.purge_stream(self.stream, subject=self.chunk_subject(old["nuid"]))

    async def _withdraw_meta(self, queue_id: str, meta_put: asyncio.Future[None]) -> None:
        """A chunk failed after the meta was sent: remove the meta if it was stored.

        Raises:
            CancelledError: the task was cancelled while waiting for the meta write
                (re-raised; nothing is taken back).
        """
        try:
            await meta_put
        except asyncio.CancelledError:
            raise
        except Exception:
            return  # the meta was not stored either: nothing to take back
        try:
            await self.js.purge_stream(self.stream, subject=self.meta_subject(queue_id))
        except NATS_FAILURES as e:
            log.warning("could not remove the meta of failed body %s: %s", queue_id, describe(e))

    async def _discard(self, subject: str, pending: deque[_Sent]) -> None:
        for sent in pending:
            sent.ack.cancel()
        try:
            await self.js.purge_stream(self.stream, subject=subject)
        except NATS_FAILURES as e:
            log.warning("could not remove chunks %s of a failed put: %s", subject, describe(e))

    async def open(
        self, queue_id: str, *, expect: BodyInfo | None = None
    ) -> AsyncGenerator[bytes, None]:
        """See :meth:`BodyStore.open`. Each chunk is one direct get; no consumer is made.

        With ``expect``, the chunks of a fresh body (:meth:`put`) are read without the
        meta record (one round trip less); when there are none under that name (a body
        stored otherwise, an empty one, or none at all) the meta is read as usual.

        Raises:
            InvalidName: bad queue id.
            BodyNotFound: nothing stored under the id, or the body was deleted or replaced
                while being read.
            BodyCorrupt: the meta cannot be parsed or differs from ``expect``, a chunk is
                missing or empty, or the bytes do not match the size and digest (raised
                before the last chunk is yielded).
            StoreUnavailable: reading the meta or a chunk failed.
        """
        check_queue_id(queue_id)
        first: api.RawStreamMsg | None = None
        if expect is not None and expect.size > 0:
            # A probe (any replica): a miss or a failure reads the meta, which is confirmed.
            subject = self.chunk_subject(object_name_token(queue_id))
            with contextlib.suppress(StoreUnavailable):
                first = await get_stored(self.js, self.stream, subject, what=queue_id, seq=1)
        if first is not None:
            assert expect is not None
            nuid = object_name_token(queue_id)
            chunks = self._chunks(queue_id, nuid, expect.size, expect.digest, None, first)
        else:
            meta = await self.meta(queue_id)
            if meta is None:
                raise BodyNotFound(queue_id)
            nuid = meta["nuid"]
            stored = BodyInfo(size=int(meta.get("size") or 0), digest=_hex_digest(meta["digest"]))
            if expect is not None and expect != stored:
                raise BodyCorrupt(f"body {queue_id}: not the expected size and digest")
            n_chunks = int(meta.get("chunks") or 0)
            chunks = self._chunks(queue_id, nuid, stored.size, stored.digest, n_chunks)
        self._remember(queue_id, nuid)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _remember(self, queue_id: str, nuid: str) -> None:
        """Note the chunk set of a body being read, for :meth:`delete`."""
        self._opened[queue_id] = nuid
        self._opened.move_to_end(queue_id)
        if len(self._opened) > OPENED_MEMORY:
            self._opened.popitem(last=False)

    async def _chunk(self, queue_id: str, subject: str, seq: int) -> api.RawStreamMsg | None:
        """The first chunk on ``subject`` at or after ``seq``; None when there is none (a
        miss confirmed on the stream leader, which is also asked when a replica fails:
        :func:`~jsqueue.store.jetstream.api.get_confirmed`, :data:`READ_TRIES` tries).

        Raises:
            StoreUnavailable: the stream leader's every try failed.
        """
        return await get_confirmed(
            self.js,
            self.stream,
            subject,
            what=f"body {queue_id}: chunk",
            seq=seq,
            tries=READ_TRIES,
            budget_s=PUBLISH_ATTEMPTS * self._timeout_s,
        )

    async def _chunks(
        self,
        queue_id: str,
        nuid: str,
        size: int,
        expected: str,
        n_chunks: int | None,
        first: api.RawStreamMsg | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The chunks of set ``nuid`` in order (``n_chunks`` of them, or None: until
        ``size`` octets arrived; ``first`` already fetched), the size and hex SHA-256
        ``expected`` checked before the last one is yielded.

        Raises:
            BodyNotFound: the body was deleted or replaced while being read.
            BodyCorrupt: a chunk is missing or empty, or the size or digest is not
                ``expected``.
            StoreUnavailable: reading a chunk or the meta failed.
        """
        subject = self.chunk_subject(nuid)
        digest = hashlib.sha256()
        seq = 1
        got = count = 0
        msg = first
        held: bytes | None = None  # each chunk is yielded once the next one is in hand
        while count < n_chunks if n_chunks is not None else got < size:
            if msg is None:
                msg = await self._chunk(queue_id, subject, seq)
            if msg is None:
                now = await self.meta(queue_id)
                if now is None or now.get("nuid") != nuid:
                    raise BodyNotFound(f"{queue_id} (deleted or replaced while reading)")
                raise BodyCorrupt(f"body {queue_id}: chunk {count + 1} is missing")
            assert msg.seq is not None
            seq = msg.seq + 1
            data = msg.data or b""
            if not data and n_chunks is None:
                raise BodyCorrupt(f"body {queue_id}: empty chunk")
            digest.update(data)
            got += len(data)
            count += 1
            msg = None
            if held is not None:
                yield held
            held = data
        if got != size or digest.hexdigest() != expected:
            raise BodyCorrupt(f"body {queue_id}: digest or size mismatch")
        if held is not None:
            yield held

    async def info(self, queue_id: str) -> BodyInfo:
        """See :meth:`BodyStore.info`.

        Raises:
            InvalidName: bad queue id.
            BodyNotFound: nothing stored under the id.
            BodyCorrupt: the meta record cannot be parsed.
            StoreUnavailable: the read failed.
        """
        check_queue_id(queue_id)
        meta = await self.meta(queue_id)
        if meta is None:
            raise BodyNotFound(queue_id)
        return BodyInfo(size=int(meta.get("size") or 0), digest=_hex_digest(meta["digest"]))

    async def delete(self, queue_id: str) -> None:
        """See :meth:`BodyStore.delete`. A fresh body's meta and chunks go in one purge;
        otherwise chunks go first, so a retried delete finishes.

        The chunk set is the one this process last opened under ``queue_id`` when it
        remembers one, else the meta record is read. (Should another process have stored
        the body anew in between, its chunks are left without meta, which the reconciler
        purges.)
        """
        check_queue_id(queue_id)
        nuid = self._opened.pop(queue_id, None)
        if nuid is None:
            meta = await self.meta(queue_id)
            nuid = meta["nuid"] if meta is not None else None
        with translate(f"body {queue_id}: delete"):
            if nuid == object_name_token(queue_id):  # a fresh body: meta and chunks in one purge
                await self.js.purge_stream(
                    self.stream, subject=object_token_subjects(self.bucket, nuid)
                )
                return
            if nuid is not None:
                await self.js.purge_stream(self.stream, subject=self.chunk_subject(nuid))
            await self.js.purge_stream(self.stream, subject=self.meta_subject(queue_id))

    async def discard(self, queue_id: str) -> None:
        """See :meth:`BodyStore.discard`. A fresh body this process opened goes in one
        purge request sent without a reply subject: nats-server purges as it does for
        :meth:`delete` and sends no answer, so nothing is awaited (one request-reply less
        per delivered message). Any other body is deleted as by :meth:`delete`, its failure
        logged.
        """
        check_queue_id(queue_id)
        nuid = self._opened.get(queue_id)
        try:
            if nuid == object_name_token(queue_id):
                del self._opened[queue_id]
                request = {"filter": object_token_subjects(self.bucket, nuid)}
                subject = js_api_subject(f"STREAM.PURGE.{self.stream}")
                await self._nc.publish(subject, json.dumps(request).encode())
            else:
                await self.delete(queue_id)
        except (StoreError, *NATS_FAILURES) as e:
            log.warning(
                "body %s: discard failed (%s); left for the orphan sweep", queue_id, describe(e)
            )


class _ChunkWriter:
    """The chunks of one :meth:`JetStreamBodyStore.put`: written ``PUT_WINDOW`` at a time
    without waiting for their acks until a write fails for a temporary reason; from then
    on written one at a time, each retried with its own ``Nats-Msg-Id``, and the chunk set
    is checked for order at :meth:`finish`.

    Attributes:
        token: names the put in the message ids (chunk set nuid and a random part).
        count: chunks sent so far.
        pending: chunks sent whose ack has not been awaited yet.
    """

    def __init__(self, store: JetStreamBodyStore, subject: str, token: str, what: str) -> None:
        self.store = store
        self.subject = subject
        self.token = token
        self.what = what
        self.count = 0
        self.pending: deque[_Sent] = deque()
        self.careful = False

    def _budget_s(self) -> float:
        return PUBLISH_ATTEMPTS * self.store._timeout_s

    async def send(self, data: bytes) -> None:
        """Write the next chunk (in call order).

        Raises:
            nats.js.errors.APIError: the stream refused a chunk (not a temporary failure).
            StoreUnavailable: a chunk's retries ran out.
            nats.errors.Error: a write failed (connection closed ...).
        """
        self.count += 1
        headers = {HDR_MSG_ID: f"{self.token}.{self.count}"}
        if self.careful:
            await self._retried(data, headers)
            return
        ack = await self.store._acked.publish(self.subject, data, headers)
        self.pending.append(_Sent(ack, self.subject, data, headers))
        if len(self.pending) >= PUT_WINDOW:
            await self._settle_one()

    async def _retried(self, data: bytes, headers: dict[str, str]) -> None:
        s = self.store
        budget_s = self._budget_s()
        await publish(s.js, self.subject, data, headers, what=self.what, budget_s=budget_s)

    async def _settle_one(self) -> None:
        """Await the oldest ack; after a temporary failure write it and every later chunk
        not acknowledged again, one at a time, and stay careful.

        Raises:
            NATS_FAILURES: the ack failed for a reason that is not temporary (a refusal for
                storage ...), re-raised.
            StoreUnavailable: a retried write's retries ran out.
        """
        sent = self.pending.popleft()
        try:
            await asyncio.wait_for(sent.ack, self.store._timeout_s)
            return
        except NATS_FAILURES as e:
            if not is_temporary(e):
                raise
            log.warning("%s: chunk write failed (%s); writing again", self.what, describe(e))
        self.careful = True
        await self._retried(sent.data, sent.headers)
        while self.pending:
            later = self.pending.popleft()
            if later.ack.done() and not later.ack.cancelled() and later.ack.exception() is None:
                continue  # stored
            later.ack.cancel()
            await self._retried(later.data, later.headers)

    async def finish(self) -> None:
        """Await every ack; after a retried write, check that the chunk set holds each
        chunk once and in order (read from the stream leader).

        Raises:
            StoreUnavailable: a chunk's retries ran out, or the chunk set is out of order.
            nats.js.errors.APIError: the stream refused a chunk.
        """
        while self.pending:
            await self._settle_one()
        if self.careful:
            await self._check_order()

    async def _check_order(self) -> None:
        s = self.store
        want = [f"{self.token}.{n}" for n in range(1, self.count + 1)]
        got: list[str] = []
        seq = 1
        while len(got) <= len(want):
            msg = await get_confirmed(
                s.js,
                s.stream,
                self.subject,
                what=self.what,
                seq=seq,
                settled=lambda _: False,  # the leader's answer, never a replica's
                tries=READ_TRIES,
                budget_s=self._budget_s(),
            )
            if msg is None:
                break
            assert msg.seq is not None
            got.append((msg.headers or {}).get(HDR_MSG_ID, ""))
            seq = msg.seq + 1
        if got != want:
            raise StoreUnavailable(
                f"{self.what}: chunks stored out of order after a retried write ({len(got)} "
                f"stored, {len(want)} sent)"
            )
