"""Test harness for the SMTP front end (:mod:`jsqueue.frontend`): loopback only.

* :func:`frontend_settings` / :func:`running`: a front end on ``127.0.0.1`` port 0 in the
  test's event loop.
* :class:`Wire`: a raw asyncio SMTP client that sends exact bytes and parses every reply
  strictly (RFC 5321 §4.2: three digits, ``-`` on every line but the last, same code on all
  lines), so tests can count replies (CASE-01, CASE-05).
* :class:`BlockingWire` + :class:`ThreadedFrontend`: the same with a blocking socket against
  a front end on its own event loop in a thread (hypothesis tests are synchronous).
* :class:`FrontendCerts`: a trustme CA and a server certificate written to PEM files, as
  ``smtp.tls_cert`` / ``smtp.tls_key`` expect.
* :class:`FaultyStores`: memory stores whose steps can be made to fail or hang.
* :class:`SinkBodyStore` and ``python tests/support/frontend.py``: a front end in a child
  process whose body store keeps nothing, for measuring the front end's own memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import socket
import ssl
import sys
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import trustme

from jsqueue.config import SmtpSettings
from jsqueue.envelope import Entry, WorkItem
from jsqueue.errors import BodyNotFound, StoreUnavailable
from jsqueue.frontend.server import SmtpServer, serve_smtp
from jsqueue.store.base import BodyInfo, Stores
from jsqueue.store.memory import MemoryBodyStore, MemoryEntryStore, open_memory

HOST = "127.0.0.1"
_LINE_RE = re.compile(rb"^(\d{3})([ -])([^\r\n]*)\r\n$")
T = TypeVar("T")


def frontend_settings(**overrides: Any) -> SmtpSettings:
    """Front-end settings for tests: loopback, port 0, short timeouts."""
    values: dict[str, Any] = {
        "host": HOST,
        "port": 0,
        "hostname": "mx.jsqueue.test",
        "session_timeout_s": 30.0,
        "store_timeout_s": 5.0,
    }
    values.update(overrides)
    return SmtpSettings.model_validate(values)


@contextlib.asynccontextmanager
async def running(
    settings: SmtpSettings, stores: Stores, *, on_reject: Callable[[int], None] | None = None
) -> AsyncIterator[SmtpServer]:
    """A started front end; stopped (bounded) on exit."""
    server = await serve_smtp(settings, stores, on_reject=on_reject)
    try:
        yield server
    finally:
        await server.stop(timeout_s=5.0)


# ------------------------------------------------------------------------------ replies


@dataclass
class Reply:
    """One complete SMTP reply as received."""

    code: int
    lines: list[str]
    raw: bytes

    @property
    def text(self) -> str:
        """All lines' text joined by newlines."""
        return "\n".join(self.lines)

    @property
    def enhanced(self) -> str | None:
        """The enhanced status code of the first line, if any (RFC 2034)."""
        m = re.match(r"^([245]\.\d{1,3}\.\d{1,3})(?: |$)", self.lines[0])
        return m.group(1) if m else None

    def __str__(self) -> str:
        return f"{self.code} {self.text}"


class ReplyParser:
    """Feed raw server bytes; get complete replies. Asserts RFC 5321 §4.2 syntax."""

    def __init__(self) -> None:
        self._buf = b""
        self._lines: list[tuple[int, str, bytes]] = []

    def feed(self, data: bytes) -> list[Reply]:
        self._buf += data
        out: list[Reply] = []
        while (i := self._buf.find(b"\n")) >= 0:
            raw, self._buf = self._buf[: i + 1], self._buf[i + 1 :]
            m = _LINE_RE.match(raw)
            assert m, f"malformed reply line {raw!r}"
            assert len(raw) <= 512, f"reply line longer than 512 octets: {raw[:80]!r}"
            code = int(m.group(1))
            assert 200 <= code <= 599, f"reply code out of range: {raw!r}"
            if self._lines:
                assert self._lines[0][0] == code, f"code changed inside a reply: {raw!r}"
            self._lines.append((code, m.group(3).decode("utf-8"), raw))
            if m.group(2) == b" ":
                out.append(
                    Reply(
                        code,
                        [t for _, t, _ in self._lines],
                        b"".join(r for _, _, r in self._lines),
                    )
                )
                self._lines = []
        return out

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet part of a complete reply."""
        return b"".join(r for _, _, r in self._lines) + self._buf


class Wire:
    """A raw SMTP client on asyncio streams (exact bytes out, strictly parsed replies in)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._parser = ReplyParser()
        self._ready: list[Reply] = []

    @classmethod
    async def connect(
        cls, port: int, *, host: str = HOST, source: str | None = None, greet: bool = True
    ) -> Wire:
        """Connect (optionally from source address ``source``) and read the greeting."""
        reader, writer = await asyncio.open_connection(
            host, port, local_addr=(source, 0) if source else None
        )
        wire = cls(reader, writer)
        if greet:
            greeting = await wire.reply()
            assert greeting.code == 220, greeting
        return wire

    async def send(self, data: bytes | memoryview) -> None:
        """Write ``data`` as one write."""
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, timeout_s: float = 10.0) -> Reply:
        """The next complete reply.

        Raises:
            AssertionError: malformed reply, or the server closed first.
        """
        async with asyncio.timeout(timeout_s):
            while not self._ready:
                data = await self.reader.read(65536)
                assert data, f"connection closed; partial reply {self._parser.pending!r}"
                self._ready.extend(self._parser.feed(data))
        return self._ready.pop(0)

    async def cmd(self, line: str | bytes, timeout_s: float = 10.0) -> Reply:
        """Send one command line (CRLF added) and return its reply."""
        raw = line.encode() if isinstance(line, str) else line
        await self.send(raw + b"\r\n")
        return await self.reply(timeout_s)

    async def expect(self, line: str | bytes, code: int) -> Reply:
        """Send a command and assert the reply code."""
        r = await self.cmd(line)
        assert r.code == code, f"{line!r}: expected {code}, got {r}"
        return r

    async def closed(self, timeout_s: float = 10.0) -> bytes:
        """Read until the server closes; return what came (should usually be nothing)."""
        rest = b""
        async with asyncio.timeout(timeout_s):
            while data := await self.reader.read(65536):
                rest += data
        return rest

    async def starttls(self, ctx: ssl.SSLContext, server_hostname: str) -> None:
        """Upgrade the connection after a 220 to STARTTLS (RFC 3207)."""
        assert not self._ready and not self._parser.pending, "replies pending before TLS"
        await self.writer.start_tls(ctx, server_hostname=server_hostname)

    async def close(self) -> None:
        """Close without QUIT."""
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()

    async def transaction(
        self,
        sender: str,
        recipients: list[str],
        data: bytes,
        *,
        ehlo: bool = True,
        behind: bytes = b"",
    ) -> Reply:
        """EHLO (optional), MAIL, RCPT…, DATA, ``data`` (already dot-stuffed, with the
        terminator) and ``behind`` in the same write (commands pipelined behind the data,
        RFC 2920 §3.1): the reply after the terminator."""
        if ehlo:
            await self.expect("EHLO client.example.test", 250)
        await self.expect(f"MAIL FROM:<{sender}>", 250)
        for rcpt in recipients:
            await self.expect(f"RCPT TO:<{rcpt}>", 250)
        await self.expect("DATA", 354)
        await self.send(data + behind)
        return await self.reply()


def dot_stuff(message: bytes) -> bytes:
    """``message`` (CRLF lines) dot-stuffed and terminated, as a correct client sends it."""
    if message and not message.endswith(b"\r\n"):
        message += b"\r\n"
    lines = message.split(b"\r\n")[:-1] if message else []
    return b"".join((b"." + ln if ln.startswith(b".") else ln) + b"\r\n" for ln in lines) + (
        b".\r\n"
    )


def queued_id(reply: Reply) -> str:
    """The queue id of a ``250 2.0.0 queued as <id>`` reply."""
    m = re.search(r"queued as ([0-9a-z]{26})$", reply.lines[0])
    assert reply.code == 250 and m, f"not a queued reply: {reply}"
    return m.group(1)


# ------------------------------------------------------------------------------ stores


async def entries_of(stores: Stores) -> list[Entry]:
    """Every stored entry, in queue-id order."""
    out: list[Entry] = []
    after: str | None = None
    while page := await stores.entries.page(after=after, limit=1000):
        out += [v.entry for v in page]
        after = page[-1].entry.id
    return out


def split_body(body: bytes) -> tuple[bytes, bytes]:
    """(our Received: field, the rest) of a stored body."""
    assert body.startswith(b"Received: from "), body[:80]
    i = 0
    while True:
        j = body.index(b"\r\n", i)
        if body[j + 2 : j + 3] not in (b"\t", b" "):
            return body[: j + 2], body[j + 2 :]
        i = j + 2


def memory_body_count(stores: Stores) -> int:
    """How many message bodies memory stores hold: in the body store (orphans included)
    or inline in an entry."""
    assert isinstance(stores.entries, MemoryEntryStore)
    inline = sum(b"\n" in data for data, _ in stores.entries._entries.values())
    return body_store_count(stores) + inline


def body_store_count(stores: Stores) -> int:
    """How many bodies a memory body store holds (orphans included; no inline body)."""
    assert isinstance(stores.bodies, MemoryBodyStore)
    return len(stores.bodies._bodies)


@dataclass
class Fault:
    """What a :class:`FaultyStores` step does: fail with StoreUnavailable, or hang."""

    fail: bool = False
    hang: bool = False
    calls: int = 0


@dataclass
class FaultyStores:
    """Memory stores with injectable faults per step (``put``, ``create``, ``discard``,
    ``schedule``, ``lookup``, ``record``); :attr:`stores` is what the front end gets."""

    inner: Stores = field(default_factory=open_memory)
    faults: dict[str, Fault] = field(default_factory=dict)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def fault(self, step: str) -> Fault:
        return self.faults.setdefault(step, Fault())

    async def _step(self, step: str) -> None:
        f = self.fault(step)
        f.calls += 1
        if f.hang:
            await self.released.wait()
        if f.fail:
            raise StoreUnavailable(f"injected failure in {step}")

    @property
    def stores(self) -> Stores:
        inner = self.inner
        outer = self

        class Bodies:
            async def put(
                self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
            ) -> BodyInfo:
                collected = [c async for c in chunks]
                await outer._step("put")

                async def again() -> AsyncIterator[bytes]:
                    for c in collected:
                        yield c

                return await inner.bodies.put(queue_id, again(), fresh=fresh)

            def open(self, queue_id: str, *, expect: BodyInfo | None = None) -> Any:
                return inner.bodies.open(queue_id, expect=expect)

            async def info(self, queue_id: str) -> BodyInfo:
                return await inner.bodies.info(queue_id)

            async def delete(self, queue_id: str) -> None:
                await outer._step("delete_body")
                await inner.bodies.delete(queue_id)

            async def discard(self, queue_id: str) -> None:
                await inner.bodies.discard(queue_id)

        class Entries:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner.entries, name)

            async def create(self, entry: Entry) -> int:
                await outer._step("create")
                return await inner.entries.create(entry)

            async def discard(self, queue_id: str) -> None:
                await outer._step("discard")
                await inner.entries.discard(queue_id)

        class Scheduler:
            def __getattr__(self, name: str) -> Any:
                return getattr(inner.scheduler, name)

            async def schedule(self, item: WorkItem, at: datetime | None = None) -> None:
                await outer._step("schedule")
                await inner.scheduler.schedule(item, at)

        class Ingest:
            async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
                await outer._step("lookup")
                assert inner.ingest is not None
                return await inner.ingest.claim(key, queue_id, max_age_s)

            async def lookup(self, key: str, max_age_s: float) -> str | None:
                await outer._step("lookup")
                assert inner.ingest is not None
                return await inner.ingest.lookup(key, max_age_s)

            async def record(self, key: str, queue_id: str) -> None:
                await outer._step("record")
                assert inner.ingest is not None
                await inner.ingest.record(key, queue_id)

            async def forget(self, key: str, queue_id: str) -> None:
                assert inner.ingest is not None
                await inner.ingest.forget(key, queue_id)

        return Stores(Bodies(), Entries(), Scheduler(), inner.close, Ingest())  # type: ignore[arg-type]


class SinkBodyStore:
    """A body store that hashes and counts what it is given and keeps nothing."""

    def __init__(self) -> None:
        self.infos: dict[str, BodyInfo] = {}

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        h, n = hashlib.sha256(), 0
        async for chunk in chunks:
            h.update(chunk)
            n += len(chunk)
        self.infos[queue_id] = info = BodyInfo(n, h.hexdigest())
        return info

    async def open(self, queue_id: str, *, expect: BodyInfo | None = None) -> AsyncIterator[bytes]:
        raise BodyNotFound(queue_id)
        yield b""  # pragma: no cover - makes this an async generator

    async def info(self, queue_id: str) -> BodyInfo:
        try:
            return self.infos[queue_id]
        except KeyError:
            raise BodyNotFound(queue_id) from None

    async def delete(self, queue_id: str) -> None:
        self.infos.pop(queue_id, None)

    async def discard(self, queue_id: str) -> None:
        await self.delete(queue_id)


# ------------------------------------------------------------------------------ TLS


class FrontendCerts:
    """A trustme CA and a server certificate for ``mx.jsqueue.test`` and 127.0.0.1 as PEM
    files (clients that connect by address verify the IP SAN)."""

    def __init__(self, directory: Path, name: str = "mx.jsqueue.test") -> None:
        self.ca = trustme.CA()
        self.name = name
        cert = self.ca.issue_cert(name, HOST)
        self.cert_file = directory / "server.pem"
        self.key_file = directory / "server.key"
        self.ca_file = directory / "ca.pem"
        cert.cert_chain_pems[0].write_to_path(str(self.cert_file))
        for pem in cert.cert_chain_pems[1:]:
            pem.write_to_path(str(self.cert_file), append=True)
        cert.private_key_pem.write_to_path(str(self.key_file))
        self.ca.cert_pem.write_to_path(str(self.ca_file))

    def settings(self) -> dict[str, Any]:
        """The ``tls_cert``/``tls_key`` settings."""
        return {"tls_cert": self.cert_file, "tls_key": self.key_file}

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the test CA and checks the host name."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        return ctx


# ------------------------------------------------------------------------------ threads


class BlockingWire:
    """:class:`Wire` over a blocking socket (for synchronous tests)."""

    def __init__(self, port: int, *, host: str = HOST, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self._parser = ReplyParser()
        self._ready: list[Reply] = []
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> Reply | None:
        """The next reply, or None when the server closed the connection."""
        while not self._ready:
            data = self.sock.recv(65536)
            if not data:
                self.eof = True
                assert not self._parser.pending, f"partial reply {self._parser.pending!r}"
                return None
            self._ready.extend(self._parser.feed(data))
        return self._ready.pop(0)

    def close(self) -> None:
        self.sock.close()


class ThreadedFrontend:
    """A front end with memory stores on its own event loop in a daemon thread."""

    def __init__(self, settings: SmtpSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.stores = open_memory()
        self.server: SmtpServer = self.call(lambda: serve_smtp(settings, self.stores))

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``fn()`` on the front end's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout=30)

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.call(lambda: self.server.stop(timeout_s=5.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


# ------------------------------------------------------------------------------ child


async def _serve_child(settings: SmtpSettings, store: str) -> None:
    stores = open_memory()
    if store == "sink":
        stores = Stores(SinkBodyStore(), stores.entries, stores.scheduler, stores.close)
    server = await serve_smtp(settings, stores)
    print(f"READY {server.port}", flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed: asyncio.Future[None] = loop.create_future()
    loop.add_reader(
        sys.stdin.fileno(), lambda: stdin_closed.done() or stdin_closed.set_result(None)
    )
    await stdin_closed
    await server.stop(timeout_s=2.0)
    bodies, entries = stores.bodies, await entries_of(stores)
    inline = sum(e.inline_body is not None for e in entries)
    stored = len(bodies.infos) + inline if isinstance(bodies, SinkBodyStore) else -1
    print(f"STATS entries={len(entries)} bodies={stored}", flush=True)


def rss_peak_kib(pid: int) -> int:
    """Peak resident set size (VmHWM) of process ``pid`` in KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


async def start_child(settings: dict[str, Any], store: str = "sink") -> tuple[Any, int]:
    """Start ``python tests/support/frontend.py`` (a front end in its own process).

    Returns:
        (the asyncio process, its SMTP port). Close its stdin to stop it.
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--settings",
        json.dumps(settings),
        "--store",
        store,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        line = await proc.stdout.readline()
    assert line.startswith(b"READY "), line
    return proc, int(line.split()[1])


async def stop_child(proc: Any) -> dict[str, int]:
    """Close the child's stdin, wait for it to exit; its final counts (entries, bodies)."""
    proc.stdin.close()
    async with asyncio.timeout(15):
        out = await proc.stdout.read()
        await proc.wait()
    m = re.search(rb"STATS entries=(\d+) bodies=(-?\d+)", out)
    assert m, out
    return {"entries": int(m.group(1)), "bodies": int(m.group(2))}


def main() -> None:
    """Child-process entry point (see :func:`start_child`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", required=True)
    parser.add_argument("--store", choices=["sink", "memory"], default="sink")
    args = parser.parse_args()
    settings = SmtpSettings.model_validate(json.loads(args.settings))
    asyncio.run(_serve_child(settings, args.store))


if __name__ == "__main__":
    main()
