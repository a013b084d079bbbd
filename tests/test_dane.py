"""DANE for SMTP (RFC 7672) end to end against Debian's validating resolver: a zone signed
in the test (dnspython, keys made here) on our authoritative test server, unbound on a
loopback port with that zone's key as trust anchor, scripted MXes with trustme
certificates. Matching TLSA -> delivered over TLS; mismatching -> deferred 4.7.5 with no
MAIL; bogus signature -> deferred, the MX never contacted; unsigned zone -> opportunistic.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import ssl
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from jsqueue.admin import Admin
from jsqueue.cli.render import render_detail
from jsqueue.config import OutboundTlsSettings, TlsReportSettings, WorkerSettings
from jsqueue.delivery import BodySource, DeliveryEnvelope
from jsqueue.delivery.client import deliver_domain
from jsqueue.delivery.policy.certs import Tlsa, dane_verdict
from jsqueue.delivery.policy.decision import PolicyEngine
from jsqueue.delivery.policy.reporting import TlsReporter
from jsqueue.delivery.resolver import DnsResolver
from jsqueue.envelope import Recipient
from jsqueue.events import Event
from support.dnssec import SignedDnsServer, Unbound, break_signature, make_zone, sign
from support.mx import ScriptedMx, shared_port
from support.queue import Harness, eventually

# in the range the queue harness binds its MXes in (tests/support/queue.py, MX_HOSTS)
HOSTS = {"ok": "127.0.2.31", "bad": "127.0.2.32", "bogus": "127.0.2.33", "ta": "127.0.2.34"}
PLAIN = "127.0.2.35"
RECEIVER = "127.0.2.36"
ALIAS = "127.0.2.37"  # HTTPS receiver of TLS reports (reports.plain.test)
BOGUS_DNS = "127.0.2.38"  # the MX of bogusmx.dane.test and bogusaddr.dane.test
MESSAGE = b"From: a@example.test\r\nTo: b@dane.test\r\nSubject: dane\r\n\r\nbody\r\n"


def spki_sha256(pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(pem)
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()


class World:
    """The CA, one certificate per MX, the signed and the unsigned zone, unbound."""

    def __init__(self, tmp: Path) -> None:
        self.ca = trustme.CA()
        self.other = trustme.CA()
        self.tmp = tmp
        self.leaf = {
            k: self.ca.issue_cert(f"mx.{k}.dane.test", not_after=datetime.now() + timedelta(1))
            for k in HOSTS
        }
        self.plain_leaf = self.other.issue_cert("mx.ok.plain.test")
        ca_der = x509.load_pem_x509_certificate(self.ca.cert_pem.bytes()).public_bytes(Encoding.DER)
        wrong = spki_sha256(self.other.issue_cert("x.dane.test").cert_chain_pems[0].bytes())
        records = ""
        for k, address in HOSTS.items():
            records += f"{k} 300 IN MX 10 mx.{k}\nmx.{k} 300 IN A {address}\n"
        ok = spki_sha256(self.leaf["ok"].cert_chain_pems[0].bytes())
        records += f"_25._tcp.mx.ok 300 IN TLSA 3 1 1 {ok}\n"
        # a PKIX-EE record is unusable for SMTP (RFC 7672 §3.1.3) and must be ignored
        records += f"_25._tcp.mx.ok 300 IN TLSA 1 1 1 {wrong}\n"
        records += f"_25._tcp.mx.bad 300 IN TLSA 3 1 1 {wrong}\n"
        records += f"_25._tcp.mx.bogus 300 IN TLSA 3 1 1 {ok}\n"
        records += f"_25._tcp.mx.ta 300 IN TLSA 2 0 1 {hashlib.sha256(ca_der).hexdigest()}\n"
        records += '_smtp._tls.ok 300 IN TXT "v=TLSRPTv1; rua=https://reports.plain.test/r"\n'
        # RFC 7672 §2.2.2: an MX host name that is a CNAME; TLSA at the expanded name
        self.leaf["alias"] = self.ca.issue_cert("real.alias.dane.test")
        alias_spki = spki_sha256(self.leaf["alias"].cert_chain_pems[0].bytes())
        records += "alias 300 IN MX 10 mx.alias\nmx.alias 300 IN CNAME real.alias\n"
        records += f"real.alias 300 IN A {ALIAS}\n"
        records += f"_25._tcp.real.alias 300 IN TLSA 3 1 1 {alias_spki}\n"
        # RFC 7672 §2.1.1: a bogus MX RRset, a bogus address RRset of an MX host
        for k in ("bogusmx", "bogusaddr"):
            records += f"{k} 300 IN MX 10 mx.{k}\nmx.{k} 300 IN A {BOGUS_DNS}\n"
        self.signed = make_zone("dane.test.", records)
        self.anchor = sign(self.signed)
        break_signature(self.signed, "_25._tcp.mx.bogus.dane.test.", "TLSA")
        break_signature(self.signed, "bogusmx.dane.test.", "MX")
        break_signature(self.signed, "mx.bogusaddr.dane.test.", "A")
        self.plain = make_zone(
            "plain.test.",
            f"ok 300 IN MX 10 mx.ok\nmx.ok 300 IN A {PLAIN}\nreports 300 IN A {RECEIVER}\n",
        )

    def context(self, key: str) -> ssl.SSLContext:
        """Server context for ``mx.<key>.dane.test``; DANE-TA's chain includes the CA."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        leaf = self.plain_leaf if key == "plain" else self.leaf[key]
        path = self.tmp / f"{key}.pem"
        chain = leaf.private_key_and_cert_chain_pem.bytes()
        if key == "ta":
            chain += self.ca.cert_pem.bytes()
        path.write_bytes(chain)
        ctx.load_cert_chain(str(path))
        return ctx


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[World, Unbound]]:
    w = World(tmp_path_factory.mktemp("dane"))
    server = SignedDnsServer([w.signed, w.plain]).start()
    try:
        with Unbound(server, [w.anchor], ["dane.test", "plain.test"]) as unbound:
            yield w, unbound
    finally:
        server.stop()


def settings(unbound: Unbound, port: int) -> WorkerSettings:
    return WorkerSettings(
        nameservers=[unbound.host],
        nameserver_port=unbound.port,
        mx_port=port,
        ehlo_name="worker.example.test",
        connect_timeout_s=5,
        greeting_timeout_s=5,
        mail_timeout_s=5,
        rcpt_timeout_s=5,
        data_init_timeout_s=5,
        data_final_timeout_s=5,
    )


async def attempt(unbound: Unbound, port: int, rcpt: str):  # type: ignore[no-untyped-def]
    ws = settings(unbound, port)
    engine = PolicyEngine(OutboundTlsSettings(dane=True, mta_sts=False), ws)
    r = Recipient.from_address(rcpt)
    envelope = DeliveryEnvelope(domain=r.domain, reverse_path="a@example.test", recipients=(r,))
    return await deliver_domain(
        DnsResolver.from_settings(ws), envelope, BodySource.from_bytes(MESSAGE), ws, None, engine
    )


def verbs(mx: ScriptedMx) -> list[str]:
    return [c.split(" ", 1)[0].upper() for c in mx.commands]


@pytest.mark.parametrize("key", ["ok", "ta"])
async def test_matching_tlsa_delivers_over_tls(world: tuple[World, Unbound], key: str) -> None:
    """RFC 7672 §3.1: DANE-EE 3 1 1 (SPKI SHA-256 of the leaf) and DANE-TA 2 0 1 (the CA
    certificate, sent in the chain; name and dates checked) authenticate the MX; the
    unusable PKIX-EE record beside the first is ignored."""
    w, unbound = world
    port = shared_port(list(HOSTS.values()))
    rcpt = f"user@{key}.dane.test"
    async with ScriptedMx(HOSTS[key], port, name=f"mx.{key}.dane.test", tls=w.context(key)) as mx:
        result = await attempt(unbound, port, rcpt)
    assert result.delivered == [rcpt], result.replies
    assert result.tls and mx.delivered[0].tls
    note = result.replies[rcpt].tls
    assert note is not None and note.policy == "dane" and note.result == "success"
    assert ("DANE-EE" if key == "ok" else "DANE-TA") in note.detail


async def test_mismatching_tlsa_defers_without_mail(world: tuple[World, Unbound]) -> None:
    """RFC 7672 §2.2: a usable TLSA set makes authenticated TLS mandatory: no match ->
    4.7.5, the session ends after the handshake, no MAIL in plaintext or TLS."""
    w, unbound = world
    port = shared_port(list(HOSTS.values()))
    rcpt = "user@bad.dane.test"
    async with ScriptedMx(HOSTS["bad"], port, name="mx.bad.dane.test", tls=w.context("bad")) as mx:
        result = await attempt(unbound, port, rcpt)
    reply = result.replies[rcpt]
    assert reply.is_temporary and reply.enhanced == "4.7.5", reply
    assert reply.tls is not None and reply.tls.policy == "dane"
    assert reply.tls.result == "validation-failure"
    assert "STARTTLS" in verbs(mx) and "MAIL" not in verbs(mx)
    assert mx.connections == 1  # no plaintext retry


async def test_mismatching_tlsa_without_starttls_is_never_plaintext(
    world: tuple[World, Unbound],
) -> None:
    """A DANE MX that does not offer STARTTLS (a stripping attacker) is deferred."""
    _, unbound = world
    port = shared_port(list(HOSTS.values()))
    rcpt = "user@ok.dane.test"
    async with ScriptedMx(HOSTS["ok"], port, name="mx.ok.dane.test") as mx:
        result = await attempt(unbound, port, rcpt)
    reply = result.replies[rcpt]
    assert reply.enhanced == "4.7.5" and reply.tls is not None
    assert reply.tls.result == "starttls-not-supported"
    assert "MAIL" not in verbs(mx)


async def test_bogus_tlsa_defers_and_never_connects(world: tuple[World, Unbound]) -> None:
    """RFC 7672 §2.1.1: a TLSA answer the validator finds bogus (SERVFAIL) defers the MX;
    nothing is sent, in plaintext or otherwise."""
    w, unbound = world
    port = shared_port(list(HOSTS.values()))
    rcpt = "user@bogus.dane.test"
    async with ScriptedMx(
        HOSTS["bogus"], port, name="mx.bogus.dane.test", tls=w.context("bogus")
    ) as mx:
        result = await attempt(unbound, port, rcpt)
    reply = result.replies[rcpt]
    assert reply.is_temporary and reply.enhanced == "4.7.5", reply
    assert reply.tls is not None and reply.tls.result == "dnssec-invalid"
    assert mx.connections == 0
    assert "validation failure" in unbound.log


@pytest.mark.parametrize("key", ["bogusmx", "bogusaddr"])
async def test_bogus_mx_or_address_defers_through_a_plain_resolver(
    world: tuple[World, Unbound], key: str
) -> None:
    """RFC 7672 §2.1.1: a bogus MX RRset (or a bogus address RRset of the MX host) delays
    delivery; DANE is not dropped for opportunistic TLS. The MX hosts come from a
    non-validating nameserver (``worker.nameservers`` = the authoritative server, the
    validator only in ``outbound_tls.dnssec_nameservers``), which answers without error:
    the MX is never contacted."""
    w, unbound = world
    port = shared_port([BOGUS_DNS])
    plain = unbound.upstream
    ws = settings(unbound, port).model_copy(
        update={"nameservers": plain.nameservers, "nameserver_port": plain.port}
    )
    tls = OutboundTlsSettings(
        dane=True,
        mta_sts=False,
        dnssec_nameservers=[unbound.host],
        dnssec_nameserver_port=unbound.port,
    )
    engine = PolicyEngine(tls, ws)
    rcpt = f"user@{key}.dane.test"
    r = Recipient.from_address(rcpt)
    envelope = DeliveryEnvelope(domain=r.domain, reverse_path="a@example.test", recipients=(r,))
    async with ScriptedMx(BOGUS_DNS, port, name=f"mx.{key}.dane.test", tls=w.context("ok")) as mx:
        result = await deliver_domain(
            DnsResolver.from_settings(ws),
            envelope,
            BodySource.from_bytes(MESSAGE),
            ws,
            None,
            engine,
        )
    reply = result.replies[rcpt]
    assert reply.is_temporary and reply.enhanced == "4.7.5", reply
    assert reply.tls is not None and reply.tls.policy == "dane"
    assert reply.tls.result == "dnssec-invalid"
    assert mx.connections == 0


async def test_unsigned_zone_is_opportunistic(world: tuple[World, Unbound]) -> None:
    """An insecure MX RRset: DANE does not apply (RFC 7672 §2.2.1); opportunistic TLS
    with any certificate, as before."""
    w, unbound = world
    port = shared_port([PLAIN])
    rcpt = "user@ok.plain.test"
    async with ScriptedMx(PLAIN, port, name="mx.ok.plain.test", tls=w.context("plain")) as mx:
        result = await attempt(unbound, port, rcpt)
    assert result.delivered == [rcpt] and mx.delivered[0].tls
    note = result.replies[rcpt].tls
    assert note is not None and note.policy == "opportunistic"


def test_dane_matching_rules() -> None:
    """RFC 6698 §2.1 / RFC 7672 §3.1: every selector and matching type; PKIX usages and
    unknown parameters are unusable; DANE-EE ignores names and expiry."""
    ca = trustme.CA()
    expired = ca.issue_cert(
        "other.invalid", not_before=datetime(2019, 1, 1), not_after=datetime(2020, 1, 1)
    )
    cert = x509.load_pem_x509_certificate(expired.cert_chain_pems[0].bytes())
    der = cert.public_bytes(Encoding.DER)
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    for selector, content in ((0, der), (1, spki)):
        for mtype, data in (
            (0, content),
            (1, hashlib.sha256(content).digest()),
            (2, hashlib.sha512(content).digest()),
        ):
            record = Tlsa(3, selector, mtype, data)
            assert record.usable
            assert dane_verdict([cert], [record], ["mx.example.test"]).ok
            assert not dane_verdict([cert], [Tlsa(3, selector, mtype, b"x" * len(data))], []).ok
    assert not Tlsa(1, 1, 1, hashlib.sha256(spki).digest()).usable
    assert not Tlsa(0, 0, 0, der).usable
    assert not Tlsa(3, 2, 1, hashlib.sha256(spki).digest()).usable
    assert not Tlsa(3, 1, 1, b"short").usable
    pkix = Tlsa(1, 1, 1, hashlib.sha256(spki).digest())
    assert not dane_verdict([cert], [pkix], ["mx.example.test"]).ok


async def test_dane_through_the_queue(world: tuple[World, Unbound], queue_harness: Harness) -> None:
    """End to end through the front end, the JetStream queue and a worker whose resolver is
    unbound: a matching TLSA is delivered over TLS; a mismatching one stays deferred with
    4.7.5 and ``queue show`` says ``dane`` and why; the mismatching MX never sees MAIL."""
    w, unbound = world
    h = queue_harness
    receiver = await Receiver(w).start()
    ca = w.tmp / "ca.pem"
    w.ca.cert_pem.write_to_path(str(ca))
    report = TlsReportSettings(enabled=True, https_ca_file=ca, https_port=receiver.port)
    h.configure(
        worker={"nameservers": [unbound.host], "nameserver_port": unbound.port},
        outbound_tls={"dane": True, "mta_sts": False, "report": report},
    )
    events = Collect()
    async with (
        ScriptedMx(HOSTS["ok"], h.mx_port, name="mx.ok.dane.test", tls=w.context("ok")) as ok,
        ScriptedMx(HOSTS["bad"], h.mx_port, name="mx.bad.dane.test", tls=w.context("bad")) as bad,
        h.running(h.worker(observer=events)),
    ):
        good_id = await h.submit(MESSAGE, ["user@ok.dane.test"])
        bad_id = await h.submit(MESSAGE, ["user@bad.dane.test"])
        await eventually(lambda: len(ok.delivered) == 1, what="delivered over DANE")

        async def tried() -> bool:
            entry = await h.entry(bad_id)
            return entry is not None and entry.recipients[0].attempts >= 1

        await eventually(tried, what="the mismatching TLSA deferred")
    assert ok.delivered[0].tls and await h.entry(good_id) is None
    assert "MAIL" not in verbs(bad)
    shown = "\n".join(render_detail(await Admin(h.stores).show(bad_id)))
    assert "451 4.7.5" in shown and "tls:     dane: TLS;" in shown
    assert "no TLSA record matched" in shown
    # RFC 8460: the day's report for ok.dane.test names the TLSA RRset as policy-string
    async with receiver:
        reporter = TlsReporter(h.settings, [], h.stores)
        sent = await reporter.report_day(datetime.now(UTC).date(), events.events)
    assert [s.domain for s in sent if s.ok] == ["ok.dane.test"]
    (body,) = receiver.posts
    (item,) = json.loads(gzip.decompress(body))["policies"]
    assert item["policy"]["policy-type"] == "tlsa"
    strings = sorted(item["policy"]["policy-string"])  # the whole RRset, in any order
    assert len(strings) == 2
    assert strings[1].startswith("_25._tcp.mx.ok.dane.test. IN TLSA 3 1 1 ")
    assert item["summary"]["total-successful-session-count"] == 1


class Collect:
    """An observer that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


class Receiver:
    """HTTPS receiver of TLS reports on loopback (reports.plain.test)."""

    def __init__(self, w: World) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        w.ca.issue_cert("reports.plain.test").configure_cert(self.context)
        self.posts: list[bytes] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _post(self, request: web.Request) -> web.Response:
        self.posts.append(await request.read())
        return web.Response(status=200)

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/r", self._post)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, RECEIVER, 0, ssl_context=self.context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def test_tlsa_at_the_cname_expanded_mx_name(world: tuple[World, Unbound]) -> None:
    """RFC 7672 §2.2.2: the MX host name is an alias (secure CNAME); TLSA is looked up at the
    expanded name first, and the MX authenticated by it. RFC 7672 §8.1: the SNI name is
    that TLSA base domain, so a server with a certificate per name sends the right one."""
    w, unbound = world
    port = shared_port([ALIAS])
    rcpt = "user@alias.dane.test"
    context = w.context("alias")
    names: list[str | None] = []
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)
    async with ScriptedMx(ALIAS, port, name="mx.alias.dane.test", tls=context) as mx:
        result = await attempt(unbound, port, rcpt)
    assert names == ["real.alias.dane.test"]
    assert result.delivered == [rcpt] and mx.delivered[0].tls, result.replies
    note = result.replies[rcpt].tls
    assert note is not None and note.policy == "dane" and note.result == "success"
    assert "_25._tcp.real.alias.dane.test" in note.detail
    assert ("_25._tcp.real.alias.dane.test", "TLSA") in unbound.upstream.queried
