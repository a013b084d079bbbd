"""A worker's presence, on any :class:`~jsqueue.store.base.Presence`: taking a lease owner
name at start (:func:`take_name`) and keeping it alive (:func:`keep_alive`). No delivery
logic: the worker decides what a present or absent owner means for a lease.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from jsqueue.errors import StoreUnavailable
from jsqueue.store.base import Presence

log = logging.getLogger("jsqueue.worker")

#: Seconds between tries of :func:`take_name` while the presence bucket is unavailable.
RETRY_S = 0.5


@dataclass(slots=True)
class Liveness:
    """Until when this process's presence mark certainly stands, in the event loop's
    monotonic seconds: a mark lasts ``grace_s`` from its write, which the server makes
    after the request was sent, so a beat sent at ``t`` that succeeded stands until at
    least ``t + grace_s``. After that, other workers may find this one absent and take its
    running leases over (DESIGN.md §2.3)."""

    grace_s: float
    until: float = 0.0

    def beat_sent(self, at: float) -> None:
        """A beat sent at ``at`` (monotonic seconds) succeeded."""
        self.until = max(self.until, at + self.grace_s)

    def stands(self, now: float) -> bool:
        """Whether the mark certainly stands at ``now`` (monotonic seconds)."""
        return now < self.until

    def left_s(self, now: float) -> float:
        """Seconds the mark certainly stands after ``now`` (monotonic seconds; <= 0: it
        may have lapsed)."""
        return self.until - now


async def process_gone(presence: Presence, owner: str, instance: str | None) -> bool:
    """Whether process ``instance`` of lease owner ``owner`` is known gone: the name is not
    present, or present for another process (the owner restarted under its name, so the
    process that held ``instance``'s leases died). ``instance`` None (a lease written
    before instances were recorded) is told by the name alone. One read; False when it
    fails (a lease is only ever taken from a process known gone, DESIGN.md §2.3)."""
    try:
        mark = await presence.seen(owner)
    except StoreUnavailable:
        return False
    return mark is None or (instance is not None and mark.instance != instance)


async def take_name(
    presence: Presence, owner: str, instance: str, grace_s: float, liveness: Liveness
) -> str:
    """Register ``owner`` for process ``instance``; return the name actually taken. The
    beat that registers it is noted in ``liveness``.

    An unavailable presence bucket is tried again every :data:`RETRY_S` seconds for up to
    ``grace_s`` seconds: a worker started while the bucket's stream elects a leader (a
    cluster starting, a node lost; "no response from stream") waits for it instead of
    stopping its process.

    A mark of ``owner`` written by another process is watched for up to ``grace_s`` (+1)
    seconds: when it expires, that process is dead (a restart after a crash) and the name,
    with its leases, is taken; when it is beaten again, a live worker uses the name, and
    ``<owner>-<random>`` is taken instead, with a warning (never a live worker's leases).
    Every wait polls at most every 0.2 s.

    Raises:
        StoreUnavailable: the presence bucket could not be read or written for
            ``grace_s`` seconds.
    """
    give_up = asyncio.get_running_loop().time() + grace_s
    while True:
        try:
            return await _take_name(presence, owner, instance, grace_s, liveness)
        except StoreUnavailable as e:
            if asyncio.get_running_loop().time() >= give_up:
                raise
            log.warning("presence of %s not written (%s); trying again", owner, e)
            await asyncio.sleep(RETRY_S)


async def _take_name(
    presence: Presence, owner: str, instance: str, grace_s: float, liveness: Liveness
) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s + 1.0
    mark = await presence.seen(owner)
    live = False
    while mark is not None and mark.instance != instance and loop.time() < deadline:
        await asyncio.sleep(min(0.2, grace_s / 10))
        now_mark = await presence.seen(owner)
        if now_mark is None:
            mark = None
        elif now_mark.revision != mark.revision:
            live = True
            break
    name, sent = owner, loop.time()
    if live or not await presence.beat(owner, instance, grace_s, first=True):
        name = f"{owner}-{uuid.uuid4().hex[:8]}"
        log.warning(
            "lease owner %s is used by a live worker; running as %s (set "
            "worker.lease_owner to a unique name per worker)",
            owner,
            name,
        )
        sent = loop.time()
        await presence.beat(name, instance, grace_s)
    liveness.beat_sent(sent)
    log.info("lease owner %s present (grace %.0f s)", name, grace_s)
    return name


async def keep_alive(
    presence: Presence, owner: str, instance: str, grace_s: float, liveness: Liveness
) -> None:
    """Re-write ``owner``'s mark every ``grace_s / 3`` seconds until cancelled, noting each
    that succeeds in ``liveness``; a failed beat is logged and tried again at the next."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(grace_s / 3)
        sent = loop.time()
        try:
            await presence.beat(owner, instance, grace_s)
        except StoreUnavailable as e:
            log.warning("presence heartbeat failed: %s", e)
        else:
            liveness.beat_sent(sent)
