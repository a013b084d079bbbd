"""Ingest log: :class:`JetStreamIngestLog`, the resend hints of idempotent ingest (content
key → queue id) in a memory-backed KV bucket; losing them costs a duplicate, never a message.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict

import nats.js.errors
from nats.aio.client import Client as NATS

from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, check_queue_id, kv_subject_prefix
from jsqueue.store.base import Held, check_ingest_key
from jsqueue.store.jetstream.api import (
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_KV_OP,
    is_wrong_last_seq,
    publish,
    translate,
    unavailable,
)

#: Claims whose stream sequence an ingest log remembers for :meth:`JetStreamIngestLog.forget`.
CLAIMED_MEMORY = 4096
#: Compare-and-set writes one claim makes at most while the record under its key changes.
CLAIM_TRIES = 3


class JetStreamIngestLog:
    """:class:`~jsqueue.store.base.IngestLog` in a KV bucket (``Names.ingest_bucket``).

    One key per content key holding ``{"id": queue id, "at": unix seconds}``. The bucket
    forgets records after ``INGEST_MAX_AGE_S`` (:mod:`.provisioning`), so a dedupe window
    beyond that is cut to it. Lookups are direct gets (no consumer); records are plain puts,
    claims puts that expect no record. The bucket is held in the NATS servers' memory (no
    fsync per message) and bounded by ``INGEST_MAX_BYTES``: a full NATS restart, or more
    records than fit, forgets the oldest; a resend of a forgotten message is queued anew, as
    without the log.

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self._nc = nc
        self.stream = names.ingest_stream
        self._pre = kv_subject_prefix(names.ingest_bucket)
        # key -> (queue id, stream sequence) of the records this process claimed lately:
        # forget() of one of them needs no read first (a request less per message).
        self._claimed: OrderedDict[str, tuple[str, int]] = OrderedDict()

    async def lookup(self, key: str, max_age_s: float, *, consistent: bool = False) -> str | None:
        """See :meth:`IngestLog.lookup`: a direct get (any replica may answer), or with
        ``consistent`` a get through the stream leader."""
        return (await self._read(key, max_age_s, direct=not consistent)).queue_id

    async def holder(self, key: str, max_age_s: float) -> Held:
        """See :meth:`IngestLog.holder`: a get through the stream leader; the version is
        the record's stream sequence (a deleted record's too)."""
        return await self._read(key, max_age_s, direct=False)

    async def _read(self, key: str, max_age_s: float, *, direct: bool) -> Held:
        check_ingest_key(key)
        with translate(f"ingest {key[:12]}: read"):
            try:
                msg = await self.js.get_msg(self.stream, subject=self._pre + key, direct=direct)
            except nats.js.errors.NotFoundError:
                return Held(None, 0)
        assert msg.seq is not None
        if not msg.data:
            return Held(None, msg.seq)
        record = json.loads(msg.data)
        if time.time() - float(record["at"]) > max_age_s:
            return Held(None, msg.seq)
        return Held(str(record["id"]), msg.seq)

    async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
        """See :meth:`IngestLog.claim`: a put expecting no record under ``key``; when one
        is there, it is read through the leader, and replaced (compare-and-set on its
        sequence) only if older than ``max_age_s`` or deleted.

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable: the put was refused (other than for a record already there)
                or failed, the read or replacing write failed, or the record changed
                under every one of :data:`CLAIM_TRIES` replacing writes.
            unavailable: the StoreUnavailable above, as built by
                :func:`~jsqueue.store.jetstream.api.unavailable`.
        """
        check_ingest_key(key)
        check_queue_id(queue_id)
        version = 0
        for _ in range(CLAIM_TRIES):
            if await self.replace(key, version, queue_id):
                return None
            # Through the leader: a lagging replica could miss the record the put met.
            held = await self.holder(key, max_age_s)
            if held.queue_id is not None:  # (our own id: a retried claim stored after all)
                return None if held.queue_id == queue_id else held.queue_id
            version = held.version  # older than the window, or forgotten: take its place
        raise StoreUnavailable(f"ingest {key[:12]}: claim: the record kept changing")

    async def replace(self, key: str, version: int, queue_id: str) -> bool:
        """See :meth:`IngestLog.replace`: a put expecting ``version`` as the key's last
        sequence (0: none).

        Raises:
            InvalidName: bad key or queue id.
            unavailable: a StoreUnavailable (:func:`~jsqueue.store.jetstream.api.unavailable`)
                when the put was refused for another reason than the sequence, or failed.
        """
        check_ingest_key(key)
        data = json.dumps({"id": check_queue_id(queue_id), "at": time.time()}).encode()
        what = f"ingest {key[:12]}: claim"
        headers = {HDR_EXPECTED_LAST_SUBJ_SEQ: str(version)}
        try:
            ack = await publish(self.js, self._pre + key, data, headers, what=what)
        except nats.js.errors.APIError as e:
            if not is_wrong_last_seq(e):
                raise unavailable(what, e) from e
            return False
        self._claimed[key] = (queue_id, ack.seq)
        if len(self._claimed) > CLAIMED_MEMORY:
            self._claimed.popitem(last=False)
        return True

    async def forget(self, key: str, queue_id: str) -> None:
        """See :meth:`IngestLog.forget`: a KV delete that expects the record read (its
        subject sequence), so a record another front end wrote meanwhile stays. The record
        of a claim this process made lately is not read again: its sequence is known. The
        delete is published without a reply subject (one request-reply less per message):
        nats-server stores it, or drops it when the record changed meanwhile, and answers
        nothing; a lost one leaves a record that names a delivered message (the cost:
        an identical transaction within the window is answered with the first one's id,
        as when this call fails).

        Raises:
            InvalidName: bad key or queue id.
            StoreUnavailable: NATS unreachable or the read failed.
        """
        check_ingest_key(key)
        check_queue_id(queue_id)
        what = f"ingest {key[:12]}: forget"
        claimed = self._claimed.pop(key, None)
        if claimed is not None and claimed[0] == queue_id:
            seq = claimed[1]  # our own claim: its sequence is known, no read
        else:
            with translate(what):
                try:
                    msg = await self.js.get_msg(self.stream, subject=self._pre + key, direct=True)
                except nats.js.errors.NotFoundError:
                    return
            if not msg.data or json.loads(msg.data).get("id") != queue_id:
                return
            assert msg.seq is not None
            seq = msg.seq
        headers = {HDR_KV_OP: "DEL", HDR_EXPECTED_LAST_SUBJ_SEQ: str(seq)}
        with translate(what):
            await self._nc.publish(self._pre + key, b"", headers=headers)

    async def record(self, key: str, queue_id: str) -> None:
        """See :meth:`IngestLog.record`."""
        check_ingest_key(key)
        data = json.dumps({"id": check_queue_id(queue_id), "at": time.time()}).encode()
        await publish(self.js, self._pre + key, data, {}, what=f"ingest {key[:12]}: write")
