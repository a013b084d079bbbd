"""Presence: :class:`JetStreamPresence`, which lease owners are alive, one key per owner in
the presence KV bucket; every heartbeat is written with a per-message TTL of the worker's
grace (``Nats-TTL``), so a dead worker's key is gone after the grace by the server's clock
alone. The bucket's ``max_age`` bounds what any mark can live (the largest grace allowed).
"""

from __future__ import annotations

import contextlib
import json
import math

import nats.js.errors
from nats.aio.client import Client as NATS

from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, kv_subject, presence_key
from jsqueue.store.base import PresenceMark
from jsqueue.store.jetstream.api import (
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_KV_OP,
    HDR_TTL,
    NATS_FAILURES,
    WRONG_LAST_SEQ,
)
from jsqueue.store.jetstream.provisioning import TtlBucket

#: Upper bound of any presence mark's life, seconds (the bucket's ``max_age``).
MAX_GRACE_S = 3600


class JetStreamPresence(TtlBucket):
    """:class:`~jsqueue.store.base.Presence` on the KV bucket
    :attr:`Names.presence_bucket <jsqueue.names.Names.presence_bucket>`, provisioned on
    first use (and again when a write finds it missing).

    Args:
        nc: a connected client.
        names: object names.
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
    """

    max_age_s = MAX_GRACE_S

    def __init__(self, nc: NATS, names: Names, *, replicas: int = 1, timeout_s: float = 5.0):
        super().__init__(
            nc, names.presence_bucket, names.presence_stream, replicas=replicas, timeout_s=timeout_s
        )

    async def beat(self, owner: str, instance: str, ttl_s: float, *, first: bool = False) -> bool:
        """See :meth:`Presence.beat <jsqueue.store.base.Presence.beat>`.

        Raises:
            StoreUnavailable: NATS unreachable or the write failed.
        """
        if not self._provisioned:
            await self.provision()
        ttl = max(1, math.ceil(ttl_s))
        headers = {HDR_TTL: f"{ttl}s"}
        if first:
            headers[HDR_EXPECTED_LAST_SUBJ_SEQ] = "0"
        data = json.dumps({"owner": owner, "instance": instance, "ttl_s": ttl}).encode()
        subject = kv_subject(self.bucket, presence_key(owner))
        try:
            await self.js.publish(subject, data, headers=headers)
        except nats.js.errors.APIError as e:
            if first and e.err_code in WRONG_LAST_SEQ:
                return await self.seen(owner) is None and await self.beat(owner, instance, ttl)
            self._provisioned = False  # a lost stream is created again at the next beat
            raise StoreUnavailable(f"presence {owner}: write: {e}") from e
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"presence {owner}: write: {e or type(e).__name__}") from e
        return True

    async def seen(self, owner: str) -> PresenceMark | None:
        """See :meth:`Presence.seen <jsqueue.store.base.Presence.seen>`.

        Raises:
            StoreUnavailable: NATS unreachable or the read failed.
        """
        subject = kv_subject(self.bucket, presence_key(owner))
        try:
            msg = await self.js.get_msg(self.stream, subject=subject)
        except nats.js.errors.NotFoundError:
            return None
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"presence {owner}: read: {e or type(e).__name__}") from e
        if (msg.headers or {}).get(HDR_KV_OP) in ("DEL", "PURGE") or not msg.data:
            return None
        try:
            value = json.loads(msg.data)
        except ValueError:
            return None
        instance = value.get("instance") if isinstance(value, dict) else None
        return PresenceMark(str(instance), int(msg.seq or 0))

    async def leave(self, owner: str) -> None:
        """See :meth:`Presence.leave <jsqueue.store.base.Presence.leave>`: a delete marker
        that expires in a second."""
        subject = kv_subject(self.bucket, presence_key(owner))
        with contextlib.suppress(*NATS_FAILURES, nats.js.errors.APIError):
            await self.js.publish(subject, b"", headers={HDR_KV_OP: "DEL", HDR_TTL: "1s"})
