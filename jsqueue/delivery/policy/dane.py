"""DANE for SMTP (RFC 7672): DNSSEC status of the MX RRset and the TLSA RRset at
``_25._tcp.<mx>``, trusted only by the AD bit of a configured validating resolver
(RFC 6840 §5.7; as Postfix's ``smtp_dns_support_level = dnssec``).

Queries carry DO and AD; the answer is ``secure`` when the AD bit is set, ``insecure``
when not, and ``bogus`` when the validator answers SERVFAIL (a bad signature looks like
that; so does an unreachable zone: neither may fall back to plaintext, RFC 7672 §2.1.1).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import StrEnum

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.TLSA
import dns.resolver

from jsqueue.config import OutboundTlsSettings, WorkerSettings
from jsqueue.delivery.policy.certs import Tlsa
from jsqueue.delivery.resolver import AnswerCache, answer_cache

__all__ = ["DnssecResolver", "DnssecState", "TlsaLookup"]


class DnssecState(StrEnum):
    """What a validating resolver said of an answer."""

    SECURE = "secure"  # AD set: validated
    INSECURE = "insecure"  # no AD: unsigned (or not under a trust anchor)
    BOGUS = "bogus"  # SERVFAIL from the validator, or no answer at all


@dataclass(frozen=True)
class TlsaLookup:
    """The TLSA RRset of one MX host.

    Attributes:
        state: DNSSEC state of the answer (NODATA/NXDOMAIN included).
        records: the records (empty when there are none).
        detail: words for the log.
    """

    state: DnssecState
    records: tuple[Tlsa, ...] = ()
    detail: str = ""

    @property
    def usable(self) -> tuple[Tlsa, ...]:
        """Records usable for SMTP (:attr:`Tlsa.usable`)."""
        return tuple(r for r in self.records if r.usable)


def _state(response: dns.message.Message) -> DnssecState:
    """A validator's answer: ``bogus`` unless NOERROR or NXDOMAIN, else its AD bit."""
    if response.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
        return DnssecState.BOGUS
    return DnssecState.SECURE if response.flags & dns.flags.AD else DnssecState.INSECURE


class DnssecResolver:
    """Asks validating resolvers with DO and AD set and reads their AD bit.

    Args:
        nameservers: IP addresses of validating resolvers, asked in order.
        port: their port.
        timeout_s: per query, seconds.
        cache: where validated answers (secure or insecure; NXDOMAIN and NODATA included)
            are kept for their TTL, the SOA's for a negative one (RFC 2308 §5, by
            dnspython's :class:`~dns.resolver.Answer`), at most its ``max_ttl_s``; a
            ``bogus`` one never is. None = none.
    """

    def __init__(
        self,
        nameservers: list[str],
        *,
        port: int = 53,
        timeout_s: float = 5.0,
        cache: AnswerCache | None = None,
    ):
        self._nameservers = list(nameservers)
        self._port = port
        self._timeout_s = timeout_s
        self._cache = cache

    @classmethod
    def from_settings(cls, tls: OutboundTlsSettings, worker: WorkerSettings) -> DnssecResolver:
        """On ``outbound_tls.dnssec_nameservers`` (``worker.nameservers`` when empty) and
        their port, with ``worker.dns_timeout_s`` and :func:`answer_cache`."""
        return cls(
            list(tls.dnssec_nameservers or worker.nameservers),
            port=tls.dnssec_nameserver_port or worker.nameserver_port,
            timeout_s=worker.dns_timeout_s,
            cache=answer_cache(worker),
        )

    async def query(self, name: str, rdtype: str) -> tuple[DnssecState, dns.message.Message | None]:
        """One query (or its answer kept from an earlier one, within its TTL); the answer
        and its state. Never raises: no answer from any resolver is ``bogus`` (the state
        cannot be known, so nothing may be downgraded)."""
        qname = dns.name.from_text(name)
        key = (qname, dns.rdatatype.from_text(rdtype), dns.rdataclass.IN)
        kept = self._cache.get(key) if self._cache is not None else None
        if kept is not None:
            return _state(kept.response), kept.response
        state, response = await self._ask(qname, rdtype)
        if (
            self._cache is not None
            and state is not DnssecState.BOGUS
            and isinstance(response, dns.message.QueryMessage)
        ):
            with contextlib.suppress(dns.exception.DNSException):  # malformed: not kept
                self._cache.put(key, dns.resolver.Answer(*key, response))
        return state, response

    async def _ask(
        self, qname: dns.name.Name, rdtype: str
    ) -> tuple[DnssecState, dns.message.Message | None]:
        for server in self._nameservers:
            query = dns.message.make_query(qname, rdtype, want_dnssec=True)
            query.flags |= dns.flags.AD | dns.flags.RD
            try:
                response, _ = await dns.asyncquery.udp_with_fallback(
                    query, server, timeout=self._timeout_s, port=self._port
                )
            except (dns.exception.DNSException, OSError):
                continue
            return _state(response), response
        return DnssecState.BOGUS, None

    async def state(self, name: str, rdtype: str) -> DnssecState:
        """The DNSSEC state of ``name``/``rdtype`` (the MX RRset, an MX host's A RRset)."""
        state, _ = await self.query(name, rdtype)
        return state

    async def address_state(self, host: str, rdtype: str) -> tuple[DnssecState, str]:
        """The DNSSEC state of ``host``'s address RRset and the name it expands to through
        CNAMEs in the answer (``host`` itself when none; RFC 7672 §2.2.2)."""
        state, response = await self.query(host, rdtype)
        name = dns.name.from_text(host)
        for _ in range(8):
            alias = next(
                (
                    r
                    for r in (response.answer if response is not None else [])
                    if r.rdtype == dns.rdatatype.CNAME and r.name == name
                ),
                None,
            )
            if alias is None:
                break
            name = alias[0].target
        return state, name.to_text(omit_final_dot=True)

    async def tlsa_of(self, host: str, expanded: str) -> tuple[TlsaLookup, str]:
        """RFC 7672 §2.2.2: the TLSA RRset of the CNAME-expanded name when there is one,
        else of the original MX host name; and the name it was found at. Never raises."""
        if expanded != host:
            found = await self.tlsa(expanded)
            if found.state is DnssecState.BOGUS or found.records:
                return found, expanded
        return await self.tlsa(host), host

    async def tlsa(self, mx_host: str, port: int = 25) -> TlsaLookup:
        """The TLSA RRset at ``_<port>._tcp.<mx_host>`` (RFC 7672 §2.2: port 25 whatever
        port is dialled) and its state. Never raises."""
        name = f"_{port}._tcp.{mx_host.rstrip('.')}"
        state, response = await self.query(name, "TLSA")
        if state is DnssecState.BOGUS or response is None:
            return TlsaLookup(DnssecState.BOGUS, detail=f"{name} TLSA: validation failed")
        records: list[Tlsa] = []
        for rrset in response.answer:
            if rrset.rdtype != dns.rdatatype.TLSA:
                continue
            for rr in rrset:
                assert isinstance(rr, dns.rdtypes.ANY.TLSA.TLSA)
                records.append(Tlsa(rr.usage, rr.selector, rr.mtype, bytes(rr.cert)))
        return TlsaLookup(state, tuple(records), f"{name}: {len(records)} TLSA, {state.value}")
