"""The cluster-wide cache of published TLS policies (MTA-STS, RFC 8461 §5.1):
:class:`PolicyCache`, one value per policy domain with a lifetime, and
:class:`MemoryPolicyCache` with the same semantics for one process and tests. The JetStream
backend is :class:`jsqueue.store.jetstream.policies.JetStreamPolicyCache`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class PolicyCache(Protocol):
    """Cached policies by domain (A-label, lower case): opaque values with a lifetime."""

    async def get(self, domain: str) -> bytes | None:
        """The value stored for ``domain``, or None when absent or past its lifetime.

        Raises:
            StoreUnavailable: the store could not be read.
        """
        ...

    async def put(self, domain: str, value: bytes, ttl_s: float) -> None:
        """Store ``value`` for ``domain`` for ``ttl_s`` seconds (rounded up to a second),
        replacing any earlier value. Idempotent.

        Raises:
            StoreUnavailable: the store could not be written.
        """
        ...

    async def delete(self, domain: str) -> None:
        """Forget ``domain``'s value (MTA-STS mode ``none``, RFC 8461 §8.3). Idempotent.

        Raises:
            StoreUnavailable: the store could not be written.
        """
        ...


class MemoryPolicyCache:
    """:class:`PolicyCache` in this process's memory.

    Args:
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._values: dict[str, tuple[bytes, float]] = {}

    async def get(self, domain: str) -> bytes | None:
        """See :meth:`PolicyCache.get`."""
        found = self._values.get(domain)
        if found is None or found[1] <= self._clock():
            self._values.pop(domain, None)
            return None
        return found[0]

    async def put(self, domain: str, value: bytes, ttl_s: float) -> None:
        """See :meth:`PolicyCache.put`."""
        self._values[domain] = (value, self._clock() + max(1.0, ttl_s))

    async def delete(self, domain: str) -> None:
        """See :meth:`PolicyCache.delete`."""
        self._values.pop(domain, None)
