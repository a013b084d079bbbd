"""The ingest path (jsqueue/frontend/ingest.py) driven directly, without a socket, against
the in-memory stores and a real nats-server (the ``stores`` fixture runs each test on both).

Each test names the rule it checks (DESIGN.md §2.1, §3; RFC 5321 §6.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import pytest

from jsqueue.envelope import Notify, Recipient
from jsqueue.errors import BodyNotFound, EntryNotFound
from jsqueue.frontend import ingest as ingest_module
from jsqueue.frontend.ingest import BODY_CHUNK, Ingest, NotQueued, Submission
from jsqueue.names import new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.replies import R451_LOCAL_ERROR
from jsqueue.store.base import BodyInfo, BodyStore, Stores
from support.frontend import FaultyStores, frontend_settings
from support.nats import read_body

MESSAGE = b"Received: from test\r\n\tby mx.jsqueue.test; now\r\nSubject: hi\r\n\r\nHello.\r\n"
RECIPIENTS = [
    Recipient(address="bob@dest.example.test", domain="dest.example.test"),
    Recipient(
        address="carol@other.example.test",
        domain="other.example.test",
        orcpt="rfc822;carol@other.example.test",
        notify=frozenset({Notify.FAILURE, Notify.DELAY}),
    ),
    Recipient(address="dave@dest.example.test", domain="dest.example.test"),
]


def submission(**overrides: object) -> Submission:
    values: dict[str, object] = {
        "reverse_path": "alice@example.test",
        "recipients": RECIPIENTS,
        "content_sha256": hashlib.sha256(MESSAGE).digest(),
        "ret": "HDRS",
        "envid": "env-1",
        "helo": "client.example.test",
        "client_address": "127.0.0.1",
    }
    values.update(overrides)
    return Submission(**values)  # type: ignore[arg-type]


async def ingest_once(ingest: Ingest, mail: Submission, body: bytes = MESSAGE) -> str:
    upload = ingest.upload(new_queue_id())
    await upload.write(body)
    return await ingest.commit(upload, mail)


async def due_domains(stores: Stores) -> list[tuple[str, str]]:
    """(queue id, domain) of every work item due now, settled as they are read."""
    out = []
    for due in await stores.scheduler.fetch(batch=1000, timeout_s=0.5):
        out.append((due.item.queue_id, due.item.domain))
        await due.ack()
    return sorted(out)


async def test_commit_stores_body_entry_and_one_work_item_per_domain(stores: Stores) -> None:
    """DESIGN.md §2.1/§3: body, entry (envelope fields) and one work item per recipient
    domain are stored before commit names the queue id for the 250."""
    ingest = Ingest(frontend_settings(dedupe_window_s=0), stores)
    queue_id = await ingest_once(ingest, submission(eight_bit=True))

    entry = (await stores.entries.get(queue_id)).entry
    assert entry.reverse_path == "alice@example.test"
    assert [r.address for r in entry.recipients] == [r.address for r in RECIPIENTS]
    assert entry.recipients[1].orcpt == "rfc822;carol@other.example.test"
    assert entry.recipients[1].notify == frozenset({Notify.FAILURE, Notify.DELAY})
    assert (entry.ret, entry.envid, entry.helo) == ("HDRS", "env-1", "client.example.test")
    assert entry.client_address == "127.0.0.1" and entry.body_8bit
    assert entry.size == len(MESSAGE)
    assert entry.digest == hashlib.sha256(MESSAGE).hexdigest()
    assert entry.inline_body is None  # the default layout: the body is in the body store
    assert (await stores.bodies.info(queue_id)).size == len(MESSAGE)
    assert await read_body(stores, queue_id) == MESSAGE
    assert await due_domains(stores) == [
        (queue_id, "dest.example.test"),
        (queue_id, "other.example.test"),
    ]


class _LosingBodies:
    """The real body store, whose upload loses one cancellation after the first chunk (as
    ``asyncio.wait_for`` does on Python 3.11 when a chunk's ack meets it, gh-86296) and
    then waits for the next chunk."""

    def __init__(self, inner: BodyStore) -> None:
        self.inner = inner
        self.reached = asyncio.Event()

    async def _losing(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        source = aiter(chunks)
        yield await anext(source)
        self.reached.set()
        with contextlib.suppress(asyncio.CancelledError):  # lost
            await asyncio.get_running_loop().create_future()
        async for chunk in source:
            yield chunk

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        return await self.inner.put(queue_id, self._losing(chunks), fresh=fresh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_an_aborted_upload_ends_though_its_store_lost_a_cancellation(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone in the middle of DATA: the upload is cancelled and its chunks deleted.
    A lost cancellation left the upload waiting for ever for a next chunk, and the
    session's end with it; it is cancelled again (``ingest.CANCEL_AGAIN_S``)."""
    monkeypatch.setattr(ingest_module, "CANCEL_AGAIN_S", 0.1)
    bodies = _LosingBodies(stores.bodies)
    losing = dataclasses.replace(stores, bodies=bodies)
    upload = Ingest(frontend_settings(dedupe_window_s=0), losing).upload(new_queue_id())
    await upload.write(b"x" * (BODY_CHUNK + 1))
    await asyncio.wait_for(bodies.reached.wait(), 10)
    await asyncio.wait_for(upload.abort(), 10)
    with pytest.raises(BodyNotFound):
        await stores.bodies.info(upload.queue_id)


async def test_small_body_kept_inline_when_configured(stores: Stores) -> None:
    """``smtp.inline_body_max``: a small message lives in its entry, not the body store."""
    ingest = Ingest(frontend_settings(dedupe_window_s=0, inline_body_max=4096), stores)
    queue_id = await ingest_once(ingest, submission())
    assert (await stores.entries.get(queue_id)).entry.inline_body == MESSAGE
    with pytest.raises(BodyNotFound):
        await stores.bodies.info(queue_id)


async def test_resend_within_window_is_stored_once(stores: Stores) -> None:
    """Idempotent ingest: the same transaction again within ``dedupe_window_s`` gets the
    first queue id and stores no second copy; other content is a new message."""
    if stores.ingest is None:
        pytest.skip("backend without an ingest log")
    ingest = Ingest(frontend_settings(dedupe_window_s=60), stores)
    first = await ingest_once(ingest, submission())
    again = await ingest_once(ingest, submission())
    assert again == first
    other = hashlib.sha256(b"other").digest()
    assert await ingest_once(ingest, submission(content_sha256=other)) != first
    assert len(await due_domains(stores)) == 4  # two messages, two domains each


async def test_the_same_transaction_from_another_client_is_a_message_of_its_own(
    stores: Stores,
) -> None:
    """A resend comes from the client that lost the 250 (RFC 5321 §6.1). The same text,
    envelope and all, from another client address within the window (two hosts sending
    one alert and closing without QUIT) is another message: it used to get the first one's
    queue id, and the second host's mail was never delivered."""
    if stores.ingest is None:
        pytest.skip("backend without an ingest log")
    ingest = Ingest(frontend_settings(dedupe_window_s=60), stores)
    first = await ingest_once(ingest, submission(client_address="127.0.0.1"))
    second = await ingest_once(ingest, submission(client_address="127.0.0.2"))
    assert second != first
    assert await ingest_once(ingest, submission(client_address="127.0.0.2")) == second
    assert len(await stores.entries.page()) == 2


async def test_a_resend_after_the_first_copy_was_delivered_is_not_stored_again(
    stores: Stores,
) -> None:
    """RFC 5321 §6.1: a client that lost the 250 resends the same transaction; by then the
    first copy may be delivered and its entry removed (the worker deletes it at once). The
    entry store's delete marker says it was stored, so the resend still gets the first id
    and no second copy is queued (or sent)."""
    if stores.ingest is None:
        pytest.skip("backend without an ingest log")
    ingest = Ingest(frontend_settings(dedupe_window_s=60), stores)
    first = await ingest_once(ingest, submission())
    assert len(await due_domains(stores)) == 2
    v = await stores.entries.get(first)
    await stores.entries.delete(first, revision=v.revision)  # delivered and removed
    assert await ingest_once(ingest, submission()) == first
    assert await due_domains(stores) == []
    assert await stores.entries.page() == []


async def test_a_resend_after_a_failed_ingest_is_stored() -> None:
    """The first try wrote its entry, then its work item failed: 451, and the entry is
    discarded without a trace, so the client's resend (the same transaction) is stored as
    the message it is, under a new id, and not answered with the id of the copy that
    never was."""
    faulty = FaultyStores()
    ingest = Ingest(frontend_settings(dedupe_window_s=60), faulty.stores)
    faulty.fault("schedule").fail = True
    upload = ingest.upload(new_queue_id())
    await upload.write(MESSAGE)
    with pytest.raises(NotQueued):
        await ingest.commit(upload, submission())
    faulty.fault("schedule").fail = False
    again = await ingest_once(ingest, submission())
    assert again != upload.queue_id
    assert (await faulty.inner.entries.get(again)).entry.id == again
    assert len(await due_domains(faulty.inner)) == 2


async def test_a_failed_ingest_whose_entry_stays_keeps_its_body() -> None:
    """The work item failed (451), and removing the entry failed too (NATS in trouble):
    the entry may be there when the client resends, and the resend is answered with its
    id. So the body stays with it (the reconciler puts the work items back and the message
    is delivered once), never an id with no body behind it."""
    faulty = FaultyStores()
    ingest = Ingest(frontend_settings(dedupe_window_s=60), faulty.stores)
    faulty.fault("schedule").fail = True
    faulty.fault("discard").fail = True
    upload = ingest.upload(new_queue_id())
    await upload.write(MESSAGE)
    with pytest.raises(NotQueued):
        await ingest.commit(upload, submission())
    faulty.fault("schedule").fail = faulty.fault("discard").fail = False
    assert await ingest_once(ingest, submission()) == upload.queue_id
    assert (await read_body(faulty.inner, upload.queue_id)) == MESSAGE


async def test_the_same_message_twice_in_one_session_is_two_messages(stores: Stores) -> None:
    """A resend comes on a new connection (RFC 5321 §6.1): a message identical to one this
    session queued before (a script sending the same text twice, pipelined behind the
    first, RFC 2920 §3.1) is a message of its own, stored under its own id."""
    if stores.ingest is None:
        pytest.skip("backend without an ingest log")
    ingest = Ingest(frontend_settings(dedupe_window_s=60), stores)
    first = await ingest_once(ingest, submission())
    upload = ingest.upload(new_queue_id())
    await upload.write(MESSAGE)
    second = await ingest.commit(upload, submission(), [first])
    assert second == upload.queue_id != first
    assert len(await stores.entries.page()) == 2


@pytest.mark.parametrize("step", ["put", "create", "schedule"])
async def test_storage_failure_is_451_and_leaves_nothing(step: str) -> None:
    """DESIGN.md §2.1: if any store fails the answer is 451 4.3.0, never 250, and what was
    stored of the message is removed again."""
    faulty = FaultyStores()
    faulty.fault(step).fail = True
    ingest = Ingest(frontend_settings(dedupe_window_s=0), faulty.stores)
    upload = ingest.upload(new_queue_id())
    await upload.write(MESSAGE)
    with pytest.raises(NotQueued) as caught:
        await ingest.commit(upload, submission())
    assert caught.value.reply == R451_LOCAL_ERROR
    assert (caught.value.reply.code, caught.value.reply.enhanced) == (451, "4.3.0")
    queue_id = upload.queue_id
    with pytest.raises(EntryNotFound):
        await faulty.inner.entries.get(queue_id)
    with pytest.raises(BodyNotFound):
        await faulty.inner.bodies.info(queue_id)
    assert await due_domains(faulty.inner) == []


async def test_storage_down_is_451_within_store_timeout(
    nats_server: EmbeddedNats, js_stores: Stores
) -> None:
    """DESIGN.md §2.1 against JetStream: with the nats-server gone, commit gives up within
    ``smtp.store_timeout_s`` with 451 4.3.0 instead of waiting or answering 250."""
    ingest = Ingest(frontend_settings(dedupe_window_s=0, store_timeout_s=1.0), js_stores)
    upload = ingest.upload(new_queue_id())
    await upload.write(MESSAGE)
    nats_server.kill()
    with pytest.raises(NotQueued) as caught:
        await ingest.commit(upload, submission())
    assert caught.value.reply.code == 451 and caught.value.reply.enhanced == "4.3.0"
