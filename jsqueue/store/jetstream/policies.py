"""The TLS policy cache on a KV bucket (:class:`JetStreamPolicyCache`): one key per policy
domain, written with a per-message TTL of the policy's ``max_age`` (``Nats-TTL``), so every
worker of the cluster sees the same MTA-STS policy and an expired one is gone by the
server's clock alone (RFC 8461 §3.2, §5.1).
"""

from __future__ import annotations

import contextlib
import math

import nats.js.errors
from nats.aio.client import Client as NATS

from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names, check_domain, kv_subject
from jsqueue.store.jetstream.api import HDR_KV_OP, HDR_TTL, NATS_FAILURES
from jsqueue.store.jetstream.provisioning import TtlBucket

#: Longest life of a cached policy, seconds: RFC 8461 §3.2's largest max_age (one year).
MAX_POLICY_AGE_S = 31_557_600


class JetStreamPolicyCache(TtlBucket):
    """:class:`~jsqueue.store.policies.PolicyCache` on the KV bucket
    :attr:`Names.policies_bucket <jsqueue.names.Names.policies_bucket>`, provisioned on
    first use (and again after a write finds it missing).

    Args:
        nc: a connected client.
        names: object names.
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
    """

    max_age_s = MAX_POLICY_AGE_S

    def __init__(self, nc: NATS, names: Names, *, replicas: int = 1, timeout_s: float = 5.0):
        super().__init__(
            nc, names.policies_bucket, names.policies_stream, replicas=replicas, timeout_s=timeout_s
        )

    def _subject(self, domain: str) -> str:
        return kv_subject(self.bucket, check_domain(domain.lower()))

    async def get(self, domain: str) -> bytes | None:
        """See :meth:`PolicyCache.get <jsqueue.store.policies.PolicyCache.get>`.

        Raises:
            StoreUnavailable: NATS unreachable or the read failed.
            InvalidName: ``domain`` cannot be a key.
        """
        if not self._provisioned:
            await self.provision()
        try:
            msg = await self.js.get_msg(self.stream, subject=self._subject(domain))
        except nats.js.errors.NotFoundError:
            return None
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"policy cache {domain}: read: {e or type(e).__name__}") from e
        if (msg.headers or {}).get(HDR_KV_OP) in ("DEL", "PURGE") or not msg.data:
            return None
        return bytes(msg.data)

    async def put(self, domain: str, value: bytes, ttl_s: float) -> None:
        """See :meth:`PolicyCache.put <jsqueue.store.policies.PolicyCache.put>`.

        Raises:
            StoreUnavailable: NATS unreachable or the write failed.
            InvalidName: ``domain`` cannot be a key.
        """
        if not self._provisioned:
            await self.provision()
        ttl = max(1, min(MAX_POLICY_AGE_S, math.ceil(ttl_s)))
        try:
            await self.js.publish(self._subject(domain), value, headers={HDR_TTL: f"{ttl}s"})
        except nats.js.errors.APIError as e:
            self._provisioned = False
            raise StoreUnavailable(f"policy cache {domain}: write: {e}") from e
        except NATS_FAILURES as e:
            raise StoreUnavailable(f"policy cache {domain}: write: {e or type(e).__name__}") from e

    async def delete(self, domain: str) -> None:
        """See :meth:`PolicyCache.delete <jsqueue.store.policies.PolicyCache.delete>`:
        a delete marker that expires in a second.

        Raises:
            InvalidName: ``domain`` cannot be a key.
        """
        if not self._provisioned:
            await self.provision()
        subject = self._subject(domain)
        with contextlib.suppress(*NATS_FAILURES, nats.js.errors.APIError):
            await self.js.publish(subject, b"", headers={HDR_KV_OP: "DEL", HDR_TTL: "1s"})
