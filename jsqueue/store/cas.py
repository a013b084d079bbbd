"""Compare-and-set on queue entries: the one retry loop every writer uses.

Every state change of an entry is a compare-and-set on its store revision (DESIGN.md §2.3).
A lost compare-and-set means another writer got through first (a worker recording another
destination, an admin action, a DSN mark); the writer reads the entry again and decides
anew. :func:`versions` yields the versions to try, :func:`change` applies a pure function
to the entry and writes the result. The worker, the admin operations and the DSN notifier
all go through here, so the loop, its bound and its pauses live in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from jsqueue.envelope import Entry
from jsqueue.errors import EntryNotFound, RevisionConflict
from jsqueue.store.base import EntryStore, Versioned

#: Compare-and-set tries of one change before it gives up (RevisionConflict).
CAS_TRIES = 5

Pause = Callable[[int], float]
"""Seconds to wait before try ``n`` (1 = the first re-read, 2, ...)."""

Write = Callable[[Entry, int], Awaitable[Versioned]]
"""Writes ``entry`` at ``revision`` by compare-and-set; raises RevisionConflict on a lost race."""


def no_pause(attempt: int) -> float:
    """No pause between tries: for writers that rarely meet contention (admin actions)."""
    return 0.0


@dataclass(frozen=True, slots=True)
class Changed:
    """What :func:`change` did.

    Attributes:
        before: the version the change function was applied to.
        after: the version written; None when the change function declined (returned None).
    """

    before: Versioned
    after: Versioned | None


async def versions(
    entries: EntryStore,
    start: Versioned | str,
    *,
    tries: int = CAS_TRIES,
    pause: Pause = no_pause,
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

    Raises:
        RevisionConflict: the caller asked for more than ``tries`` versions (every write
            lost).
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
        except EntryNotFound:
            yield None
    raise RevisionConflict(f"entry {queue_id}: changed {tries} times meanwhile")


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
