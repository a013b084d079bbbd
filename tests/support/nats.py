"""Test helpers for the storage layer: a real nats-server per test, stores, waiting.

Fixtures (registered by ``tests/conftest.py``):

- ``nats_server``: an :class:`EmbeddedNats` on port 0 in a temporary store dir; killed at
  teardown.
- ``names``: a :class:`Names` with a prefix unique to the test.
- ``nats_settings``: :class:`NatsSettings` with a short ack wait (``ACK_WAIT_S``).
- ``js_stores``: :func:`open_jetstream` against ``nats_server``; closed at teardown.
- ``mem_stores``: :func:`open_memory` with the same ack wait.
- ``stores``: parametrised over ``["memory", "jetstream"]``.

Helpers: ``make_settings``, ``unique_names``, ``make_entry``, ``chunks_of``, ``read_body``,
``corrupt_body``, ``fetch_one``, ``backlog_is``, ``wait_until``, ``loop_time``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import pytest

from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry, Recipient, RecipientState, utcnow
from jsqueue.errors import EntryNotFound
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.base import Due, Scheduler, Stores
from jsqueue.store.jetstream import open_jetstream
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from jsqueue.store.layout import open_entry_body
from jsqueue.store.memory import MemoryBodyStore, open_memory
from support.mx import shared_port

#: Ack wait of the test stores, seconds.
ACK_WAIT_S = 2.0
BACKENDS = ["memory", "jetstream"]


def unique_names() -> Names:
    """A name prefix no other test uses."""
    return Names(f"t{uuid.uuid4().hex[:12]}")


def make_settings(**overrides: object) -> NatsSettings:
    """Settings for tests: short ack wait and connect timeout."""
    values: dict[str, object] = {
        "ack_wait_s": ACK_WAIT_S,
        "connect_timeout_s": 1.0,
        "request_timeout_s": 5.0,
    }
    values.update(overrides)
    return NatsSettings.model_validate(values)


async def chunks_of(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    """``data`` as an async stream of ``size``-octet chunks (as the SMTP front end feeds)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def read_body(stores: Stores, queue_id: str) -> bytes:
    """A whole stored message (tests only; real readers stream): its entry's inline body,
    or else the body store's copy."""
    try:
        entry = (await stores.entries.get(queue_id)).entry
    except EntryNotFound:
        chunks = stores.bodies.open(queue_id)
    else:
        chunks = open_entry_body(stores.bodies, entry)
    return b"".join([chunk async for chunk in chunks])


async def corrupt_body(stores: Stores, queue_id: str) -> None:
    """Damage one stored byte of a body so its digest no longer matches.

    Memory: the store's ``corrupt()`` hook. JetStream: the first chunk is deleted from the
    object stream and republished with its first byte flipped (so it now comes last).
    """
    bodies = stores.bodies
    if isinstance(bodies, MemoryBodyStore):
        bodies.corrupt(queue_id)
        return
    assert isinstance(bodies, JetStreamBodyStore)
    meta = await bodies.meta(queue_id)
    assert meta is not None
    subject = bodies.chunk_subject(meta["nuid"])
    first = await bodies.js.get_msg(bodies.stream, seq=1, subject=subject, next=True, direct=True)
    assert first.seq is not None and first.data
    await bodies.js.delete_msg(bodies.stream, first.seq)
    await bodies.js.publish(subject, bytes([first.data[0] ^ 1]) + first.data[1:])


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0, interval_s: float = 0.05
) -> None:
    """Poll ``check`` until it returns True; fail the test after ``timeout_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


def make_entry(
    queue_id: str | None = None,
    *states: RecipientState,
    domain: str = "example.com",
    held: bool = False,
) -> Entry:
    """An entry with one recipient per state (one pending recipient by default)."""
    recipients = [
        Recipient(address=f"r{i}@{domain}", domain=domain, state=state)
        for i, state in enumerate(states or (RecipientState.PENDING,))
    ]
    return Entry(
        id=queue_id or new_queue_id(),
        reverse_path="sender@example.org",
        recipients=recipients,
        created_at=utcnow(),
        size=100,
        held=held,
    )


async def backlog_is(scheduler: Scheduler, n: int) -> None:
    """Wait until the backlog is ``n`` (acks are asynchronous on JetStream)."""

    async def check() -> bool:
        return await scheduler.backlog() == n

    await wait_until(check, timeout_s=3.0)


def loop_time() -> float:
    """The running loop's monotonic clock, seconds."""
    return asyncio.get_running_loop().time()


async def fetch_one(scheduler: Scheduler, timeout_s: float) -> Due:
    """Fetch and expect exactly one due item within ``timeout_s`` seconds."""
    got = await scheduler.fetch(10, timeout_s)
    assert len(got) == 1, got
    return got[0]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A fresh nats-server with JetStream on a free port; SIGKILLed at teardown."""
    server = EmbeddedNats(tmp_path / "nats", port=0)
    await server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def names() -> Names:
    """Object names with a prefix unique to this test."""
    return unique_names()


@pytest.fixture
def nats_settings() -> NatsSettings:
    """NATS settings with a short ack wait (``ACK_WAIT_S``)."""
    return make_settings()


@pytest.fixture
async def js_stores(
    nats_server: EmbeddedNats, nats_settings: NatsSettings, names: Names
) -> AsyncIterator[Stores]:
    """JetStream stores on ``nats_server``; closed at teardown."""
    stores = await open_jetstream(nats_settings, [nats_server.url], names=names)
    try:
        yield stores
    finally:
        await stores.close()


@pytest.fixture
async def mem_stores() -> AsyncIterator[Stores]:
    """In-memory stores with the same ack wait as ``js_stores``."""
    stores = open_memory(ack_wait_s=ACK_WAIT_S)
    yield stores
    await stores.close()


@pytest.fixture(params=BACKENDS)
def stores(request: pytest.FixtureRequest) -> Stores:
    """Each backend in turn: the contract suite runs once per backend."""
    fixture = "js_stores" if request.param == "jetstream" else "mem_stores"
    value: Stores = request.getfixturevalue(fixture)
    return value


def up_env(
    tmp_path: Path, base: Mapping[str, str], smarthost_port: int
) -> tuple[dict[str, str], int]:
    """``base`` plus the settings of a ``jsqueue up`` on free loopback ports (its NATS store
    under ``tmp_path``), relaying to a smarthost at 127.0.0.1:``smarthost_port``; and its
    SMTP port."""
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(shared_port(["127.0.0.1"]))
    smtp_port, nats_port, http_port = sorted(ports)
    env = {
        **base,
        "JSQUEUE_NATS__STORE_DIR": str(tmp_path / "nats"),
        "JSQUEUE_NATS__PORT": str(nats_port),
        "JSQUEUE_SMTP__PORT": str(smtp_port),
        "JSQUEUE_HTTP__PORT": str(http_port),
        "JSQUEUE_WORKER__SMARTHOST__HOST": "127.0.0.1",
        "JSQUEUE_WORKER__SMARTHOST__PORT": str(smarthost_port),
    }
    return env, smtp_port
