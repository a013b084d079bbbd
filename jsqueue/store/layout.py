"""Where an entry's message body lives: inline after its KV entry (opt-in,
``smtp.inline_body_max``) or in the body store under its queue id (the default, DESIGN.md
§1). Every reader and writer that must know goes through here: streaming the body either way
(checked against the entry's size and digest), writing an entry that outgrew the entry store
with its body, and moving a deferred message's body out so queued mail keeps metadata only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from jsqueue.envelope import Entry
from jsqueue.errors import (
    BodyCorrupt,
    BodyNotFound,
    EntryNotFound,
    EntryTooLarge,
    RevisionConflict,
    StoreUnavailable,
)
from jsqueue.store import cas
from jsqueue.store.base import BodyInfo, BodyStore, Stores, Versioned

__all__ = ["delivery_body", "move_body_out", "one_chunk", "open_entry_body", "update_entry"]

log = logging.getLogger(__name__)


async def one_chunk(data: bytes) -> AsyncGenerator[bytes, None]:
    """``data`` as a stream of one chunk (for :meth:`BodyStore.put` of a body in memory)."""
    yield data


def open_entry_body(bodies: BodyStore, entry: Entry) -> AsyncGenerator[bytes, None]:
    """Stream an entry's message: its inline body, or else the body store's copy.

    Either way the octets are checked against the entry's size and SHA-256 digest before
    the last chunk is yielded, as :meth:`BodyStore.open` does, so a consumer that sends the
    final chunk only after the iterator ends never delivers a damaged body.

    Raises:
        BodyNotFound: the body is neither inline nor stored.
        BodyCorrupt: the octets do not match the entry's size and digest.
        StoreUnavailable: the body store failed.
    """
    if entry.inline_body is not None:
        return _inline_body(entry)
    expect = BodyInfo(size=entry.size, digest=entry.digest) if entry.digest else None
    return bodies.open(entry.id, expect=expect)


async def _inline_body(entry: Entry) -> AsyncGenerator[bytes, None]:
    body = entry.inline_body
    assert body is not None
    if len(body) != entry.size or (
        entry.digest and hashlib.sha256(body).hexdigest() != entry.digest
    ):
        raise BodyCorrupt(f"body {entry.id}: inline body does not match its size and digest")
    if body:
        yield body


def delivery_body(stores: Stores, entry: Entry) -> Callable[[], AsyncIterator[bytes]]:
    """The body to send at DATA, re-openable (one stream per call, from the start).

    A stored body deleted meanwhile (admin delete) raises BodyNotFound from the stream and
    the transaction is abandoned before its final dot (RFC 5321 §4.1.1.4). An inline body
    travels with the claimed entry, so each stream reads the entry again first to give a
    delete the same effect (one read, as a stored body's is).

    Returns:
        a callable opening the stream; the stream raises BodyNotFound, BodyCorrupt or
        StoreUnavailable as :func:`open_entry_body` does.
    """
    if entry.inline_body is None:
        return lambda: open_entry_body(stores.bodies, entry)
    return lambda: _inline_if_queued(stores, entry)


async def _inline_if_queued(stores: Stores, entry: Entry) -> AsyncIterator[bytes]:
    try:
        await stores.entries.get(entry.id)
    except EntryNotFound as e:
        raise BodyNotFound(f"{entry.id} (entry deleted during delivery)") from e
    async with contextlib.aclosing(open_entry_body(stores.bodies, entry)) as chunks:
        async for chunk in chunks:
            yield chunk


async def update_entry(stores: Stores, entry: Entry, revision: int) -> Versioned:
    """Compare-and-set ``entry`` at ``revision``. Replies and leases make an entry grow
    after its ingest: one the entry store refuses as too large with its inline body gets
    the body put in the body store and is written without it, so a claim or the record of
    what was sent is not refused for the body's size. Idempotent as the compare-and-set is
    (a second call at the same revision conflicts).

    Returns:
        the entry as written (without its inline body when it was moved) and its revision.

    Raises:
        RevisionConflict: the entry changed since ``revision``.
        EntryTooLarge: too large even without an inline body (nothing written).
        StoreUnavailable: the entry store, or the body store the body is moved to, failed.
    """
    try:
        return Versioned(entry, await stores.entries.update(entry, revision))
    except EntryTooLarge:
        if entry.inline_body is None:
            raise
    await stores.bodies.put(entry.id, one_chunk(entry.inline_body))
    log.info("queue %s: body moved to the body store (entry too large with it)", entry.id)
    without = entry.model_copy(update={"inline_body": None})
    return Versioned(without, await stores.entries.update(without, revision))


async def move_body_out(
    stores: Stores, v: Versioned, *, tries: int = cas.CAS_TRIES, pause: cas.Pause = cas.no_pause
) -> Versioned:
    """Move the inline body of a deferred entry to the body store, so that queued mail keeps
    metadata only in its entry and later writes do not carry the body. The entry is read
    again (after ``pause``) when another writer got in between, ``tries`` times at most.
    Best effort and idempotent: if the move fails, the entry keeps its inline body (a body
    stored meanwhile is an orphan, removed by the reconciler once the entry is gone).

    Args:
        stores: the queue.
        v: the entry as just written, with an inline body.
        tries: compare-and-set tries at most.
        pause: the pause before each re-read.

    Returns:
        the entry as now stored (``v`` when the move failed or was not needed).
    """
    assert v.entry.inline_body is not None
    try:
        await stores.bodies.put(v.entry.id, one_chunk(v.entry.inline_body))
        versions = cas.versions(stores.entries, v, tries=tries, pause=pause, strict=False)
        async for fresh in versions:
            if fresh is None or fresh.entry.inline_body is None:
                return v  # removed, or moved by another writer meanwhile
            v = fresh
            moved = v.entry.model_copy(update={"inline_body": None})
            try:
                v = Versioned(moved, await stores.entries.update(moved, v.revision))
            except RevisionConflict:
                continue
            log.debug("queue %s: deferred, body moved to the body store", moved.id)
            return v
    except StoreUnavailable as e:
        log.info("queue %s: inline body kept (moving it out failed: %s)", v.entry.id, e)
    return v
