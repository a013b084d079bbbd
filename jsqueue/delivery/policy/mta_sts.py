"""MTA-STS (RFC 8461): the ``_mta-sts`` TXT record, the policy fetched over HTTPS from
``mta-sts.<domain>/.well-known/mta-sts.txt``, its strict parser, MX pattern matching, and
:class:`MtaSts`, which keeps policies in the cluster-wide cache
(:class:`~jsqueue.store.policies.PolicyCache`) for their ``max_age`` and fetches again when
the TXT id changes.

The parser is our own, after RFC 8461 §3.2: the maintained ``postfix-mta-sts-resolver``
package parses leniently (it keeps any key, checks no value) and brings its own resolver
(aiodns), while every name here must be resolved through jsqueue's configured nameservers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import dns.asyncresolver
import dns.exception
import dns.resolver
from aiohttp.abc import AbstractResolver, ResolveResult

from jsqueue.errors import InvalidName, PolicyError, StoreError
from jsqueue.store.policies import PolicyCache

__all__ = [
    "DnsHttpResolver",
    "MtaSts",
    "StsLookup",
    "StsMode",
    "StsPolicy",
    "mx_matches",
    "parse_policy",
    "parse_record",
]

log = logging.getLogger(__name__)

#: Largest policy body read, octets (RFC 8461 §3.3 lets senders bound it; 64 KiB).
MAX_POLICY_OCTETS = 64 * 1024
#: RFC 8461 §3.2: max_age is at most 31557600 seconds (about one year).
MAX_AGE_LIMIT_S = 31_557_600

_ID_RE = re.compile(r"[A-Za-z0-9]{1,32}")
_MAX_AGE_RE = re.compile(r"[0-9]{1,10}")
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_PATTERN_RE = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})+")
INVALID = "sts-policy-invalid"
#: RFC 8461 §3.2: ``sts-policy-ext-name = (ALPHA / DIGIT) *31(ALPHA / DIGIT / "_" / "-" /
#: ".")``; the standard keys (``version``, ``mode``, ``max_age``, ``mx``) fit it too.
_LINE_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,31}):[ \t]*(.*?)[ \t]*")


class StsMode(StrEnum):
    """The policy modes (RFC 8461 §5)."""

    ENFORCE = "enforce"
    TESTING = "testing"
    NONE = "none"


@dataclass(frozen=True)
class StsPolicy:
    """One MTA-STS policy as fetched (RFC 8461 §3.2).

    Attributes:
        domain: the policy domain (A-label, lower case).
        id: the TXT record's id the policy was fetched under.
        mode: enforce, testing or none.
        mx: the MX patterns, lower case (``mx.example.net``, ``*.example.net``).
        max_age_s: lifetime in a cache, seconds.
        fetched_at: when it was fetched, epoch seconds.
        text: the policy body as served (for TLS reports' ``policy-string``).
    """

    domain: str
    id: str
    mode: StsMode
    mx: tuple[str, ...]
    max_age_s: int
    fetched_at: float
    text: str

    def allows(self, mx_host: str) -> bool:
        """Whether ``mx_host`` matches one of the patterns (RFC 8461 §4.1)."""
        return any(mx_matches(p, mx_host) for p in self.mx)

    @property
    def expires_at(self) -> float:
        """Epoch seconds after which the policy is no longer used."""
        return self.fetched_at + self.max_age_s

    def policy_strings(self) -> list[str]:
        """The body's lines, for RFC 8460 §4.4 ``policy-string``."""
        return [line for line in self.text.replace("\r\n", "\n").split("\n") if line]

    def to_json(self) -> bytes:
        """The cached form."""
        return json.dumps({**asdict(self), "mx": list(self.mx)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StsPolicy:
        """Parse the cached form.

        Raises:
            ValueError: not a cached policy.
        """
        try:
            raw: dict[str, Any] = json.loads(data)
            return cls(
                domain=str(raw["domain"]),
                id=str(raw["id"]),
                mode=StsMode(raw["mode"]),
                mx=tuple(str(p) for p in raw["mx"]),
                max_age_s=int(raw["max_age_s"]),
                fetched_at=float(raw["fetched_at"]),
                text=str(raw["text"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a cached MTA-STS policy: {e}") from e


@dataclass(frozen=True)
class StsLookup:
    """What :meth:`MtaSts.lookup` found for a domain.

    Attributes:
        policy: the policy to apply (enforce or testing), or None.
        failure: an RFC 8460 result type when discovery or the fetch failed
            (``sts-policy-fetch-error``, ``sts-policy-invalid``, ``sts-webpki-invalid``);
            ``policy`` is then the cached one, if any.
        detail: words for the log and ``queue show``.
    """

    policy: StsPolicy | None
    failure: str | None = None
    detail: str = ""


def parse_record(texts: list[str]) -> str | None:
    """The policy id of the ``_mta-sts`` TXT RRset (RFC 8461 §3.1), or None when there is
    no usable record: records not starting ``v=STSv1`` are ignored; more than one that does,
    or one without a valid ``id`` (1-32 letters and digits), is no record at all. Pure.

    Args:
        texts: each TXT record's strings already joined.
    """
    records = [t for t in texts if re.match(r"v=STSv1[ \t]*(;|$)", t)]
    if len(records) != 1:
        return None
    fields: dict[str, str] = {}
    for part in records[0].split(";"):
        key, eq, value = part.strip().partition("=")
        if key and eq:
            fields.setdefault(key.strip(), value.strip())
    policy_id = fields.get("id", "")
    return policy_id if _ID_RE.fullmatch(policy_id) else None


def parse_policy(domain: str, policy_id: str, text: str, fetched_at: float) -> StsPolicy:
    """Parse a policy body strictly (RFC 8461 §3.2). Pure.

    Lines end in CRLF or LF; each is ``key: value``. ``version`` must be ``STSv1``,
    ``mode`` one of enforce/testing/none, ``max_age`` 1-10 digits and at most 31557600;
    ``mx`` (repeatable) a host name or ``*.``-wildcard, at least one unless the mode is
    ``none``. ``version``, ``mode`` and ``max_age`` may appear once each; other keys
    (extensions, whose names may hold ``_``, ``-`` and ``.``) are ignored, so that an
    extension a policy domain adds never turns its policy into no policy.

    Raises:
        PolicyError: the body is not a valid policy (result type ``sts-policy-invalid``).
    """

    what = f"MTA-STS policy of {domain}"
    fields: dict[str, str] = {}
    patterns: list[str] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if not line.strip():
            continue
        match = _LINE_RE.fullmatch(line)
        if match is None:
            raise PolicyError(f"{what}: unparsable line {line[:80]!r}", INVALID)
        key, value = match.group(1), match.group(2)
        if key == "mx":
            pattern = value.lower().rstrip(".")
            if not _PATTERN_RE.fullmatch(pattern):
                raise PolicyError(f"{what}: invalid mx pattern {value[:80]!r}", INVALID)
            patterns.append(pattern)
        elif key in ("version", "mode", "max_age"):
            if key in fields:
                raise PolicyError(f"{what}: {key} given twice", INVALID)
            fields[key] = value
    if fields.get("version") != "STSv1":
        raise PolicyError(f"{what}: version {fields.get('version')!r} is not STSv1", INVALID)
    try:
        mode = StsMode(fields.get("mode", ""))
    except ValueError as e:
        raise PolicyError(f"{what}: invalid mode {fields.get('mode')!r}", INVALID) from e
    max_age = fields.get("max_age", "")
    if not _MAX_AGE_RE.fullmatch(max_age) or int(max_age) > MAX_AGE_LIMIT_S:
        raise PolicyError(f"{what}: invalid max_age {max_age!r}", INVALID)
    if not patterns and mode is not StsMode.NONE:
        raise PolicyError(f"{what}: no mx pattern", INVALID)
    return StsPolicy(domain, policy_id, mode, tuple(patterns), int(max_age), fetched_at, text)


def mx_matches(pattern: str, mx_host: str) -> bool:
    """RFC 8461 §4.1: an MX host name matches a pattern when equal to it (case-insensitive,
    without trailing dot), or when the pattern is ``*.<rest>`` and the host is exactly one
    label followed by ``.<rest>`` (``*.example.com`` matches ``mx1.example.com``, neither
    ``example.com`` nor ``a.b.example.com``). Pure."""
    host = mx_host.lower().rstrip(".")
    pattern = pattern.lower().rstrip(".")
    if pattern.startswith("*."):
        label, dot, rest = host.partition(".")
        return bool(label) and bool(dot) and rest == pattern[2:]
    return host == pattern


class DnsHttpResolver(AbstractResolver):
    """aiohttp's resolver seam, answered by dnspython through the configured nameservers
    (never the system resolver): the policy host is looked up like an MX host."""

    def __init__(self, resolver: dns.asyncresolver.Resolver) -> None:
        self._resolver = resolver

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found: list[ResolveResult] = []
        for rdtype, fam in (("A", socket.AF_INET), ("AAAA", socket.AF_INET6)):
            if family not in (socket.AF_UNSPEC, fam):
                continue
            try:
                answer = await self._resolver.resolve(host, rdtype)
            except dns.exception.DNSException:
                continue
            for rr in answer:
                found.append(
                    {
                        "hostname": host,
                        "host": rr.to_text(),
                        "port": port,
                        "family": fam,
                        "proto": 0,
                        "flags": socket.AI_NUMERICHOST,
                    }
                )
        if not found:
            raise OSError(f"no address for {host}")
        return found

    async def close(self) -> None:
        return None


async def _read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The response body up to ``limit`` octets: read until the end of the body or the
    limit (one read returns what has arrived so far, which may be only part of it).

    Raises:
        aiohttp.ClientError: the connection failed while reading.
        TimeoutError: the session's timeout ran out.
    """
    body = bytearray()
    while len(body) < limit:
        chunk = await response.content.read(limit - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


class MtaSts:
    """MTA-STS discovery, fetch and cache for the worker (RFC 8461 §3, §5.1).

    Args:
        resolver: dnspython resolver on the configured nameservers.
        cache: the cluster-wide policy cache.
        port: HTTPS port of the policy host (443; tests use their own).
        ca_file: CA bundle that validates the policy host's certificate; the system's
            when None.
        timeout_s: fetch timeout (connect and read), seconds.
        max_age_s: upper bound on a policy's max_age, seconds.
        recheck_s: how long a lookup's result is reused in this process, seconds (0: not).
    """

    def __init__(
        self,
        resolver: dns.asyncresolver.Resolver,
        cache: PolicyCache,
        *,
        port: int = 443,
        ca_file: str | None = None,
        timeout_s: float = 10.0,
        max_age_s: int = MAX_AGE_LIMIT_S,
        recheck_s: float = 0.0,
    ) -> None:
        self._recheck_s = recheck_s
        self._memo: dict[str, tuple[float, StsLookup]] = {}
        self._running: dict[str, asyncio.Future[StsLookup]] = {}
        self._resolver = resolver
        self._cache = cache
        self._port = port
        self._ca_file = ca_file
        self._timeout_s = timeout_s
        self._max_age_s = max_age_s

    async def record_id(self, domain: str) -> str | None:
        """The id of ``_mta-sts.<domain>`` (RFC 8461 §3.1), or None when there is none.

        Raises:
            PolicyError: the lookup failed (SERVFAIL, timeout): ``sts-policy-fetch-error``.
        """
        try:
            answer = await self._resolver.resolve(f"_mta-sts.{domain}", "TXT")
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None
        except dns.exception.DNSException as e:
            raise PolicyError(f"_mta-sts.{domain} TXT: {e}", "sts-policy-fetch-error") from e
        texts = [b"".join(rr.strings).decode("ascii", "replace") for rr in answer]
        return parse_record(texts)

    async def fetch(self, domain: str, policy_id: str) -> StsPolicy:
        """GET ``https://mta-sts.<domain>/.well-known/mta-sts.txt`` with the certificate
        validated for that name, no redirects followed, ``200`` and ``text/plain`` only
        (RFC 8461 §3.3), and parse it. Not cached here.

        Raises:
            PolicyError: ``sts-webpki-invalid`` (certificate), ``sts-policy-fetch-error``
                (connection, status, media type, size) or ``sts-policy-invalid`` (body).
        """
        host = f"mta-sts.{domain}"
        url = f"https://{host}:{self._port}/.well-known/mta-sts.txt"
        try:
            context = ssl.create_default_context(cafile=self._ca_file)
        except (OSError, ssl.SSLError) as e:
            raise PolicyError(f"CA file {self._ca_file}: {e}", "sts-webpki-invalid") from e
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        connector = aiohttp.TCPConnector(resolver=DnsHttpResolver(self._resolver), ssl=context)
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
                http.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise PolicyError(f"{url}: HTTP {response.status}", "sts-policy-fetch-error")
                if response.content_type != "text/plain":
                    what = f"{url}: media type {response.content_type}, not text/plain"
                    raise PolicyError(what, "sts-policy-fetch-error")
                body = await _read_body(response, MAX_POLICY_OCTETS + 1)
        except aiohttp.ClientConnectorCertificateError as e:
            raise PolicyError(f"{url}: certificate: {e}", "sts-webpki-invalid") from e
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise PolicyError(f"{url}: {e or type(e).__name__}", "sts-policy-fetch-error") from e
        if len(body) > MAX_POLICY_OCTETS:
            raise PolicyError(f"{url}: larger than {MAX_POLICY_OCTETS} octets")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PolicyError(f"{url}: not UTF-8", "sts-policy-invalid") from e
        policy = parse_policy(domain, policy_id, text, time.time())
        if policy.max_age_s > self._max_age_s:
            return StsPolicy(**{**asdict(policy), "max_age_s": self._max_age_s})
        return policy

    async def _cached(self, domain: str) -> StsPolicy | None:
        try:
            data = await self._cache.get(domain)
        except (StoreError, InvalidName) as e:
            log.warning("MTA-STS cache of %s unreadable: %s", domain, e)
            return None
        if data is None:
            return None
        try:
            policy = StsPolicy.from_json(data)
        except ValueError as e:
            log.warning("MTA-STS cache of %s: %s", domain, e)
            return None
        return policy if policy.expires_at > time.time() else None

    async def lookup(self, domain: str) -> StsLookup:
        """The policy that applies to ``domain`` now (RFC 8461 §3.3, §5.1): the cached one
        while the TXT id is unchanged; a new fetch when the id differs or nothing is
        cached; a fetched ``none`` policy removes the cached one and applies nothing; a
        failed discovery or fetch falls back to the cached policy, if unexpired. Never
        raises: failures come back in :attr:`StsLookup.failure`. Idempotent apart from
        the cache writes. The result is reused for ``recheck_s`` seconds, and concurrent
        lookups of one domain share one (one fetch for a burst of deliveries).
        """
        domain = domain.lower().rstrip(".")
        now = time.monotonic()
        memo = self._memo.get(domain)
        if memo is not None and memo[0] > now:
            return memo[1]
        running = self._running.get(domain)
        if running is not None:  # another delivery to the domain is looking it up now
            return await asyncio.shield(running)
        task = asyncio.ensure_future(self._lookup(domain))
        self._running[domain] = task
        try:
            found = await asyncio.shield(task)
        finally:
            if task.done():
                self._running.pop(domain, None)
            else:
                task.add_done_callback(lambda _: self._running.pop(domain, None))
        if self._recheck_s > 0:
            if len(self._memo) > 10_000:
                self._memo.clear()
            self._memo[domain] = (now + self._recheck_s, found)
        return found

    async def _lookup(self, domain: str) -> StsLookup:
        try:
            policy_id = await self.record_id(domain)
        except PolicyError as e:
            cached = await self._cached(domain)
            return StsLookup(cached, e.result_type, f"{e}; using the cached policy")
        cached = await self._cached(domain)
        if policy_id is None:
            # RFC 8461 §3.3/§5.1: a cached policy stays in force until it expires.
            return StsLookup(cached, detail="no _mta-sts record" if cached is None else "")
        if cached is not None and cached.id == policy_id:
            return StsLookup(cached)
        try:
            policy = await self.fetch(domain, policy_id)
        except PolicyError as e:
            log.warning("MTA-STS %s: %s", domain, e)
            return StsLookup(cached, e.result_type, str(e))
        try:
            if policy.mode is StsMode.NONE:
                await self._cache.delete(domain)
                return StsLookup(None, detail=f"MTA-STS policy {policy_id} is mode none")
            await self._cache.put(domain, policy.to_json(), policy.max_age_s)
        except (StoreError, InvalidName) as e:
            log.warning("MTA-STS cache of %s not written: %s", domain, e)
        log.info("MTA-STS %s: policy %s, mode %s", domain, policy_id, policy.mode.value)
        return StsLookup(policy)
