"""Test helpers for the replicated queue: a three-node cluster, jsqueue processes, load.

Fixtures (registered by ``tests/conftest.py``):

- ``nats_cluster``: an :class:`EmbeddedCluster` of three nodes on free loopback ports in
  the test's temporary directory; SIGKILLed at teardown.
- ``cluster_settings``: :class:`NatsSettings` for it: every node's URL, 3 replicas, the
  test's unique prefix (``names``), a short ack wait.
- ``cluster_stores``: :func:`open_jetstream` on the cluster; closed at teardown.

Helpers:

- :func:`jsqueue_env`: settings as ``JSQUEUE_…`` environment variables.
- :class:`JsqueueProc`: ``python -m jsqueue <command>`` as a child process: waits on its
  log without blocking the event loop, SIGTERM (drain) or SIGKILL (crash).
- :class:`CountingMx`: a sink MX (a :class:`~support.mx.ScriptedMx` in sink mode) that
  records when each recipient arrived, and from which client (its EHLO name).
- :func:`send_load`: several concurrent SMTP clients sending numbered messages, retrying
  after a 4xx or a lost connection, recording every attempt; at full speed or paced.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest

from jsqueue.config import NatsSettings, Settings
from jsqueue.names import Names
from jsqueue.nats_cluster import EmbeddedCluster
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import open_jetstream
from support.mx import ScriptedMx, Transaction
from support.nats import ACK_WAIT_S

_QUEUED_RE = re.compile(r"queued as (\S+)")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[EmbeddedCluster]:
    """Three nats-server nodes with JetStream on free ports; SIGKILLed at teardown."""
    cluster = EmbeddedCluster(tmp_path / "cluster", 3, client_port=0)
    await cluster.start()
    try:
        yield cluster
    finally:
        cluster.kill()


@pytest.fixture
def cluster_settings(nats_cluster: EmbeddedCluster, names: Names) -> NatsSettings:
    """Settings for the cluster: all URLs, R3, the test's prefix, a short ack wait."""
    return NatsSettings(
        urls=nats_cluster.urls,
        replicas=3,
        prefix=names.prefix,
        ack_wait_s=ACK_WAIT_S,
        connect_timeout_s=1.0,
        request_timeout_s=5.0,
    )


@pytest.fixture
async def cluster_stores(cluster_settings: NatsSettings, names: Names) -> AsyncIterator[Stores]:
    """JetStream stores on ``nats_cluster`` (R3); closed at teardown."""
    stores = await open_jetstream(cluster_settings, names=names)
    try:
        yield stores
    finally:
        await stores.close()


# --------------------------------------------------------------------------- processes


def jsqueue_env(settings: Settings) -> dict[str, str]:
    """``settings`` (what differs from the defaults) as ``JSQUEUE_<SECTION>__<KEY>`` variables."""
    env: dict[str, str] = {}
    for section, values in settings.model_dump(mode="json", exclude_defaults=True).items():
        for key, value in values.items():
            text = value if isinstance(value, str) else json.dumps(value)
            env[f"JSQUEUE_{section.upper()}__{key.upper()}"] = text
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class JsqueueProc:
    """``python -m jsqueue <command>`` with ``env`` on top of the current environment.

    Output (INFO logs) goes to ``log_file``, appended across restarts.
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], log_file: Path) -> None:
        self.command = list(command)
        self.env = {**os.environ, "JSQUEUE_HTTP__ENABLED": "false", **env}
        self.log_file = log_file
        self.proc: asyncio.subprocess.Process | None = None
        self._offset = 0

    async def start(
        self, ready: str = r"jsqueue running", timeout_s: float = 30.0
    ) -> re.Match[str]:
        """Start and wait for a log line matching ``ready`` (a regex) from this run."""
        self._offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with self.log_file.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "jsqueue",
                *self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return await self.wait_for_log(ready, timeout_s)

    def log(self) -> str:
        """What this run wrote so far."""
        with self.log_file.open("rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")

    async def wait_for_log(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """Wait for a line matching ``pattern`` in this run's output; fail the test if the
        process exits or nothing matches within ``timeout_s`` seconds."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log()
            if m := regex.search(text):
                return m
            exited = self.proc is not None and self.proc.returncode is not None
            if exited or time.monotonic() > deadline:
                why = "exited" if exited else f"nothing within {timeout_s} s"
                tail = "\n".join(text.splitlines()[-30:])
                pytest.fail(f"jsqueue {self.command}: {why} matching {pattern!r}\n{tail}")
            await asyncio.sleep(0.05)

    @property
    def running(self) -> bool:
        """The process is alive."""
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after ``timeout_s`` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode

    async def kill(self) -> None:
        """SIGKILL, as a crash would, and reap."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()


# --------------------------------------------------------------------------- sink MX


class CountingMx(ScriptedMx):
    """A sink MX (content hashed, not kept) that answers every message with ``reply`` and
    records ``(monotonic time, recipient)`` per recipient: in ``arrivals`` when the reply
    is 2xx, in ``refusals`` otherwise. ``reply`` may be changed at any time.

    ``accepted`` keeps ``(monotonic time, transaction)`` of every 2xx transaction;
    :meth:`client_names` tells which client (EHLO name) sent each."""

    def __init__(self, host: str, port: int, reply: str = "250 2.0.0 ok", **kw: Any) -> None:
        super().__init__(host, port, keep_data=False, end_of_data=self._answer, **kw)
        self.reply = reply
        self.arrivals: list[tuple[float, str]] = []
        self.refusals: list[tuple[float, str]] = []
        self.accepted: list[tuple[float, Transaction]] = []

    def _answer(self, tx: Transaction) -> str:
        now = time.monotonic()
        into = self.arrivals if self.reply.startswith("2") else self.refusals
        into.extend((now, r.lower()) for r in tx.rcpt_to)
        if self.reply.startswith("2"):
            self.accepted.append((now, tx))
        return self.reply

    def client_names(self) -> dict[int, str]:
        """The EHLO (or HELO) name of the session of each transaction, by ``id(tx)``
        (``""`` when the session sent none)."""
        names: dict[int, str] = {}
        for session in self.sessions:
            greetings = [c for c in session.commands if c[:5].upper() in ("EHLO ", "HELO ")]
            name = greetings[-1][5:].strip().lower() if greetings else ""
            names.update((id(tx), name) for tx in session.transactions)
        return names

    def copies(self) -> dict[str, int]:
        """How many times each recipient arrived."""
        counts: dict[str, int] = {}
        for _, rcpt in self.arrivals:
            counts[rcpt] = counts.get(rcpt, 0) + 1
        return counts


# --------------------------------------------------------------------------- SMTP load


@dataclass
class Attempt:
    """One try of one message: when DATA started and ended (monotonic), and the reply code
    (None when the connection broke or timed out: the outcome is unknown)."""

    index: int
    started: float
    ended: float
    code: int | None
    queue_id: str | None = None


@dataclass
class Load:
    """Everything :func:`send_load` saw."""

    attempts: list[Attempt] = field(default_factory=list)

    def accepted(self) -> dict[int, Attempt]:
        """The attempt that got a 250, per message index."""
        return {a.index: a for a in self.attempts if a.code == 250}

    def count(self, predicate: Any) -> int:
        """Attempts for which ``predicate(attempt)`` holds."""
        return sum(1 for a in self.attempts if predicate(a))


def load_message(index: int, domain: str, size: int = 600) -> tuple[str, bytes]:
    """Message ``index``: its own recipient ``m<index>@<domain>`` and a small body."""
    rcpt = f"m{index}@{domain}"
    head = (
        f"From: load@client.example.test\r\nTo: {rcpt}\r\nSubject: load {index}\r\n"
        f"Message-ID: <load-{index}@client.example.test>\r\n\r\n"
    ).encode()
    line = b"The quick brown fox jumps over the lazy dog, again and again.\r\n"
    return rcpt, head + line * max(1, (size - len(head)) // len(line))


async def send_load(
    host: str,
    port: int,
    count: int,
    domain: str,
    *,
    first: int = 0,
    size: int = 600,
    clients: int = 8,
    retry_pause_s: float = 0.5,
    max_tries: int = 60,
    timeout_s: float = 60.0,
    rate_per_s: float | None = None,
    load: Load | None = None,
) -> Load:
    """Send messages ``first`` .. ``first + count - 1`` (about ``size`` octets each) over
    ``clients`` concurrent sessions.

    A message is retried (new session after a broken one) until it gets a 250 or
    ``max_tries`` tries failed; every try is recorded, so a caller sees 451s and unknown
    outcomes (no reply) too. With ``rate_per_s``, message ``first + n`` is not begun before
    ``n / rate_per_s`` seconds after the call (a steady load; clients held up by retries
    catch up afterwards); without it, messages go as fast as the clients send.
    """
    load = load or Load()
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + count):
        todo.put_nowait(i)
    began = time.monotonic()

    async def client() -> None:
        smtp: aiosmtplib.SMTP | None = None
        while True:
            try:
                index = todo.get_nowait()
            except asyncio.QueueEmpty:
                break
            if rate_per_s:
                await asyncio.sleep(began + (index - first) / rate_per_s - time.monotonic())
            rcpt, data = load_message(index, domain, size)
            for _ in range(max_tries):
                if smtp is None or not smtp.is_connected:
                    smtp = aiosmtplib.SMTP(
                        hostname=host, port=port, timeout=timeout_s, start_tls=False
                    )
                    try:
                        await smtp.connect()
                        await smtp.ehlo(hostname="client.example.test")
                    except (aiosmtplib.SMTPException, OSError, TimeoutError):
                        smtp = None
                        await asyncio.sleep(retry_pause_s)
                        continue
                started = time.monotonic()
                code: int | None
                qid = None
                try:
                    _, message = await smtp.sendmail("load@client.example.test", [rcpt], data)
                    code = 250
                    m = _QUEUED_RE.search(message)
                    qid = m.group(1) if m else None
                except aiosmtplib.SMTPResponseException as e:
                    code = e.code
                    if code == 421:
                        smtp.close()
                except (aiosmtplib.SMTPException, OSError, TimeoutError):
                    code = None
                    smtp.close()
                load.attempts.append(Attempt(index, started, time.monotonic(), code, qid))
                if code == 250:
                    break
                await asyncio.sleep(retry_pause_s)
        if smtp is not None and smtp.is_connected:
            try:
                await smtp.quit()
            except (aiosmtplib.SMTPException, OSError, TimeoutError):
                smtp.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return load
