"""Compare-and-set on queue entries, the one retry loop every writer uses (DESIGN.md §2.3):
a lost compare-and-set means another writer got through first, so the writer reads the
entry again and decides anew; :func:`versions` yields the versions to try (:func:`reads`
also says whether a missing entry was deleted), :func:`change` applies a pure function to
the entry and writes the result, and :func:`growing_pause` is the random growing pause of
contended writers, so the loop, its bound and its pauses live in one place.

:class:`Turns` spares a process racing itself: the tasks of one process that write the same
entry (a message's deliveries to several domains run side by side in a worker) take turns,
and each starts from the newest version the others wrote instead of losing a
compare-and-set to them. The compare-and-set still decides every write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from jsqueue.envelope import Entry
from jsqueue.errors import (
    EntryDeleted,
    EntryNotFound,
    JsqueueError,
    RevisionConflict,
    StoreUnavailable,
)
from jsqueue.store.base import EntryStore, Versioned

log = logging.getLogger("jsqueue.store.cas")

#: Compare-and-set tries of one change before it gives up (RevisionConflict).
CAS_TRIES = 5

_T = TypeVar("_T")

Pause = Callable[[int], float]
"""Seconds to wait before try ``n`` (1 = the first re-read, 2, ...)."""

Write = Callable[[Entry, int], Awaitable[Versioned]]
"""Writes ``entry`` at ``revision`` by compare-and-set; raises RevisionConflict on a lost race."""


def no_pause(attempt: int) -> float:
    """No pause between tries: for writers that rarely meet contention (admin actions)."""
    return 0.0


def growing_pause(rng: random.Random, max_s: float = 0.1, step_s: float = 0.005) -> Pause:
    """A random pause that grows with the try: none before the first re-read, then uniform
    in ``[0, min(max_s, step_s * n))`` seconds before try ``n``. For writers that meet
    contention and must not give up soon (a worker recording what it sent): the randomness
    spreads writers that lost together.

    Args:
        rng: the random source (tests pass a seeded one).
        max_s: the longest pause, seconds.
        step_s: the growth of the bound per try, seconds.
    """

    def pause(attempt: int) -> float:
        if attempt < 2:
            return 0.0
        return rng.uniform(0, min(max_s, step_s * attempt))

    return pause


async def through_outage(
    write: Callable[[], Awaitable[_T]], within_s: float, *, pause_max_s: float = 5.0
) -> _T:
    """``write()``, tried again while the store is unavailable (a NATS restart, a lost
    leader) for up to ``within_s`` seconds, after pauses that double from 0.25 s up to
    ``pause_max_s``. For the write that must not be lost to an outage: the record of what
    an SMTP attempt did, after the remote's 250 (RFC 5321 §6.1: were it lost, the message
    would be sent again), bounded by the time no other worker can take the lease over.

    Raises:
        StoreUnavailable: still unavailable when ``within_s`` ran out (the last failure).
        Exception: whatever else ``write`` raises, at once.
    """
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + within_s, 0.25
    while True:
        try:
            return await write()
        except StoreUnavailable:
            if loop.time() + pause >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, pause_max_s)


@dataclass(frozen=True, slots=True)
class Gone:
    """No entry under the id (what :func:`reads` yields instead of a version).

    Attributes:
        deleted: the store knows it was deleted lately (:class:`EntryDeleted`), as opposed
            to not stored yet or long gone.
    """

    deleted: bool


@dataclass(frozen=True, slots=True)
class Changed:
    """What :func:`change` did.

    Attributes:
        before: the version the change function was applied to.
        after: the version written; None when the change function declined (returned None).
    """

    before: Versioned
    after: Versioned | None


async def reads(
    entries: EntryStore,
    start: Versioned | str,
    *,
    tries: int = CAS_TRIES,
    pause: Pause = no_pause,
    strict: bool = True,
) -> AsyncIterator[Versioned | Gone]:
    """As :func:`versions`, with :class:`Gone` (which says whether the store knows of a
    delete) instead of None for a missing entry.

    Raises:
        RevisionConflict: ``strict`` and the caller asked for more than ``tries`` versions.
        StoreUnavailable: a read failed.
    """
    queue_id = start if isinstance(start, str) else start.entry.id
    for attempt in range(tries):
        if attempt == 0 and isinstance(start, Versioned):
            yield start
            continue
        if attempt:
            delay = pause(attempt)
            if delay > 0:
                await asyncio.sleep(delay)
        try:
            yield await entries.get(queue_id)
        except EntryNotFound as e:
            yield Gone(deleted=isinstance(e, EntryDeleted))
    if strict:
        raise RevisionConflict(f"entry {queue_id}: changed {tries} times meanwhile")


async def versions(
    entries: EntryStore,
    start: Versioned | str,
    *,
    tries: int = CAS_TRIES,
    pause: Pause = no_pause,
    strict: bool = True,
) -> AsyncIterator[Versioned | None]:
    """The versions of one entry to try a compare-and-set on.

    Yields ``start`` itself when it is a version already read (no extra read: a change
    since then fails the compare-and-set), else the entry read now; then, each time the
    caller asks again because its write lost, the entry read anew after ``pause(n)``
    seconds. Yields None once the entry is gone. The caller stops iterating once its write
    went through.

    Args:
        entries: the entry store.
        start: a version already read, or the queue id to read.
        tries: versions yielded at most.
        pause: the pause before each re-read.
        strict: raise when the tries run out; False ends the iteration instead (for a
            caller with its own answer to "every write lost").

    Raises:
        RevisionConflict: ``strict`` and the caller asked for more than ``tries`` versions
            (every write lost).
        StoreUnavailable: a read failed.
    """
    async for v in reads(entries, start, tries=tries, pause=pause, strict=strict):
        yield None if isinstance(v, Gone) else v


async def change(
    entries: EntryStore,
    start: Versioned | str,
    fn: Callable[[Entry], Entry | None],
    *,
    write: Write | None = None,
    tries: int = CAS_TRIES,
    pause: Pause = no_pause,
) -> Changed:
    """Apply ``fn`` to the entry and write its result by compare-and-set, retrying on a lost
    race with the entry read again (DESIGN.md §2.3).

    ``fn`` must be pure: it may run once per try. Idempotent as far as ``fn`` is.

    Args:
        entries: the entry store.
        start: a version already read, or the queue id to read.
        fn: the new entry for a given one, or None to write nothing.
        write: how to write (default: ``entries.update``).
        tries: compare-and-set tries at most.
        pause: the pause before each re-read.

    Returns:
        the version changed and the version written (None when ``fn`` declined).

    Raises:
        EntryNotFound: the entry does not exist (or was deleted meanwhile).
        RevisionConflict: every try lost the race.
        StoreUnavailable: a read or write failed.
        AssertionError: never: :func:`versions` raises RevisionConflict when its tries run
            out, so the loop cannot end otherwise (an unreachable guard).
    """
    queue_id = start if isinstance(start, str) else start.entry.id
    async for v in versions(entries, start, tries=tries, pause=pause):
        if v is None:
            raise EntryNotFound(queue_id)
        new = fn(v.entry)
        if new is None:
            return Changed(v, None)
        try:
            if write is None:
                written = Versioned(new, await entries.update(new, v.revision))
            else:
                written = await write(new, v.revision)
        except RevisionConflict:
            continue
        return Changed(v, written)
    raise AssertionError("unreachable: versions() raises when its tries run out")


#: Longest wait for :func:`read_ahead`, seconds: a batch of entries normally takes a
#: millisecond or two; longer means an outage (a lost node, an election), where the fetch
#: loop that waits for it must not stall for a whole request timeout.
READ_AHEAD_TIMEOUT_S = 0.5


async def read_ahead(
    entries: EntryStore, queue_ids: Sequence[str], timeout_s: float = READ_AHEAD_TIMEOUT_S
) -> dict[str, Versioned]:
    """The entries of a fetched batch of work items in one read
    (:meth:`EntryStore.get_many`), to try each item's claim on first: its compare-and-set
    tells whether the version was still current (a stale one costs the read the item would
    have made anyway). Under load a fetch brings several items, and this saves a request
    per item but one. Nothing for a single id (its task reads it as before), for an entry
    not found (its task reads it, confirmed on the stream leader), or when the read fails
    or takes longer than ``timeout_s`` seconds (each task reads its own). Read-only; never
    raises.

    Returns:
        queue id -> the version read, for the entries found.
    """
    ids = list(dict.fromkeys(queue_ids))
    if len(ids) < 2:
        return {}
    try:
        async with asyncio.timeout(timeout_s):
            read = await entries.get_many(ids)
    except (JsqueueError, TimeoutError, OSError) as e:
        log.debug("read ahead of %d entries failed (%s); each is read alone", len(ids), e)
        return {}
    return {v.entry.id: v for v in read if isinstance(v, Versioned)}


@dataclass(slots=True)
class Turn:
    """One entry's writers within a process (see :class:`Turns`).

    Attributes:
        lock: held by the task writing the entry now (from its decision to its write).
        newest: the newest version a task of this process read or wrote while any of them
            worked on the entry; None before the first.
        users: tasks working on the entry now.
    """

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    newest: Versioned | None = None
    users: int = 0

    def latest(self, v: Versioned) -> Versioned:
        """``v``, or the newer version another task of this process wrote since: a write at
        ``v``'s revision would certainly lose then. Either may be stale against other
        processes' writes; the compare-and-set tells."""
        if self.newest is not None and self.newest.revision > v.revision:
            return self.newest
        return v

    def saw(self, v: Versioned) -> Versioned:
        """Note ``v`` (just written or read) if it is the newest seen; returns ``v``."""
        if self.newest is None or v.revision > self.newest.revision:
            self.newest = v
        return v


class Turns:
    """The :class:`Turn` of each entry some task of this process works on now, kept only
    while one does (no cache outlives the work: a version is remembered only for the tasks
    that overlap it). Without it, a worker's deliveries of one message to two domains both
    read revision r, both write their claim at r, and one loses: a failed write, a check of
    it and a re-read (three requests), and the same again when both record their outcome.
    """

    def __init__(self) -> None:
        self._turns: dict[str, Turn] = {}

    def __len__(self) -> int:
        return len(self._turns)

    @contextlib.asynccontextmanager
    async def working_on(self, queue_id: str, seen: Versioned | None = None) -> AsyncIterator[Turn]:
        """The entry's turn for the duration of the block (shared with the other tasks of
        this process in theirs); forgotten when the last one leaves. ``seen``: a version
        of the entry the task read before (:func:`read_ahead`), noted as :meth:`Turn.saw`
        does, so that the first write is tried on it without a read."""
        turn = self._turns.get(queue_id)
        if turn is None:
            turn = self._turns[queue_id] = Turn()
        if seen is not None:
            turn.saw(seen)
        turn.users += 1
        try:
            yield turn
        finally:
            turn.users -= 1
            if turn.users == 0:
                del self._turns[queue_id]
