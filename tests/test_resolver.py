"""MX resolution against a real authoritative DNS server on loopback (RFC 5321 §5.1, RFC 7505).

Zones come from the cases' ``dns.txt`` files; the resolver never touches the system resolver.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from jsqueue.config import OutboundTlsSettings, SmarthostSettings, WorkerSettings
from jsqueue.delivery import (
    BodySource,
    DeliveryEnvelope,
    DnsResolver,
    MxTarget,
    SmarthostResolver,
    StaticResolver,
    deliver_domain,
    resolver_from_settings,
)
from jsqueue.delivery.policy.dane import DnssecResolver, DnssecState
from jsqueue.delivery.resolver import AnswerCache
from jsqueue.envelope import Recipient
from jsqueue.errors import PermanentDeliveryError, TemporaryDeliveryError
from support.cases import CASES
from support.dns import DnsServer
from support.mx import SmtpdMx, ipv6_loopback_available, shared_port, trap
from support.queue import eventually

DNS_TIMEOUT_S = 0.5


def case_zone(*cases: str) -> str:
    return "\n".join((CASES / case / "dns.txt").read_text() for case in cases)


@pytest.fixture(params=[True, False], ids=["server-chases-cname", "client-chases-cname"])
def dns(request: pytest.FixtureRequest) -> Iterator[DnsServer]:
    zone = case_zone("CASE-09", "CASE-11", "CASE-12", "CASE-23")
    with DnsServer(zone, chase_cnames=request.param) as server:
        yield server


def resolver_for(dns: DnsServer, **kwargs: object) -> DnsResolver:
    return DnsResolver(dns.nameservers, port=dns.port, timeout_s=DNS_TIMEOUT_S, **kwargs)  # type: ignore[arg-type]


async def test_null_mx_is_permanent_without_address_lookup(dns: DnsServer) -> None:
    """CASE-09 / RFC 7505 §3: a single ``MX 0 .`` fails permanently with 5.1.10 and the
    domain's A record (a trap) is not even looked up."""
    with pytest.raises(PermanentDeliveryError) as err:
        await resolver_for(dns).resolve("nomail.example.test")
    assert err.value.reply.code == 550
    assert err.value.reply.enhanced == "5.1.10"
    assert "null MX" in err.value.reply.text
    assert ("nomail.example.test", "A") not in dns.queried


async def test_null_mx_delivery_never_connects(dns: DnsServer) -> None:
    """CASE-09 expected 1-2: no TCP connection to the trap at 127.0.2.55; every recipient
    gets the permanent 5.1.10 reply on the first attempt."""
    port = shared_port(["127.0.2.55"])
    settings = WorkerSettings(mx_port=port, nameservers=dns.nameservers, nameserver_port=dns.port)
    envelope = DeliveryEnvelope(
        domain="nomail.example.test",
        reverse_path="alice@example.test",
        recipients=(Recipient.from_address("nobody@nomail.example.test"),),
    )
    async with trap("127.0.2.55", port) as t:
        result = await deliver_domain(
            resolver_from_settings(settings), envelope, BodySource.from_bytes(b"x\r\n"), settings
        )
    assert t.connections == 0
    assert result.replies["nobody@nomail.example.test"].enhanced == "5.1.10"
    assert result.mx_host is None


async def test_cname_at_domain_uses_target_mx(dns: DnsServer) -> None:
    """CASE-11 variant A (RFC 5321 §5.1): alias.example.test CNAME real.example.test; the
    MX of the target is used (127.0.2.30), never real's own A record (trap 127.0.2.31)."""
    targets = await resolver_for(dns).resolve("alias.example.test")
    assert [t.address for t in targets] == ["127.0.2.30"]
    assert targets[0].host == "mx.real.example.test"


async def test_cname_at_mx_host_is_followed(dns: DnsServer) -> None:
    """CASE-11 variant B: the MX host name is an alias; its target's address is used."""
    targets = await resolver_for(dns).resolve("cn.example.test")
    assert [(t.host, t.address) for t in targets] == [("mail.cn.example.test", "127.0.2.40")]


async def test_cname_loop_fails_temporarily_and_fast(dns: DnsServer) -> None:
    """CASE-11 variant C: a CNAME loop is detected: temporary 4.4.3, well within the DNS
    timeout, no unbounded recursion."""
    started = time.monotonic()
    with pytest.raises(TemporaryDeliveryError) as err:
        await resolver_for(dns).resolve("loop.example.test")
    assert time.monotonic() - started < DNS_TIMEOUT_S
    assert err.value.reply.enhanced == "4.4.3"
    assert "CNAME loop" in err.value.reply.text


async def test_servfail_is_temporary(dns: DnsServer) -> None:
    """CASE-12 expected 1: SERVFAIL -> temporary 4.4.3; the domain's A record (a trap) is not
    used as an implicit MX."""
    with pytest.raises(TemporaryDeliveryError) as err:
        await resolver_for(dns).resolve("servfail.example.test")
    assert err.value.reply.code == 451 and err.value.reply.enhanced == "4.4.3"
    assert ("servfail.example.test", "A") not in dns.queried


async def test_nxdomain_is_permanent(dns: DnsServer) -> None:
    """CASE-12 expected 3: NXDOMAIN -> permanent 5.1.2 on the first attempt."""
    with pytest.raises(PermanentDeliveryError) as err:
        await resolver_for(dns).resolve("nx.example.test")
    assert err.value.reply.code == 550 and err.value.reply.enhanced == "5.1.2"


async def test_no_mx_uses_implicit_mx(dns: DnsServer) -> None:
    """CASE-12 expected 4 (RFC 5321 §5.1): NOERROR/NODATA for MX -> the domain's A record."""
    targets = await resolver_for(dns).resolve("nomx.example.test")
    assert targets == [MxTarget(host="nomx.example.test", address="127.0.2.50")]


async def test_timeout_is_temporary_bounded_and_does_not_block_others(dns: DnsServer) -> None:
    """CASE-12 expected 2: a dropped query fails temporarily within the DNS timeout, and
    other lookups running at the same time finish promptly."""
    resolver = resolver_for(dns)
    started = time.monotonic()
    slow = asyncio.create_task(resolver.resolve("slow.example.test"))
    fast = await resolver.resolve("nomx.example.test")
    fast_elapsed = time.monotonic() - started
    with pytest.raises(TemporaryDeliveryError) as err:
        await slow
    slow_elapsed = time.monotonic() - started
    assert fast[0].address == "127.0.2.50"
    assert fast_elapsed < DNS_TIMEOUT_S / 2
    assert DNS_TIMEOUT_S * 0.8 <= slow_elapsed < DNS_TIMEOUT_S + 1.5
    assert err.value.reply.enhanced == "4.4.3" and "timed out" in err.value.reply.text


async def test_aaaa_only_domain_resolves_to_ipv6(dns: DnsServer) -> None:
    """CASE-12 expected 5: no MX, no A, AAAA ::1 -> implicit MX at [::1]."""
    targets = await resolver_for(dns).resolve("v6only.example.test")
    assert [t.address for t in targets] == ["::1"]


async def test_aaaa_only_domain_delivers_over_ipv6_or_defers() -> None:
    """CASE-12 expected 5: delivered to [::1] when IPv6 loopback works, otherwise a
    temporary failure, never a permanent one."""
    zone = case_zone("CASE-12")
    with DnsServer(zone) as dns:
        port = shared_port(["::1"]) if ipv6_loopback_available() else shared_port(["127.0.0.1"])
        settings = WorkerSettings(
            mx_port=port, nameservers=dns.nameservers, nameserver_port=dns.port
        )
        envelope = DeliveryEnvelope(
            domain="v6only.example.test",
            reverse_path="alice@example.test",
            recipients=(Recipient.from_address("user@v6only.example.test"),),
        )
        body = BodySource.from_bytes((CASES / "CASE-12" / "message.eml").read_bytes())
        if ipv6_loopback_available():
            async with SmtpdMx("::1", port) as mx:
                result = await deliver_domain(
                    resolver_from_settings(settings), envelope, body, settings
                )
            assert result.replies["user@v6only.example.test"].is_success
            assert mx.delivered[0].rcpt_to == ["user@v6only.example.test"]
        else:
            result = await deliver_domain(
                resolver_from_settings(settings), envelope, body, settings
            )
            assert result.replies["user@v6only.example.test"].is_temporary


async def test_idn_domain_is_looked_up_as_a_label(dns: DnsServer) -> None:
    """CASE-23 variant A (RFC 6531 §3.2, RFC 5890): the U-label domain's MX is looked up
    under its A-label."""
    targets = await resolver_for(dns).resolve("bücher.example.test")
    assert targets[0].address == "127.0.2.190"
    assert ("xn--bcher-kva.example.test", "MX") in dns.queried


async def test_address_literals_bypass_dns(dns: DnsServer) -> None:
    """RFC 5321 §4.1.3: address literals are used as they are, without any DNS query."""
    resolver = resolver_for(dns)
    assert await resolver.resolve("[127.0.2.9]") == [
        MxTarget(host="[127.0.2.9]", address="127.0.2.9")
    ]
    assert (await resolver.resolve("[IPv6:::1]"))[0].address == "::1"
    assert dns.queries == []


async def test_preference_order_and_shuffle_of_equal_preferences() -> None:
    """RFC 5321 §5.1: lower preference first; equal preferences in random order."""
    zone = """
        multi.example.test. 300 IN MX 20 c.example.test.
        multi.example.test. 300 IN MX 10 a.example.test.
        multi.example.test. 300 IN MX 10 b.example.test.
        a.example.test. 300 IN A 127.0.2.1
        b.example.test. 300 IN A 127.0.2.2
        c.example.test. 300 IN A 127.0.2.3
        c.example.test. 300 IN AAAA ::1
    """
    with DnsServer(zone) as dns:
        orders = set()
        for seed in range(12):
            targets = await resolver_for(dns, rng=random.Random(seed)).resolve("multi.example.test")
            assert [t.preference for t in targets] == [10, 10, 20, 20]
            assert [t.address for t in targets[2:]] == ["127.0.2.3", "::1"]
            orders.add(tuple(t.host for t in targets[:2]))
        assert orders == {
            ("a.example.test", "b.example.test"),
            ("b.example.test", "a.example.test"),
        }
        capped = await resolver_for(dns, max_addresses=3).resolve("multi.example.test")
        assert len(capped) == 3


async def test_mx_hosts_without_address() -> None:
    """RFC 5321 §5.1: MX hosts that do not exist -> permanent 5.4.4; one whose lookup fails
    temporarily -> temporary; a working host among broken ones is used."""
    zone = """
        gone.example.test.   300 IN MX 10 nohost.example.test.
        flaky.example.test.  300 IN MX 10 broken.example.test.
        broken.example.test. A SERVFAIL
        broken.example.test. 300 IN MX 10 other.example.test.
        mixed.example.test.  300 IN MX 10 nohost.example.test.
        mixed.example.test.  300 IN MX 20 ok.example.test.
        ok.example.test.     300 IN A 127.0.2.7
    """
    with DnsServer(zone) as dns:
        resolver = resolver_for(dns)
        with pytest.raises(PermanentDeliveryError) as perm:
            await resolver.resolve("gone.example.test")
        assert perm.value.reply.enhanced == "5.4.4"
        with pytest.raises(TemporaryDeliveryError):
            await resolver.resolve("flaky.example.test")
        assert [t.address for t in await resolver.resolve("mixed.example.test")] == ["127.0.2.7"]


IP_MX_ZONE = """
    ipmx.example.test.   300 IN MX 10 127.0.6.90.
    ipmx.example.test.   300 IN MX 20 backup.example.test.
    backup.example.test. 300 IN A 127.0.2.7
    onlyip.example.test. 300 IN MX 10 127.0.6.91.
    zeromx.example.test. 300 IN MX 10 0.0.0.0.
"""


async def test_an_mx_host_written_as_an_address_is_not_used_by_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RFC 1035 §3.3.9 and RFC 5321 §5.1: the exchange of an MX record is a host name;
    ``MX 10 192.0.2.1.`` is unusable (Postfix refuses it: "numeric domain name in resource
    data of MX record"). The next MX is tried; with none left the recipient fails with
    ``550 5.4.4`` naming the record, never looked up as a name nor connected to."""
    with DnsServer(IP_MX_ZONE) as dns:
        resolver = resolver_for(dns)
        targets = await resolver.resolve("ipmx.example.test")
        assert [(t.host, t.address) for t in targets] == [("backup.example.test", "127.0.2.7")]
        assert "MX host 127.0.6.90 is an IP address, not a host name" in caplog.text
        with pytest.raises(PermanentDeliveryError) as perm:
            await resolver.resolve("onlyip.example.test")
        assert perm.value.reply.code == 550 and perm.value.reply.enhanced == "5.4.4"
        assert "no usable MX host of onlyip.example.test" in perm.value.reply.text
        assert "MX host 127.0.6.91 is an IP address" in perm.value.reply.text
        assert not {("127.0.6.90", "A"), ("127.0.6.91", "A")} & set(dns.queried)


async def test_an_mx_host_written_as_an_address_is_that_address_when_opted_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``worker.mx_address_targets`` (off by default, as Haraka's ``allow_mx_ip``): such a
    record is used as the address it is (with a warning), in its preference order, and an
    unusable one (``0.0.0.0``) is still not."""
    assert WorkerSettings().mx_address_targets is False
    with DnsServer(IP_MX_ZONE) as dns:
        resolver = resolver_for(dns, mx_address_targets=True)
        targets = await resolver.resolve("ipmx.example.test")
        assert [(t.host, t.address) for t in targets] == [
            ("127.0.6.90", "127.0.6.90"),
            ("backup.example.test", "127.0.2.7"),
        ]
        assert ("127.0.6.90", "A") not in dns.queried
        assert "MX host of ipmx.example.test is the address 127.0.6.90" in caplog.text
        with pytest.raises(PermanentDeliveryError) as perm:
            await resolver.resolve("zeromx.example.test")
        assert perm.value.reply.enhanced == "5.4.4"
        assert "MX host 0.0.0.0 is no remote address" in perm.value.reply.text


async def test_mx_addresses_that_reach_no_remote_server_are_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RFC 5321 §5.1: an MX at ``0.0.0.0`` or ``::`` (connecting there reaches this host
    itself: a loop), a multicast or the broadcast address is no mail exchanger. A host
    with only such addresses (IPv4-mapped ones too), or an address literal of one, has no
    usable address (``5.4.4``); beside
    a usable one, only the usable one is tried."""
    zone = """
        sink.example.test.   300 IN MX 10 zero.example.test.
        zero.example.test.   300 IN A 0.0.0.0
        zero.example.test.   300 IN AAAA ::
        odd.example.test.    300 IN MX 10 many.example.test.
        many.example.test.   300 IN A 224.0.0.1
        many.example.test.   300 IN A 255.255.255.255
        many.example.test.   300 IN A 127.0.2.7
        mapped.example.test. 300 IN MX 10 v6.example.test.
        v6.example.test.     300 IN AAAA ::ffff:0.0.0.0
    """
    with DnsServer(zone) as dns:
        resolver = resolver_for(dns)
        with pytest.raises(PermanentDeliveryError) as perm:
            await resolver.resolve("sink.example.test")
        assert perm.value.reply.enhanced == "5.4.4"
        assert "zero.example.test has no usable address (0.0.0.0, ::)" in caplog.text
        assert [t.address for t in await resolver.resolve("odd.example.test")] == ["127.0.2.7"]
        for unusable in ("mapped.example.test", "[0.0.0.0]", "[IPv6:::]", "[IPv6:::ffff:0.0.0.0]"):
            with pytest.raises(PermanentDeliveryError) as perm:
                await resolver.resolve(unusable)
            assert perm.value.reply.enhanced == "5.4.4", unusable


async def test_smarthost_and_static_resolvers(dns: DnsServer) -> None:
    """Smarthost mode: every domain goes to the relay, with its port and relay=True (the only
    targets that may get AUTH credentials); names resolved through the configured DNS."""
    literal = SmarthostResolver(SmarthostSettings(host="127.0.2.99", port=2525))
    assert await literal.resolve("anything.test") == [
        MxTarget(host="127.0.2.99", address="127.0.2.99", port=2525, relay=True)
    ]
    dns.add("relay.example.test. 300 IN A 127.0.2.98")
    settings = WorkerSettings(
        nameservers=dns.nameservers,
        nameserver_port=dns.port,
        smarthost=SmarthostSettings(host="relay.example.test", port=587),
    )
    named = await resolver_from_settings(settings).resolve("dest.example.test")
    assert named == [
        MxTarget(host="relay.example.test", address="127.0.2.98", port=587, relay=True)
    ]
    missing = SmarthostResolver(SmarthostSettings(host="nx.example.test"), dns=resolver_for(dns))
    with pytest.raises(TemporaryDeliveryError) as failed:
        await missing.resolve("dest.example.test")
    # RFC 3463 §3.5: deferred (never bounced), and the reply blames the relay's name, not
    # the recipient domain's DNS.
    reply = failed.value.reply
    assert (reply.code, reply.enhanced) == (451, "4.4.3")
    assert reply.text.startswith("Temporary DNS failure looking up the smarthost: nx.example.test")
    assert "recipient domain" not in reply.text
    fixed = [MxTarget(host="h", address="127.0.2.1")]
    assert await StaticResolver(fixed).resolve("x.test") == fixed


# --------------------------------------------------------------------------- answer cache

CACHE_ZONE = """
kept.example.test.     300 IN MX 10 mx.kept.example.test.
mx.kept.example.test.  300 IN A  127.0.2.101
fresh.example.test.    0   IN MX 10 mx.fresh.example.test.
mx.fresh.example.test. 0   IN A  127.0.2.102
failing.example.test.  MX   SERVFAIL
gone.example.test.     NXDOMAIN
silent.example.test.   MX   TIMEOUT
"""


def asked(dns: DnsServer, name: str, rdtype: str) -> int:
    """How often the server was asked ``name``/``rdtype``."""
    return sum(1 for n, t, _ in list(dns.queries) if (n, t) == (name, rdtype))


async def test_answers_are_kept_for_their_ttl_and_a_ttl_of_0_is_asked_every_time() -> None:
    """RFC 1035 §3.2.1, §4.1.3: an answer may be reused for its TTL; one with TTL 0 may
    not. With ``dns_cache_size`` a second delivery to a domain asks nothing again."""
    with DnsServer(CACHE_ZONE) as dns:
        resolver = resolver_for(dns, cache=AnswerCache(100, 300.0))
        for _ in range(3):
            assert [t.address for t in await resolver.resolve("kept.example.test")] == [
                "127.0.2.101"
            ]
            assert [t.address for t in await resolver.resolve("fresh.example.test")] == [
                "127.0.2.102"
            ]
        assert asked(dns, "kept.example.test", "MX") == 1
        assert asked(dns, "mx.kept.example.test", "A") == 1
        assert asked(dns, "mx.kept.example.test", "AAAA") == 1  # NODATA, kept too
        assert asked(dns, "fresh.example.test", "MX") == 3
        assert asked(dns, "mx.fresh.example.test", "A") == 3


async def test_nxdomain_is_kept_and_a_server_failure_is_asked_again() -> None:
    """RFC 2308 §5: NXDOMAIN is kept (for the SOA's negative TTL; dnspython's default
    when the server sends none). A server failure or a query with no answer (CASE-12
    expected 1 and 2) is not kept (RFC 2308 §7 allows up to 5 minutes; jsqueue keeps
    none), so a deferred delivery asks again at its retry."""
    with DnsServer(CACHE_ZONE) as dns:
        resolver = resolver_for(dns, cache=AnswerCache(100, 300.0))
        for _ in range(2):
            with pytest.raises(PermanentDeliveryError) as gone:
                await resolver.resolve("gone.example.test")
            assert gone.value.reply.enhanced == "5.1.2"
            with pytest.raises(TemporaryDeliveryError) as failing:
                await resolver.resolve("failing.example.test")
            assert failing.value.reply.enhanced == "4.4.3"
            with pytest.raises(TemporaryDeliveryError) as silent:
                await resolver.resolve("silent.example.test")
            assert silent.value.reply.enhanced == "4.4.3"
        assert asked(dns, "gone.example.test", "MX") == 1
        assert asked(dns, "failing.example.test", "MX") == 2
        assert asked(dns, "silent.example.test", "MX") == 2


async def test_without_a_cache_every_delivery_asks() -> None:
    """``worker.dns_cache_size = 0``: nothing is kept (the default is 10 000 answers)."""
    assert WorkerSettings().dns_cache_size == 10_000
    with DnsServer(CACHE_ZONE) as dns:
        settings = WorkerSettings(
            nameservers=dns.nameservers, nameserver_port=dns.port, dns_cache_size=0
        )
        resolver = DnsResolver.from_settings(settings)
        for _ in range(2):
            await resolver.resolve("kept.example.test")
        assert asked(dns, "kept.example.test", "MX") == 2
        cached = DnsResolver.from_settings(settings.model_copy(update={"dns_cache_size": 10}))
        for _ in range(2):
            await cached.resolve("kept.example.test")
        assert asked(dns, "kept.example.test", "MX") == 3


async def test_an_answer_is_kept_at_most_dns_cache_max_ttl_s_whatever_its_ttl() -> None:
    """``worker.dns_cache_max_ttl_s`` (300 s by default): an answer published with a long
    TTL (here 300 s) is asked again once the cap has passed, so a record changed or
    flushed at the resolver is seen within it; within the cap it is not asked again.
    The same holds for DANE's validating queries."""
    assert WorkerSettings().dns_cache_max_ttl_s == 300.0
    with DnsServer(CACHE_ZONE) as dns:
        settings = WorkerSettings(
            nameservers=dns.nameservers, nameserver_port=dns.port, dns_cache_max_ttl_s=0.5
        )
        resolver = DnsResolver.from_settings(settings)
        validator = DnssecResolver.from_settings(OutboundTlsSettings(), settings)

        async def asked_again() -> bool:
            await resolver.resolve("kept.example.test")
            await validator.state("kept.example.test", "MX")
            return asked(dns, "kept.example.test", "MX") >= 4

        for _ in range(2):
            await resolver.resolve("kept.example.test")
            await validator.state("kept.example.test", "MX")
        assert asked(dns, "kept.example.test", "MX") == 2  # one each, kept
        await eventually(asked_again, 5, what="asked again after the cap")


async def test_dnssec_answers_are_kept_but_never_a_bogus_one() -> None:
    """DANE's validating queries (RFC 7672 §2.1.1): a secure or insecure answer is kept
    for its TTL; ``bogus`` (SERVFAIL from the validator) is asked again every time, so
    a validator that recovers is believed at once."""
    with DnsServer(CACHE_ZONE) as dns:
        validator = DnssecResolver(
            dns.nameservers, port=dns.port, timeout_s=0.5, cache=AnswerCache(10, 300.0)
        )
        for _ in range(3):
            assert await validator.state("kept.example.test", "MX") is DnssecState.INSECURE
            assert await validator.state("failing.example.test", "MX") is DnssecState.BOGUS
            lookup = await validator.tlsa("mx.kept.example.test")
            assert lookup.state is DnssecState.INSECURE and not lookup.records
        assert asked(dns, "kept.example.test", "MX") == 1
        assert asked(dns, "_25._tcp.mx.kept.example.test", "TLSA") == 1
        assert asked(dns, "failing.example.test", "MX") == 3
