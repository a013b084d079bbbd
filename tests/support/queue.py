"""A whole queue for integration tests: real nats-server, front end, DNS server, workers.

``queue_harness`` (fixture) gives a :class:`Harness` over the ``js_stores`` of the test's
own nats-server; the test adds its DNS records (``harness.dns.add(...)``), starts fake MXes
on ``harness.mx_port``, submits mail through the real SMTP front end and runs workers until
a condition holds. Every address is on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import aiosmtplib
import pytest

from jsqueue.config import (
    DsnSettings,
    NatsSettings,
    RetrySettings,
    Settings,
    SmtpSettings,
    WorkerSettings,
)
from jsqueue.envelope import Entry
from jsqueue.errors import EntryNotFound
from jsqueue.frontend.server import SmtpServer
from jsqueue.names import Names
from jsqueue.runtime import build_worker
from jsqueue.store.base import Stores
from jsqueue.worker import Worker
from support.dns import DnsServer
from support.mx import shared_port

REPORTING_MTA = "relay.jsqueue.example.test"
#: Loopback addresses the fake MXes of the integration tests bind (one port for all).
MX_HOSTS = [f"127.0.2.{i}" for i in range(1, 255)]
_QUEUED_RE = re.compile(r"queued as (\S+)")


def test_settings(
    nats: NatsSettings, dns: DnsServer, mx_port: int, cache_dir: Path, **sections: object
) -> Settings:
    """Settings for a test queue: short retries, short timeouts, loopback DNS and MXes."""
    worker = {
        "mx_port": mx_port,
        "nameservers": dns.nameservers,
        "nameserver_port": dns.port,
        # the product's default: the loopback DNS server answers every query but those a
        # test marks TIMEOUT, and under the suite's load an answer can take over a second
        # (a 1 s lifetime deferred a first attempt with "AAAA: timed out" where a test
        # expected the MX's reply)
        "dns_timeout_s": 5.0,
        "connect_timeout_s": 2.0,
        "greeting_timeout_s": 5.0,
        "mail_timeout_s": 5.0,
        "rcpt_timeout_s": 5.0,
        "data_init_timeout_s": 5.0,
        "data_block_timeout_s": 5.0,
        "data_final_timeout_s": 10.0,
        "lease_s": 15.0,
        # A test leaves running() once the MX has seen what it waits for; the worker may
        # still be recording the outcome (events, entry update), slowly on a loaded box.
        "drain_timeout_s": 10.0,
        "body_cache_dir": cache_dir,
        "concurrency": 8,
        "ehlo_name": REPORTING_MTA,
        # short: a second worker of this host (same lease owner name) starts within ~1 s
        "presence_grace_s": 3.0,
    }
    worker.update(sections.pop("worker", {}))  # type: ignore[call-overload]
    retry = {"base_s": 1.0, "factor": 1.0, "jitter": 0.0, "max_age_s": 3600.0}
    retry.update(sections.pop("retry", {}))  # type: ignore[call-overload]
    dsn = {"reporting_mta": REPORTING_MTA}
    dsn.update(sections.pop("dsn", {}))  # type: ignore[call-overload]
    return Settings(
        nats=nats,
        smtp=SmtpSettings(port=0, hostname=REPORTING_MTA),
        worker=WorkerSettings.model_validate(worker),
        retry=RetrySettings.model_validate(retry),
        dsn=DsnSettings.model_validate(dsn),
    )


class Harness:
    """One test's queue: stores on a real nats-server, a DNS server, the front end."""

    def __init__(self, stores: Stores, dns: DnsServer, settings: Settings) -> None:
        self.stores = stores
        self.dns = dns
        self.settings = settings
        self.mx_port = settings.worker.mx_port
        self.frontend: SmtpServer | None = None

    def configure(self, **sections: object) -> None:
        """Replace settings sections (``retry={...}``, ``worker={...}``, ``dsn={...}``)."""
        updates = {}
        for name, values in sections.items():
            current = getattr(self.settings, name)
            updates[name] = current.model_copy(update=values)  # type: ignore[arg-type]
        self.settings = self.settings.model_copy(update=updates)

    def worker(self, **kw: object) -> Worker:
        """A worker with the harness settings (not started)."""
        w = build_worker(self.settings, self.stores)
        for k, v in kw.items():
            setattr(w, k, v)
        return w

    async def submit(
        self,
        message: bytes,
        recipients: Sequence[str],
        sender: str = "alice@example.test",
        *,
        mail_options: Sequence[str] = (),
        rcpt_options: Sequence[str] = (),
    ) -> str:
        """Send one message through the real SMTP front end; return its queue id."""
        if self.frontend is None:
            self.frontend = SmtpServer(self.settings.smtp, self.stores)
            await self.frontend.start()
        host, port = self.frontend.address
        async with aiosmtplib.SMTP(hostname=host, port=port, start_tls=False) as smtp:
            await smtp.ehlo(hostname="client.example.test")
            utf8 = not sender.isascii() or not all(r.isascii() for r in recipients)
            encoding = "utf-8" if utf8 else "ascii"
            resp = await smtp.mail(sender, options=list(mail_options), encoding=encoding)
            assert resp.code == 250, resp
            for rcpt in recipients:
                resp = await smtp.rcpt(rcpt, options=list(rcpt_options), encoding=encoding)
                assert resp.code == 250, resp
            resp = await smtp.data(message)
        assert resp.code == 250, resp
        match = _QUEUED_RE.search(resp.message)
        assert match, resp.message
        return match.group(1)

    async def entry(self, queue_id: str) -> Entry | None:
        """The stored entry, or None once it is gone."""
        try:
            return (await self.stores.entries.get(queue_id)).entry
        except EntryNotFound:
            return None

    @contextlib.asynccontextmanager
    async def running(self, *workers: Worker) -> AsyncIterator[Sequence[Worker]]:
        """Run workers (one new one by default) in the background; drain them on exit."""
        ws = list(workers) or [self.worker()]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(w.run(stop)) for w in ws]
        try:
            yield ws
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    async def close(self) -> None:
        """Stop the front end."""
        if self.frontend is not None:
            await self.frontend.stop(timeout_s=2)


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], timeout_s: float = 15.0, what: str = ""
) -> None:
    """Wait until ``check`` holds (polled every 50 ms); fail after ``timeout_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what or check}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def queue_harness(
    js_stores: Stores, nats_settings: NatsSettings, names: Names, tmp_path: Path
) -> AsyncIterator[Harness]:
    """A :class:`Harness` on the test's nats-server with an empty DNS zone."""
    with DnsServer("") as dns:
        port = shared_port(MX_HOSTS[:40])
        nats = nats_settings.model_copy(update={"prefix": names.prefix})
        settings = test_settings(nats, dns, port, tmp_path / "cache")
        harness = Harness(js_stores, dns, settings)
        try:
            yield harness
        finally:
            await harness.close()
