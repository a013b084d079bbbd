"""Lock: :class:`JetStreamLock`, a cluster-wide lease held as one key of the locks KV bucket
(create-if-absent, renewed by compare-and-set, every write with a per-message TTL so a dead
holder's lock expires without anyone's clock); the reconciler's one-pass-at-a-time lock.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import uuid

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, kv_subject
from jsqueue.store.jetstream.api import (
    HDR_EXPECTED_LAST_SUBJ_SEQ,
    HDR_KV_OP,
    HDR_TTL,
    NATS_FAILURES,
    WRONG_LAST_SEQ,
)
from jsqueue.store.jetstream.provisioning import ensure_ttl_bucket


class JetStreamLock:
    """:class:`~jsqueue.store.base.Lock` as one key of the KV bucket
    :attr:`Names.locks_bucket <jsqueue.names.Names.locks_bucket>`.

    The value names the owner. Taking the lock is a create-if-absent (expected last
    subject sequence 0, or the sequence of a release marker); every write carries a
    per-message TTL (``Nats-TTL``), so a holder that dies loses the lock after ``ttl_s``
    without anyone's clock being involved. Renewing is a compare-and-set on the revision
    of our last write. A write whose reply was lost is recognised by its owner field.

    Args:
        nc: a connected client.
        names: object names.
        ttl_s: lock lifetime after the last renewal, seconds (rounded up, >= 1).
        owner: this process's name; host name + random suffix when None.
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
        key: which lock; :attr:`Names.reconciler_lock_key
            <jsqueue.names.Names.reconciler_lock_key>` when None.
    """

    def __init__(
        self,
        nc: NATS,
        names: Names,
        *,
        ttl_s: float,
        owner: str | None = None,
        replicas: int = 1,
        timeout_s: float = 5.0,
        key: str | None = None,
    ) -> None:
        self._nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = names.locks_bucket
        self.stream = names.locks_stream
        self.subject = kv_subject(self.bucket, key or names.reconciler_lock_key)
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.owner = owner or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.replicas = replicas
        self._timeout_s = timeout_s
        self._rev: int | None = None

    @property
    def held(self) -> bool:
        """Whether this process believes it holds the lock (as of its last write)."""
        return self._rev is not None

    async def provision(self) -> None:
        """Create the lock bucket if missing (bring its replica count in line). Idempotent.

        Raises:
            ProvisioningError: the server refused to create or update it.
            StoreUnavailable: no answer, or the connection failed.
        """
        await ensure_ttl_bucket(
            self._nc,
            self.bucket,
            self.stream,
            replicas=self.replicas,
            timeout_s=self._timeout_s,
        )

    async def _current(self) -> api.RawStreamMsg | None:
        try:
            return await self.js.get_msg(self.stream, subject=self.subject)
        except nats.js.errors.NotFoundError:
            return None
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"lock {self.subject}: read: {e or type(e).__name__}") from e

    def _owner_of(self, msg: api.RawStreamMsg) -> str | None:
        if (msg.headers or {}).get(HDR_KV_OP) in ("DEL", "PURGE") or not msg.data:
            return None
        try:
            value = json.loads(msg.data)
        except ValueError:
            return None
        owner = value.get("owner") if isinstance(value, dict) else None
        return owner if isinstance(owner, str) else None

    async def _write(self, expected: int, *, release: bool = False) -> int | None:
        """CAS-write our value (or a release marker); the new revision, None if refused.

        Raises:
            StoreUnavailable: the server refused the write for another reason than a lost
                compare-and-set, or the publish failed (NATS error, timeout, socket).
        """
        headers = {HDR_EXPECTED_LAST_SUBJ_SEQ: str(expected), HDR_TTL: f"{self.ttl_s}s"}
        data = b""
        if release:
            headers.update({HDR_KV_OP: "DEL", HDR_TTL: "1s"})
        else:
            data = json.dumps({"owner": self.owner, "ttl_s": self.ttl_s}).encode()
        try:
            ack = await self.js.publish(self.subject, data, headers=headers)
        except nats.js.errors.APIError as e:
            if e.err_code in WRONG_LAST_SEQ:
                return None
            raise StoreUnavailable(f"lock {self.subject}: write: {e}") from e
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"lock {self.subject}: write: {e or type(e).__name__}") from e
        return int(ack.seq)

    async def acquire(self) -> bool:
        """See :meth:`Lock.acquire`."""
        if self._rev is not None:
            return await self.renew()
        current = await self._current()
        if current is not None:
            owner = self._owner_of(current)
            if owner is not None and owner != self.owner:
                return False
            if owner == self.owner:  # our write landed although its reply was lost
                assert current.seq is not None
                self._rev = current.seq
                return await self.renew()
        expected = 0 if current is None or current.seq is None else current.seq
        self._rev = await self._write(expected)
        return self._rev is not None

    async def renew(self) -> bool:
        """See :meth:`Lock.renew`."""
        if self._rev is None:
            return False
        rev = await self._write(self._rev)
        if rev is None:
            current = await self._current()
            mine = current is not None and self._owner_of(current) == self.owner
            self._rev = current.seq if mine and current is not None else None
            return self._rev is not None
        self._rev = rev
        return True

    async def release(self) -> None:
        """See :meth:`Lock.release`: a delete marker (compare-and-set) that expires in 1 s;
        when a renewal of ours landed after the revision we know (its reply lost or not
        waited for), the lock is read and that revision given up."""
        if self._rev is None:
            return
        rev, self._rev = self._rev, None
        with contextlib.suppress(StoreUnavailable):
            if await self._write(rev, release=True) is None:
                # A renewal whose reply was not waited for (a pass cancelled at a stop)
                # moved the lock on: still ours, so give that revision up.
                current = await self._current()
                mine = current is not None and self._owner_of(current) == self.owner
                if mine and current is not None and current.seq is not None:
                    await self._write(current.seq, release=True)
