"""What the cluster shares about destination sites, as a storage Protocol: small keys that
live by a TTL per write, written by compare-and-set (:mod:`jsqueue.destinations`). JetStream:
:mod:`jsqueue.store.jetstream.destinations`; memory: :mod:`jsqueue.store.memory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DestinationStore", "Keyed"]


@dataclass(frozen=True, slots=True)
class Keyed:
    """One key of the destinations bucket as read: its JSON value (None when absent or
    deleted) and the revision to compare-and-set against (0 when the key never held a
    value or its last value expired)."""

    value: dict[str, object] | None
    revision: int


class DestinationStore(Protocol):
    """Small keys that live by a TTL per write, written by compare-and-set: what the
    cluster shares about destination sites (session slots, rate buckets, site states,
    probes; :mod:`jsqueue.destinations`). JetStream:
    :mod:`jsqueue.store.jetstream.destinations`; memory: :mod:`jsqueue.store.memory`."""

    async def get(self, key: str) -> Keyed:
        """The key's value and revision (one read).

        Raises:
            StoreUnavailable.
        """
        ...

    async def get_many(self, keys: Sequence[str]) -> dict[str, Keyed]:
        """Each key's value and revision, as :meth:`get` would read it, in as few requests
        as the backend allows (JetStream: one batched direct get per 256 keys, nats-server
        >= 2.11; one get per key before that). Read-only; may miss writes of the last
        moments on a replica, like :meth:`get`.

        Raises:
            StoreUnavailable.
        """
        ...

    async def put(
        self, key: str, value: dict[str, object], *, revision: int | None, ttl_s: float
    ) -> int | None:
        """Write ``value`` to live ``ttl_s`` seconds (rounded up to whole seconds).

        Args:
            key: the key.
            value: a JSON-ready dict.
            revision: the revision the key must still have (0 = must be absent; a deleted
                key is absent at the revision of its delete marker, as :meth:`get` says);
                None writes unconditionally.
            ttl_s: seconds the value lives without another write.

        Returns:
            the new revision, None when the compare-and-set lost (nothing written).

        Raises:
            StoreUnavailable.
        """
        ...

    async def delete(self, key: str, *, revision: int | None) -> bool:
        """Delete the key (if it still has ``revision``; None = whatever it holds).

        Returns:
            False when the compare-and-set lost. Idempotent for an absent key.

        Raises:
            StoreUnavailable.
        """
        ...

    async def keys(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` that hold a live value; for listings, never on a
        hot path (one stream-info request).

        Raises:
            StoreUnavailable.
        """
        ...

    async def queued(self, domain: str) -> int | None:
        """Work items queued for ``domain`` (due or deferred), None when the backend cannot
        tell; for listings, never on a hot path.

        Raises:
            StoreUnavailable.
        """
        ...
