"""Sending SMTP TLS reports (RFC 8460 §3, §5): :class:`TlsReporter` reads a day's
attempt events from the events stream, builds one report per policy domain that publishes
a ``_smtp._tls`` record (:mod:`.tlsrpt`), and sends it to every ``rua`` URI: ``https:`` as
a POST of the gzipped JSON (``application/tlsrpt+gzip``), ``mailto:`` as a message
submitted to jsqueue's own SMTP front end, which queues and delivers it like any other.
Names are resolved through the configured nameservers; off unless
``outbound_tls.report.enabled``. :func:`report_loop` is the worker's daily task.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import ssl
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
import aiosmtplib
import dns.exception
import dns.resolver

from jsqueue.config import Settings
from jsqueue.delivery.policy.dane import DnssecResolver, DnssecState
from jsqueue.delivery.policy.mta_sts import DnsHttpResolver, StsPolicy
from jsqueue.delivery.policy.tlsrpt import (
    ReportSession,
    build_report,
    day_range,
    parse_rua,
    report_message,
    sessions_by_domain,
)
from jsqueue.delivery.resolver import stub_resolver
from jsqueue.errors import JsqueueError, PolicyError, StoreError
from jsqueue.events import Event, EventKind, tail
from jsqueue.store.base import Stores

__all__ = ["SentReport", "TlsReporter", "report_loop"]

log = logging.getLogger(__name__)

#: How long the cluster-wide mark of a reported day is kept, seconds.
REPORTED_MARK_S = 3 * 86400


@dataclass(frozen=True)
class SentReport:
    """One report sent (or not) to one URI.

    Attributes:
        domain: the policy domain.
        uri: the ``rua`` URI.
        ok: delivered to the receiver (HTTP 2xx, or the front end answered 250).
        detail: the receiver's answer or the failure.
        report: the JSON report.
    """

    domain: str
    uri: str
    ok: bool
    detail: str
    report: dict[str, Any]


class TlsReporter:
    """Builds and sends a day's TLS reports.

    Args:
        settings: all settings (``outbound_tls.report``, ``worker`` nameservers, ``smtp``
            for the submission address, ``nats`` for the events stream).
        urls: NATS server URLs.
        stores: the queue's stores; their policy cache gives the MTA-STS policy strings.
        submit_host: the front end's address for ``mailto:`` reports; ``smtp.host``
            when None.
        submit_port: its port; ``smtp.port`` when None.
    """

    def __init__(
        self,
        settings: Settings,
        urls: list[str],
        stores: Stores | None = None,
        *,
        submit_host: str | None = None,
        submit_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.urls = urls
        self.stores = stores
        self.submit_host = submit_host or settings.smtp.host
        self.submit_port = submit_port or settings.smtp.port
        self._resolver = stub_resolver(settings.worker)
        self._dnssec = DnssecResolver.from_settings(settings.outbound_tls, settings.worker)

    async def events(self, day: date) -> list[Event]:
        """The attempt events stored on ``day`` (UTC), read from the events stream.

        Raises:
            StoreUnavailable: NATS unreachable or no events stream.
        """
        start, end = day_range(day)
        kinds = (EventKind.DELIVERED, EventKind.DEFERRED, EventKind.BOUNCED)
        found: list[Event] = []
        async for event in tail(
            self.settings.nats, self.urls, kinds=kinds, since=start, until_end=True
        ):
            if event.at < end:
                found.append(event)
        return found

    async def rua(self, domain: str) -> list[str]:
        """The ``rua`` URIs of ``_smtp._tls.<domain>`` (RFC 8460 §3); empty when none.

        Raises:
            PolicyError: the lookup failed (SERVFAIL, timeout).
        """
        try:
            answer = await self._resolver.resolve(f"_smtp._tls.{domain}", "TXT")
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as e:
            raise PolicyError(f"_smtp._tls.{domain} TXT: {e}") from e
        return parse_rua([b"".join(rr.strings).decode("ascii", "replace") for rr in answer])

    async def _sts_strings(self, domain: str) -> tuple[dict[Any, list[str]], dict[Any, list[str]]]:
        """Policy strings and mx patterns of the cached MTA-STS policy of ``domain``."""
        cache = self.stores.policies if self.stores is not None else None
        if cache is None:
            return {}, {}
        try:
            data = await cache.get(domain)
            policy = StsPolicy.from_json(data) if data else None
        except (StoreError, ValueError) as e:
            log.info("TLS report %s: no cached MTA-STS policy (%s)", domain, e)
            return {}, {}
        if policy is None:
            return {}, {}
        return {("sts", policy.id): policy.policy_strings()}, {policy.id: list(policy.mx)}

    async def _tlsa_strings(self, sessions: list[ReportSession]) -> dict[Any, list[str]]:
        """The current TLSA records of the MX hosts of the DANE sessions, as
        ``policy-string`` (RFC 8460 §4.4: the TLSA RRset), when they validate."""
        hosts = sorted({s.mx for s in sessions if s.policy_type == "tlsa" and s.mx})
        lines: list[str] = []
        for host in hosts:
            found = await self._dnssec.tlsa(host)
            if found.state is DnssecState.SECURE:
                lines += [f"_25._tcp.{host}. IN TLSA {r.text()}" for r in found.records]
        return {("tlsa", None): lines} if lines else {}

    async def report_day(
        self, day: date, events: Iterable[Event] | AsyncIterable[Event] | None = None
    ) -> list[SentReport]:
        """Build and send ``day``'s reports (RFC 8460 §4.1: one per policy domain per UTC
        day); domains without a ``_smtp._tls`` record get none. Not idempotent: each call
        sends again.

        Args:
            day: the UTC day.
            events: the events to count; read from the events stream when None.

        Returns:
            one :class:`SentReport` per (domain, URI).

        Raises:
            StoreUnavailable: the events stream cannot be read.
        """
        if events is None:
            listed: list[Event] = await self.events(day)
        elif isinstance(events, AsyncIterable):
            listed = [e async for e in events]
        else:
            listed = list(events)
        start, end = day_range(day)
        conf = self.settings.outbound_tls.report
        sent: list[SentReport] = []
        for domain, sessions in sorted(sessions_by_domain(listed, start, end).items()):
            try:
                uris = await self.rua(domain)
            except PolicyError as e:
                log.warning("TLS report %s: %s", domain, e)
                continue
            if not uris:
                continue
            strings, patterns = await self._sts_strings(domain)
            strings.update(await self._tlsa_strings(sessions))
            report = build_report(
                domain,
                sessions,
                day,
                organization=conf.organization,
                contact=conf.contact,
                policy_strings=strings,
                mx_patterns=patterns,
            )
            for uri in uris:
                try:
                    detail = await self.send(domain, uri, report)
                except PolicyError as e:
                    log.warning("TLS report %s to %s: %s", domain, uri, e)
                    sent.append(SentReport(domain, uri, False, str(e), report))
                else:
                    log.info("TLS report %s sent to %s: %s", domain, uri, detail)
                    sent.append(SentReport(domain, uri, True, detail, report))
        return sent

    async def send(self, domain: str, uri: str, report: dict[str, Any]) -> str:
        """Send one report to one ``rua`` URI (RFC 8460 §5.3).

        Returns:
            the receiver's answer.

        Raises:
            PolicyError: the URI is unsupported, or sending failed.
        """
        if uri.startswith("https://"):
            return await self._post(uri, report)
        if uri.startswith("mailto:"):
            return await self._mail(domain, unquote(uri[7:].partition("?")[0]), report)
        raise PolicyError(f"unsupported rua URI {uri!r}")

    async def _post(self, uri: str, report: dict[str, Any]) -> str:
        conf = self.settings.outbound_tls.report
        parts = urlsplit(uri)
        if conf.https_port is not None:
            uri = parts._replace(netloc=f"{parts.hostname}:{conf.https_port}").geturl()
        ca = str(conf.https_ca_file) if conf.https_ca_file else None
        try:
            context = ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise PolicyError(f"outbound_tls.report.https_ca_file: {e}") from e
        body = gzip.compress(json.dumps(report).encode())
        connector = aiohttp.TCPConnector(resolver=DnsHttpResolver(self._resolver), ssl=context)
        timeout = aiohttp.ClientTimeout(total=30)
        headers = {"Content-Type": "application/tlsrpt+gzip"}
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
                http.post(uri, data=body, headers=headers, allow_redirects=False) as response,
            ):
                if not 200 <= response.status < 300:
                    raise PolicyError(f"{uri}: HTTP {response.status}")
                return f"HTTP {response.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise PolicyError(f"{uri}: {e or type(e).__name__}") from e

    async def _mail(self, domain: str, to: str, report: dict[str, Any]) -> str:
        conf = self.settings.outbound_tls.report
        message = report_message(
            report, domain=domain, organization=conf.organization, sender=conf.contact, to=to
        )
        try:
            async with aiosmtplib.SMTP(
                hostname=self.submit_host, port=self.submit_port, start_tls=False, timeout=30
            ) as smtp:
                _, answer = await smtp.sendmail(conf.contact, [to], message)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
            raise PolicyError(f"mailto:{to}: submission failed: {e}") from e
        return answer


async def report_loop(reporter: TlsReporter, stores: Stores, stop: asyncio.Event) -> None:
    """Send yesterday's reports once per day across the cluster: every
    ``outbound_tls.report.interval_s`` a worker takes the ``tls-report`` lock, and the
    first to find no mark for yesterday in the policy cache sends and marks it. Runs until
    ``stop`` is set; failures are logged and tried again at the next interval.
    """
    interval = reporter.settings.outbound_tls.report.interval_s
    while not stop.is_set():
        try:
            await _report_once(reporter, stores)
        except JsqueueError as e:
            log.warning("TLS reports: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)


async def _report_once(reporter: TlsReporter, stores: Stores) -> None:
    """One check: report yesterday unless some worker did.

    Raises:
        StoreUnavailable: NATS unreachable.
    """
    day = (datetime.now(UTC) - timedelta(days=1)).date()
    mark = f"tlsrpt-{day.isoformat()}"
    if stores.policies is None or await stores.policies.get(mark) is not None:
        return
    lock = await stores.lock("tls-report", 600.0) if stores.lock is not None else None
    if lock is not None and not await lock.acquire():
        return
    try:
        if await stores.policies.get(mark) is not None:
            return
        sent = await reporter.report_day(day)
        await stores.policies.put(mark, json.dumps(len(sent)).encode(), REPORTED_MARK_S)
    finally:
        if lock is not None:
            await lock.release()
