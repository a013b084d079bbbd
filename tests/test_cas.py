"""The compare-and-set loop (:mod:`jsqueue.store.cas`) and the body layout
(:mod:`jsqueue.store.layout`) against both entry stores (DESIGN.md §2.3)."""

from __future__ import annotations

import hashlib
import random

import pytest

from jsqueue.errors import EntryTooLarge, RevisionConflict
from jsqueue.store import cas, layout
from jsqueue.store.base import Stores
from support.nats import make_entry


async def test_reads_say_whether_a_missing_entry_was_deleted(stores: Stores) -> None:
    """A version first, then after a delete :class:`cas.Gone` (``versions`` yields None);
    a strict loop raises when its tries run out, a non-strict one just ends."""
    entry = make_entry()
    await stores.entries.create(entry)
    seen = []
    async for read in cas.reads(stores.entries, entry.id, tries=2, strict=False):
        seen.append(read)
        if len(seen) == 1:
            await stores.entries.delete(entry.id)
    assert not isinstance(seen[0], cas.Gone) and seen[0].entry.id == entry.id
    assert isinstance(seen[1], cas.Gone)
    assert [v async for v in cas.versions(stores.entries, entry.id, tries=1, strict=False)] == [
        None
    ]
    with pytest.raises(RevisionConflict):
        async for _ in cas.versions(stores.entries, entry.id, tries=2):
            pass


def test_growing_pause_stays_within_its_bound() -> None:
    """No pause before the first re-read, then random and growing up to ``max_s``."""
    pause = cas.growing_pause(random.Random(7), max_s=0.1, step_s=0.005)
    assert pause(1) == 0.0
    for n in range(2, 60):
        assert 0.0 <= pause(n) <= min(0.1, 0.005 * n)


async def test_an_entry_too_large_with_its_inline_body_is_written_without_it(
    mem_stores: Stores,
) -> None:
    """:func:`layout.update_entry`: the body goes to the body store and the entry is
    written without it; an entry too large even without a body raises EntryTooLarge."""
    body = b"Subject: x\r\n\r\n" + b"y" * 4000 + b"\r\n"
    entry = make_entry().model_copy(
        update={"size": len(body), "digest": hashlib.sha256(body).hexdigest()}
    )
    entry.inline_body = body
    revision = await mem_stores.entries.create(entry)
    mem_stores.entries.max_value_size = len(entry.to_json()) - 10
    written = await layout.update_entry(mem_stores, entry, revision)
    assert written.entry.inline_body is None
    assert (await mem_stores.bodies.info(entry.id)).size == len(body)
    chunks = layout.open_entry_body(mem_stores.bodies, written.entry)
    assert b"".join([c async for c in chunks]) == body
    mem_stores.entries.max_value_size = 10
    with pytest.raises(EntryTooLarge):
        await layout.update_entry(mem_stores, written.entry, written.revision)
