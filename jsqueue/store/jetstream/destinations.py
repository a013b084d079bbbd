"""Destinations: :class:`JetStreamDestinations`, the KV bucket of what every worker shares
about destination sites (session slots, GCRA rate buckets, site states, probes;
:mod:`jsqueue.destinations`). Every write is a compare-and-set on the subject's last
sequence and carries a per-message TTL (``Nats-TTL``), so the slots of a worker killed with
SIGKILL expire by the server's clock alone; reads are direct gets (one round trip).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, kv_subject, kv_subjects
from jsqueue.store.base import Keyed
from jsqueue.store.jetstream.api import (
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_KV_OP,
    HDR_TTL,
    NATS_FAILURES,
    WRONG_LAST_SEQ,
    DirectBatch,
    stream_subjects,
    translate,
)
from jsqueue.store.jetstream.provisioning import TtlBucket

#: Upper bound of any key's life, seconds (the bucket's ``max_age``): a site state lives as
#: long as its cool-off or throttle, a slot its TTL.
MAX_KEY_LIFE_S = 7 * 24 * 3600
#: Life of a delete marker, seconds: long enough for a compare-and-set on it.
DELETE_MARKER_TTL = "1s"


class JetStreamDestinations(TtlBucket):
    """:class:`~jsqueue.store.base.DestinationStore` on the KV bucket
    :attr:`Names.destinations_bucket <jsqueue.names.Names.destinations_bucket>`,
    provisioned on first use.

    Args:
        nc: a connected client.
        names: object names.
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
    """

    max_age_s = MAX_KEY_LIFE_S

    def __init__(self, nc: NATS, names: Names, *, replicas: int = 1, timeout_s: float = 5.0):
        super().__init__(
            nc,
            names.destinations_bucket,
            names.destinations_stream,
            replicas=replicas,
            timeout_s=timeout_s,
        )
        self.names = names
        self._batch = DirectBatch(nc)

    async def get(self, key: str) -> Keyed:
        """See :meth:`DestinationStore.get <jsqueue.store.base.DestinationStore.get>`.

        Raises:
            StoreUnavailable: NATS unreachable or the read failed.
        """
        if not self._provisioned:
            await self.provision()
        try:
            msg = await self.js.get_msg(
                self.stream, subject=kv_subject(self.bucket, key), direct=True
            )
        except nats.js.errors.NotFoundError:
            return Keyed(None, 0)
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"destinations {key}: read: {e or type(e).__name__}") from e
        return _keyed(msg)

    async def get_many(self, keys: Sequence[str]) -> dict[str, Keyed]:
        """See :meth:`DestinationStore.get_many <jsqueue.store.base.DestinationStore.get_many>`:
        batched direct gets (:class:`~jsqueue.store.jetstream.api.DirectBatch`) where the
        server has them, else one direct get per key.

        Raises:
            StoreUnavailable: NATS unreachable, a read failed, timed out or was refused.
        """
        if not keys:
            return {}
        if not self._batch.supported:
            reads = await asyncio.gather(*(self.get(k) for k in keys))
            return dict(zip(keys, reads, strict=True))
        if not self._provisioned:
            await self.provision()
        subjects = {kv_subject(self.bucket, k): k for k in keys}
        with translate(f"destinations: read {len(keys)}"):
            found = await self._batch.last(self.stream, list(subjects), self._timeout_s)
        out = {k: Keyed(None, 0) for k in keys}
        out.update({subjects[s]: _keyed(msg) for s, msg in found.items()})
        return out

    async def _publish(self, key: str, data: bytes, headers: dict[str, str]) -> int | None:
        if not self._provisioned:
            await self.provision()
        try:
            ack = await self.js.publish(kv_subject(self.bucket, key), data, headers=headers)
        except nats.js.errors.APIError as e:
            if e.err_code in WRONG_LAST_SEQ:
                return None
            self._provisioned = False  # a lost stream is created again at the next write
            raise StoreUnavailable(f"destinations {key}: write: {e}") from e
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"destinations {key}: write: {e or type(e).__name__}") from e
        return int(ack.seq)

    async def put(
        self, key: str, value: dict[str, object], *, revision: int | None, ttl_s: float
    ) -> int | None:
        """See :meth:`DestinationStore.put <jsqueue.store.base.DestinationStore.put>`.

        Raises:
            StoreUnavailable: NATS unreachable or the write failed for another reason than
                a lost compare-and-set.
        """
        headers = {HDR_TTL: f"{max(1, math.ceil(ttl_s))}s"}
        if revision is not None:
            headers[HDR_EXPECTED_LAST_SUBJ_SEQ] = str(revision)
        return await self._publish(key, json.dumps(value).encode(), headers)

    async def delete(self, key: str, *, revision: int | None) -> bool:
        """See :meth:`DestinationStore.delete <jsqueue.store.base.DestinationStore.delete>`:
        a delete marker that itself expires in a second.

        Raises:
            StoreUnavailable: NATS unreachable or the write failed.
        """
        headers = {HDR_KV_OP: "DEL", HDR_TTL: DELETE_MARKER_TTL}
        if revision is not None:
            headers[HDR_EXPECTED_LAST_SUBJ_SEQ] = str(revision)
        return await self._publish(key, b"", headers) is not None

    async def keys(self, prefix: str) -> list[str]:
        """See :meth:`DestinationStore.keys <jsqueue.store.base.DestinationStore.keys>`:
        one stream-info request (paged by the server), then a direct get per key found to
        leave delete markers out.

        Raises:
            StoreUnavailable: NATS unreachable or the request failed.
        """
        if not self._provisioned:
            await self.provision()
        head = kv_subject(self.bucket, "")
        wanted = kv_subject(self.bucket, prefix + ">") if prefix.endswith(".") else None
        subjects = await stream_subjects(
            self._nc, self.stream, wanted or kv_subjects(self.bucket), self._timeout_s
        )
        found = sorted(s[len(head) :] for s in subjects if s[len(head) :].startswith(prefix))
        return [k for k in found if (await self.get(k)).value is not None]

    async def queued(self, domain: str) -> int | None:
        """See :meth:`DestinationStore.queued <jsqueue.store.base.DestinationStore.queued>`:
        one stream-info request on the work stream filtered to the domain's subjects, whose
        reply holds one subject per queued item (about 70 octets each, paged by the server
        at 100k): cheap for an operator's ``dest show``, not for a hot path.

        Raises:
            StoreUnavailable: NATS unreachable or the request failed.
            InvalidName: ``domain`` is not a valid destination domain.
        """
        subjects = await stream_subjects(
            self._nc,
            self.names.work_stream,
            self.names.work_subjects_for(domain),
            self._timeout_s,
        )
        return sum(subjects.values())


def _keyed(msg: api.RawStreamMsg) -> Keyed:
    """A key's last message as read: a delete marker or an unreadable value is absent at
    the marker's revision."""
    seq = int(msg.seq or 0)
    if (msg.headers or {}).get(HDR_KV_OP) in ("DEL", "PURGE") or not msg.data:
        return Keyed(None, seq)
    try:
        value = json.loads(msg.data)
    except ValueError:
        return Keyed(None, seq)
    return Keyed(value if isinstance(value, dict) else None, seq)
