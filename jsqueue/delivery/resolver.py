"""Where to send mail for a destination domain (RFC 5321 §5.1, RFC 7505): a
:class:`Resolver` turns a routing domain into the ordered :class:`MxTarget` list the SMTP
client tries, by DNS (:class:`DnsResolver`), to one relay (:class:`SmarthostResolver`) or
fixed (:class:`StaticResolver`); :func:`resolver_from_settings` picks one. The rules are in
``docs/architecture.md`` (Delivery, MX resolution).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.message
import dns.rdatatype
import dns.resolver
import dns.rrset
import idna

from jsqueue.config import SmarthostSettings, WorkerSettings
from jsqueue.errors import PermanentDeliveryError, TemporaryDeliveryError
from jsqueue.replies import (
    R451_DNS_TEMPFAIL,
    R451_SMARTHOST_DNS,
    R550_MX_HOST_NOT_FOUND,
    R550_NO_SUCH_DOMAIN,
    R550_NULL_MX,
    Reply,
)

log = logging.getLogger(__name__)

MAX_CNAME_HOPS = 8
"""CNAME records followed for one name before the lookup fails temporarily as a loop."""


@dataclass(frozen=True, slots=True)
class MxTarget:
    """One address to try, in the order the client should try them.

    Attributes:
        host: the MX host name (A-label, no trailing dot), the domain itself for an implicit
            MX, the address literal (``[127.0.0.1]``), or the smarthost name. Used for logs,
            ``Reply.remote_host``, TLS SNI and certificate verification.
        address: the IPv4 or IPv6 address to connect to.
        preference: the MX preference; None for an implicit MX, literal or smarthost.
        port: TCP port; None means ``WorkerSettings.mx_port``.
        relay: True for the configured smarthost: only then may AUTH credentials be sent.
    """

    host: str
    address: str
    preference: int | None = None
    port: int | None = None
    relay: bool = False


class Resolver(Protocol):
    """Finds the MX targets of a destination domain."""

    async def resolve(self, domain: str) -> list[MxTarget]:
        """The addresses to try for ``domain``, in order (never empty).

        Args:
            domain: the routing domain (A-label or address literal, see
                :func:`jsqueue.envelope.routing_domain`).

        Raises:
            PermanentDeliveryError: the domain cannot receive mail (NXDOMAIN, null MX, no
                address for any MX host).
            TemporaryDeliveryError: the answer could not be had now (SERVFAIL, timeout,
                CNAME loop, ...).
        """
        ...


def _reply(base: Reply, detail: str) -> Reply:
    return base.model_copy(update={"text": f"{base.text}: {detail}"})


def _literal_address(domain: str) -> str | None:
    """The address inside an address literal (``[1.2.3.4]``, ``[IPv6:::1]``), else None."""
    if not (domain.startswith("[") and domain.endswith("]")):
        return None
    inner = domain[1:-1]
    if inner.lower().startswith("ipv6:"):
        inner = inner[5:]
    try:
        return str(ipaddress.ip_address(inner))
    except ValueError:
        return None


def _ascii_domain(domain: str) -> str:
    domain = domain.strip().rstrip(".").lower()
    if domain.isascii():
        return domain
    try:
        return idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError as e:
        raise PermanentDeliveryError(
            _reply(R550_NO_SUCH_DOMAIN, f"invalid domain {domain!r}")
        ) from e


class _NoData(Exception):
    """Internal: the name exists but has no records of the type (NOERROR/NODATA)."""

    def __init__(self, canonical: str) -> None:
        super().__init__(canonical)
        self.canonical = canonical


class AnswerCache(dns.resolver.LRUCache):
    """dnspython's LRU cache of answers, each kept for its TTL (RFC 1035 §3.2.1; NXDOMAIN
    and NODATA for the SOA's negative TTL, RFC 2308 §5) but at most ``max_ttl_s``
    seconds, so that a record changed, or flushed at the resolver, is seen within that
    whatever TTL it was published with.

    Args:
        max_size: answers kept (least recently used go first).
        max_ttl_s: longest an answer is kept, seconds.
    """

    def __init__(self, max_size: int, max_ttl_s: float) -> None:
        super().__init__(max_size)
        self.max_ttl_s = max_ttl_s

    def put(self, key: dns.resolver.CacheKey, value: dns.resolver.Answer) -> None:
        """Keep ``value`` until its expiration or ``max_ttl_s`` from now, the earlier."""
        value.expiration = min(value.expiration, time.time() + self.max_ttl_s)
        super().put(key, value)


def answer_cache(settings: WorkerSettings) -> AnswerCache | None:
    """The cache ``worker.dns_cache_size`` and ``worker.dns_cache_max_ttl_s`` ask for; None
    when the size is 0."""
    if not settings.dns_cache_size:
        return None
    return AnswerCache(settings.dns_cache_size, settings.dns_cache_max_ttl_s)


def stub_resolver(settings: WorkerSettings) -> dns.asyncresolver.Resolver:
    """A dnspython stub resolver on ``worker.nameservers`` (``/etc/resolv.conf`` when
    empty) with ``worker.dns_timeout_s`` as its lifetime, keeping answers in
    :func:`answer_cache` (SERVFAIL and timeouts are not kept)."""
    s = settings
    return _stub(s.nameservers, s.nameserver_port, s.dns_timeout_s, answer_cache(s))


def _stub(
    nameservers: Sequence[str], port: int, timeout_s: float, cache: AnswerCache | None
) -> dns.asyncresolver.Resolver:
    resolver = dns.asyncresolver.Resolver(configure=not nameservers)
    if nameservers:
        resolver.nameservers = list(nameservers)
        resolver.port = port
    resolver.timeout = resolver.lifetime = timeout_s
    resolver.cache = cache
    return resolver


class DnsResolver:
    """MX resolution with dnspython's asyncio stub resolver (RFC 5321 §5.1, RFC 7505).

    Each DNS query gives up after ``timeout_s`` (the dnspython lifetime, retries included);
    one :meth:`resolve` makes one MX query plus one A and one AAAA query per MX host used
    (run concurrently), each bounded on its own. Lookups never block the event loop, so a
    slow domain does not delay other deliveries.

    Args:
        nameservers: IP addresses of the DNS servers to ask; empty = the system's
            ``/etc/resolv.conf`` (never used by tests).
        port: UDP/TCP port of those servers.
        timeout_s: lifetime of one query, seconds.
        max_addresses: at most this many targets are returned per resolve, and one more:
            a target at one of ``own_addresses`` of the last preference returned, so that
            :func:`without_myself` finds this queue there (RFC 5321 §5.1).
        prefer_ipv6: list a host's IPv6 addresses before its IPv4 ones (default IPv4 first).
        rng: random source for shuffling equal preferences (tests pass a seeded one).
        cache: the answers kept (:func:`answer_cache`); None = none.
        own_addresses: this queue's addresses (``worker.own_addresses``, normal form).
        mx_address_targets: use an MX record whose exchange is an IP address
            (``MX 10 192.0.2.1.``) as that address. RFC 1035 §3.3.9 and RFC 5321 §5.1 make
            the exchange a host name, and Postfix refuses such records; by default (False)
            one is unusable: the next MX is tried, and with none left the recipients fail
            naming it (``550 5.4.4``).
    """

    def __init__(
        self,
        nameservers: Sequence[str] = (),
        *,
        port: int = 53,
        timeout_s: float = 5.0,
        max_addresses: int = 5,
        prefer_ipv6: bool = False,
        rng: random.Random | None = None,
        cache: AnswerCache | None = None,
        own_addresses: Collection[str] = (),
        mx_address_targets: bool = False,
    ) -> None:
        self._resolver = _stub(nameservers, port, timeout_s, cache)
        self._mx_address_targets = mx_address_targets
        self._own = own_addresses
        self._timeout_s = timeout_s
        self._max = max_addresses
        self._prefer_ipv6 = prefer_ipv6
        self._rng = rng or random.Random()

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> DnsResolver:
        """Build from ``worker.nameservers``, ``nameserver_port``, ``dns_timeout_s``,
        ``max_mx_addresses``, ``dns_cache_size``, ``dns_cache_max_ttl_s``,
        ``own_addresses`` and ``mx_address_targets``."""
        return cls(
            settings.nameservers,
            port=settings.nameserver_port,
            timeout_s=settings.dns_timeout_s,
            max_addresses=settings.max_mx_addresses,
            cache=answer_cache(settings),
            own_addresses=settings.own_addresses,
            mx_address_targets=settings.mx_address_targets,
        )

    async def resolve(self, domain: str) -> list[MxTarget]:
        """The ordered MX targets of ``domain``; see :meth:`Resolver.resolve`.

        Raises:
            PermanentDeliveryError: NXDOMAIN (``550 5.1.2``), null MX (``550 5.1.10``), no
                address for the domain or any of its MX hosts, or no usable MX host (an IP
                address as the exchange, see ``mx_address_targets``; ``550 5.4.4``, naming
                it).
            TemporaryDeliveryError: SERVFAIL, timeout, CNAME loop, or an MX host lookup
                failed temporarily and no other host had an address (``451 4.4.3``).
        """
        literal = _literal_address(domain.strip())
        if literal is not None:
            if not _usable(literal):
                detail = f"{domain.strip()} is no remote address"
                raise PermanentDeliveryError(_reply(R550_MX_HOST_NOT_FOUND, detail))
            return [MxTarget(host=domain.strip().lower(), address=literal)]
        name = _ascii_domain(domain)
        try:
            records, _ = await self._query(name, dns.rdatatype.MX)
        except _NoData as nodata:
            # RFC 5321 §5.1: no MX records -> the domain itself is the implicit MX.
            addresses, error = await self._addresses(nodata.canonical)
            if addresses:
                return [MxTarget(host=name, address=a) for a in addresses[: self._max]]
            if error is not None:
                raise error from None
            raise PermanentDeliveryError(
                _reply(R550_MX_HOST_NOT_FOUND, f"{name} has no MX, A or AAAA records")
            ) from None
        mx = sorted(
            (
                (int(rd.preference), rd.exchange.to_text(omit_final_dot=True).lower())
                for rd in records
            ),
            key=lambda pair: pair[0],
        )
        if all(host in ("", ".") for _, host in mx):
            # RFC 7505 §3: the domain explicitly accepts no mail; do not connect anywhere.
            raise PermanentDeliveryError(_reply(R550_NULL_MX, name))
        hosts = self._order([(pref, host) for pref, host in mx if host not in ("", ".")])
        targets: list[MxTarget] = []
        last_error: TemporaryDeliveryError | None = None
        unusable: list[str] = []  # why MX hosts cannot be used at all
        for pref, host in hosts:
            if len(targets) >= self._max and (not self._own or pref != targets[-1].preference):
                break  # (with own_addresses: this queue may be in the last preference)
            addresses, error = await self._exchange_addresses(host, name)
            if error is not None:
                log.warning("MX host %s of %s: %s", host, name, error.reply.text)
                last_error = error if isinstance(error, TemporaryDeliveryError) else last_error
                if isinstance(error, PermanentDeliveryError):
                    unusable.append(
                        error.reply.text.removeprefix(f"{R550_MX_HOST_NOT_FOUND.text}: ")
                    )
            for address in addresses:
                if all(t.address != address for t in targets):
                    targets.append(MxTarget(host=host, address=address, preference=pref))
        if targets:  # this queue is kept past the cut, for the loop check (RFC 5321 §5.1)
            me = [t for t in targets[self._max :] if at_own_address(t, self._own)]
            return targets[: self._max] + me[:1]
        if last_error is not None:
            raise last_error
        why = f"no usable MX host of {name}: {'; '.join(unusable) or 'none has an address'}"
        raise PermanentDeliveryError(_reply(R550_MX_HOST_NOT_FOUND, why))

    def _order(self, mx: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Sort by preference, shuffle within equal preferences, drop repeated hosts."""
        groups: dict[int, list[str]] = {}
        for pref, host in mx:
            groups.setdefault(pref, [])
            if host not in groups[pref]:
                groups[pref].append(host)
        ordered: list[tuple[int, str]] = []
        seen: set[str] = set()
        for pref in sorted(groups):
            hosts = groups[pref]
            self._rng.shuffle(hosts)
            for host in hosts:
                if host not in seen:
                    seen.add(host)
                    ordered.append((pref, host))
        return ordered

    async def _query(
        self, name: str, rdtype: dns.rdatatype.RdataType
    ) -> tuple[dns.rrset.RRset, str]:
        """One lookup, following CNAMEs (also when the server returns only the CNAME).

        Returns:
            the answer RRset and the canonical name it belongs to.

        Raises:
            _NoData: NOERROR without records of ``rdtype`` (carries the canonical name).
            PermanentDeliveryError: NXDOMAIN.
            TemporaryDeliveryError: SERVFAIL, timeout, CNAME loop, other DNS failures.
        """
        qname = name
        seen = {name}
        for _ in range(MAX_CNAME_HOPS + 1):
            try:
                async with asyncio.timeout(self._timeout_s + 1.0):
                    answer = await self._resolver.resolve(
                        qname, rdtype, raise_on_no_answer=False, search=False
                    )
            except dns.resolver.NXDOMAIN as e:
                raise PermanentDeliveryError(_reply(R550_NO_SUCH_DOMAIN, qname)) from e
            except dns.resolver.NoNameservers as e:
                errors = e.kwargs.get("errors") or []
                if any(isinstance(x, dns.message.ChainTooLong) for err in errors for x in err):
                    # A CNAME loop inside the server's answer (dnspython stops at 16 links).
                    break
                raise TemporaryDeliveryError(
                    _reply(R451_DNS_TEMPFAIL, f"{qname} {rdtype.name}: server failure")
                ) from e
            except (dns.exception.Timeout, TimeoutError) as e:
                raise TemporaryDeliveryError(
                    _reply(R451_DNS_TEMPFAIL, f"{qname} {rdtype.name}: timed out")
                ) from e
            except dns.exception.DNSException as e:
                raise TemporaryDeliveryError(
                    _reply(R451_DNS_TEMPFAIL, f"{qname} {rdtype.name}: {e}")
                ) from e
            canonical = answer.canonical_name.to_text(omit_final_dot=True).lower()
            if answer.rrset is not None:
                return answer.rrset, canonical
            if canonical == qname:
                raise _NoData(canonical)
            # The server gave the CNAME but not the target's records: chase it ourselves.
            if canonical in seen:
                break
            seen.add(canonical)
            qname = canonical
        raise TemporaryDeliveryError(_reply(R451_DNS_TEMPFAIL, f"CNAME loop at {name}"))

    async def _exchange_addresses(
        self, host: str, domain: str
    ) -> tuple[list[str], TemporaryDeliveryError | PermanentDeliveryError | None]:
        """:meth:`_addresses` of an MX host, except one written as an IP address: RFC 1035
        §3.3.9 and RFC 5321 §5.1 make the exchange a host name, so such a record is
        unusable (a permanent error naming it, not looked up as a name), unless the operator
        opted in (``mx_address_targets``, as Haraka's ``allow_mx_ip``): then that address is
        used as it is, with a warning, and an unusable address (0.0.0.0, multicast) is not."""
        try:
            ip = unmapped(host)
        except ValueError:
            return await self._addresses(host)
        if not self._mx_address_targets:
            why = (
                f"MX host {host} is an IP address, not a host name (RFC 1035 §3.3.9, RFC 5321 "
                "§5.1; worker.mx_address_targets uses it)"
            )
            return [], PermanentDeliveryError(_reply(R550_MX_HOST_NOT_FOUND, why))
        log.warning("MX host of %s is the address %s, not a name (RFC 5321 §5.1)", domain, host)
        if not _usable(str(ip)):
            why = f"MX host {host} is no remote address"
            return [], PermanentDeliveryError(_reply(R550_MX_HOST_NOT_FOUND, why))
        return [str(ip)], None

    async def _addresses(
        self, host: str
    ) -> tuple[list[str], TemporaryDeliveryError | PermanentDeliveryError | None]:
        """A and AAAA of ``host`` (concurrently), in preference order, plus the error of a
        failed lookup (None when at least one lookup answered or both were NODATA)."""
        results = await asyncio.gather(
            self._typed_addresses(host, dns.rdatatype.A),
            self._typed_addresses(host, dns.rdatatype.AAAA),
            return_exceptions=True,
        )
        v4: list[str] = []
        v6: list[str] = []
        error: TemporaryDeliveryError | PermanentDeliveryError | None = None
        for result, bucket in zip(results, (v4, v6), strict=True):
            if isinstance(result, TemporaryDeliveryError | PermanentDeliveryError):
                # A temporary failure outranks NXDOMAIN when deciding what to report.
                if error is None or isinstance(result, TemporaryDeliveryError):
                    error = result
            elif isinstance(result, BaseException):
                raise result
            else:
                bucket.extend(result)
        ordered = v6 + v4 if self._prefer_ipv6 else v4 + v6
        unusable = [a for a in ordered if not _usable(a)]
        if unusable:
            # 0.0.0.0 and :: reach this host itself, multicast and broadcast no one
            log.warning("%s: address(es) %s not used", host, ", ".join(unusable))
            ordered = [a for a in ordered if _usable(a)]
        if not ordered and error is None:
            why = f"{host} has no usable address ({', '.join(unusable)})" if unusable else ""
            error = PermanentDeliveryError(
                _reply(R550_MX_HOST_NOT_FOUND, why or f"{host} has no address")
            )
        return ordered, error

    async def lookup_addresses(self, host: str) -> list[str]:
        """The A and AAAA addresses of ``host`` (CNAMEs followed), in preference order.

        Raises:
            PermanentDeliveryError: NXDOMAIN or no address records (``550``).
            TemporaryDeliveryError: SERVFAIL, timeout or CNAME loop with no address found.
        """
        addresses, error = await self._addresses(_ascii_domain(host))
        if not addresses and error is not None:
            raise error
        return addresses

    async def _typed_addresses(self, host: str, rdtype: dns.rdatatype.RdataType) -> list[str]:
        try:
            rrset, _ = await self._query(host, rdtype)
        except _NoData:
            return []
        return [rd.to_text() for rd in rrset]


def _usable(address: str) -> bool:
    """Whether a mail exchanger's address (or an address literal's) can be a remote SMTP
    server: not unspecified (``0.0.0.0``, ``::``, also IPv4-mapped: connecting reaches
    this host), multicast or the limited broadcast address (RFC 5321 §5.1: an MX pointing
    back at the sender is a loop)."""
    ip = unmapped(address)  # ::ffff:0.0.0.0 is 0.0.0.0
    return not (ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255")


def unmapped(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``address`` as an IP address, an IPv4-mapped IPv6 address as the IPv4 address it
    maps (what a connection to it reaches). Pure.

    Raises:
        ValueError: not an IP address.
    """
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def at_own_address(target: MxTarget, own_addresses: Collection[str]) -> bool:
    """Whether ``target`` (not the smarthost) is at one of ``own_addresses`` (normal form,
    as ``worker.own_addresses`` holds them): this queue found among the MXes (RFC 5321
    §5.1). An address that is no IP address is never one. Pure."""
    try:
        return not target.relay and str(unmapped(target.address)) in own_addresses
    except ValueError:
        return False


def without_myself(
    targets: Sequence[MxTarget], own_addresses: Collection[str]
) -> tuple[list[MxTarget], MxTarget | None]:
    """RFC 5321 §5.1: an SMTP client that finds itself among the MX hosts discards that MX
    and every MX of the same or a lower preference (a greater value). The client is
    found by address: a target at one of ``own_addresses`` (``worker.own_addresses``, in
    their normal form). The smarthost is never matched (it may be this host on another
    port), nor a target whose address is not an IP address. Pure.

    Returns:
        the targets left, in order, and the first target found to be this queue (None when
        none was: the targets are returned unchanged).
    """
    if not own_addresses:
        return list(targets), None

    def mine(t: MxTarget) -> bool:
        return at_own_address(t, own_addresses)

    me = next((t for t in targets if mine(t)), None)
    if me is None:
        return list(targets), None
    if me.preference is None:  # an implicit MX or a literal: this host is the only MX
        return [t for t in targets if t.relay], me
    best = min(t.preference for t in targets if mine(t) and t.preference is not None)
    left = [t for t in targets if t.preference is not None and t.preference < best]
    return left, me


class StaticResolver:
    """Always returns the same targets, whatever the domain (tests, fixed routes).

    Args:
        targets: returned as given (copied) by every :meth:`resolve`.
    """

    def __init__(self, targets: Sequence[MxTarget]) -> None:
        if not targets:
            raise ValueError("StaticResolver needs at least one target")
        self._targets = list(targets)

    async def resolve(self, domain: str) -> list[MxTarget]:
        """The configured targets; never raises."""
        return list(self._targets)


class SmarthostResolver:
    """Sends all mail through one relay host (``worker.smarthost``), no MX lookup.

    The relay host may be an IP address, an address literal or a host name; a name is
    resolved (A/AAAA) with ``dns`` when given, else with the system resolver
    (``getaddrinfo``), bounded by ``timeout_s``. Targets carry ``relay=True`` and the relay's
    port, so the client may authenticate to them (and only to them).

    Args:
        smarthost: host, port and optional credentials of the relay.
        dns: resolver used for the relay's name; None = system resolver.
        timeout_s: bound on the name lookup, seconds.
        max_addresses: at most this many addresses are returned.
    """

    def __init__(
        self,
        smarthost: SmarthostSettings,
        *,
        dns: DnsResolver | None = None,
        timeout_s: float = 5.0,
        max_addresses: int = 5,
    ) -> None:
        self._smarthost = smarthost
        self._dns = dns
        self._timeout_s = timeout_s
        self._max = max_addresses

    async def resolve(self, domain: str) -> list[MxTarget]:
        """The relay's addresses, whatever ``domain`` is.

        Raises:
            TemporaryDeliveryError: the relay's name could not be resolved (``451 4.4.3
                Temporary DNS failure looking up the smarthost: <name> ...``, RFC 3463 §3.5);
                a missing relay is a configuration problem, never a reason to bounce.
        """
        host = self._smarthost.host.strip().rstrip(".")
        port = self._smarthost.port
        literal = _literal_address(host) or _literal_address(f"[{host}]")
        if literal is not None:
            return [MxTarget(host=host, address=literal, port=port, relay=True)]
        addresses: list[str] = []
        if self._dns is not None:
            try:
                addresses = await self._dns.lookup_addresses(host.lower())
            except (TemporaryDeliveryError, PermanentDeliveryError) as e:
                detail = e.reply.text.partition(": ")[2] or e.reply.text
                raise TemporaryDeliveryError(_reply(R451_SMARTHOST_DNS, detail)) from e
        else:
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self._timeout_s):
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError) as e:
                raise TemporaryDeliveryError(
                    _reply(R451_SMARTHOST_DNS, f"{host}: {e or 'timed out'}")
                ) from e
            for info in infos:
                address = str(info[4][0])
                if address not in addresses:
                    addresses.append(address)
        if not addresses:
            raise TemporaryDeliveryError(_reply(R451_SMARTHOST_DNS, f"{host}: no address"))
        return [
            MxTarget(host=host, address=a, port=port, relay=True) for a in addresses[: self._max]
        ]


def resolver_from_settings(settings: WorkerSettings) -> Resolver:
    """The resolver the settings ask for: the smarthost when set, else MX lookup in DNS."""
    if settings.smarthost is not None:
        return SmarthostResolver(
            settings.smarthost,
            dns=DnsResolver.from_settings(settings) if settings.nameservers else None,
            timeout_s=settings.dns_timeout_s,
            max_addresses=settings.max_mx_addresses,
        )
    return DnsResolver.from_settings(settings)
