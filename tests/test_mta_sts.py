"""MTA-STS (RFC 8461) with real parts on loopback: our test DNS server serving
``_mta-sts`` TXT and the policy host, an HTTPS policy server with a trustme certificate
(resolved through the configured nameserver, never the system's), scripted MXes; and the
cluster-wide cache on a real nats-server. CASE-20 variant E runs under a real policy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from jsqueue.config import OutboundTlsSettings, WorkerSettings
from jsqueue.delivery import BodySource, DeliveryEnvelope
from jsqueue.delivery.client import deliver_domain
from jsqueue.delivery.policy.decision import PolicyEngine
from jsqueue.delivery.policy.mta_sts import StsPolicy, mx_matches, parse_policy, parse_record
from jsqueue.delivery.resolver import DnsResolver
from jsqueue.envelope import Recipient
from jsqueue.errors import PolicyError
from jsqueue.store.base import Stores
from jsqueue.store.policies import MemoryPolicyCache, PolicyCache
from support.cases import CASES
from support.dns import DnsServer
from support.mx import Certs, ScriptedMx, shared_port

MX_HOST = "127.0.2.161"
POLICY_HOST = "127.0.2.162"
MX_NAME = "mx.strict.example.test"
RCPT = "user@strict.example.test"
ZONE = f"""
strict.example.test.      300 IN MX 10 {MX_NAME}.
{MX_NAME}.                300 IN A  {MX_HOST}
mta-sts.strict.example.test. 300 IN A {POLICY_HOST}
"""


def policy(mode: str, mx: str = MX_NAME, max_age: int = 86400) -> str:
    return f"version: STSv1\r\nmode: {mode}\r\nmx: {mx}\r\nmax_age: {max_age}\r\n"


class PolicyServer:
    """HTTPS on loopback serving ``/.well-known/mta-sts.txt`` as text/plain."""

    def __init__(self, certs: Certs, text: str) -> None:
        self.text = text
        self.hits = 0
        self.split_at: int | None = None
        self.pause_s = 0.3
        self.context = certs.server_context("mta-sts.strict.example.test")
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _policy(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.split_at is None:
            return web.Response(text=self.text, content_type="text/plain")
        # a slow server: the body in two writes with a pause between (as WAIT in the
        # scripted MXes), so the client's first read returns only the first part
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        data = self.text.encode()
        await response.write(data[: self.split_at])
        await asyncio.sleep(self.pause_s)
        await response.write(data[self.split_at :])
        await response.write_eof()
        return response

    async def start(self) -> PolicyServer:
        app = web.Application()
        app.router.add_get("/.well-known/mta-sts.txt", self._policy)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, POLICY_HOST, 0, ssl_context=self.context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture(scope="module")
def certs() -> Certs:
    return Certs()


@pytest.fixture
async def policy_server(certs: Certs) -> AsyncIterator[PolicyServer]:
    server = await PolicyServer(certs, policy("enforce")).start()
    yield server
    await server.stop()


@pytest.fixture
def dns_server() -> AsyncIterator[DnsServer]:
    with DnsServer(ZONE) as dns:
        # TTL 0: tests change this record and look again at once; a worker keeps DNS
        # answers for their TTL (worker.dns_cache_size) and a TTL 0 one not at all.
        dns.add('_mta-sts.strict.example.test. 0 IN TXT "v=STSv1; id=20260301T000000;"')
        yield dns


def engine_for(
    dns: DnsServer,
    server: PolicyServer,
    ca: Path,
    port: int,
    cache: PolicyCache,
    recheck_s: float = 0.0,
) -> tuple[PolicyEngine, WorkerSettings]:
    ws = WorkerSettings(
        nameservers=dns.nameservers,
        nameserver_port=dns.port,
        mx_port=port,
        ehlo_name="worker.example.test",
        connect_timeout_s=5,
        greeting_timeout_s=5,
        mail_timeout_s=5,
        rcpt_timeout_s=5,
        data_init_timeout_s=5,
        data_final_timeout_s=5,
    )
    tls = OutboundTlsSettings(
        mta_sts_port=server.port,
        mta_sts_ca_file=ca,
        mta_sts_timeout_s=5,
        mta_sts_recheck_s=recheck_s,
    )
    return PolicyEngine(tls, ws, cache), ws


async def attempt(engine: PolicyEngine, ws: WorkerSettings):  # type: ignore[no-untyped-def]
    r = Recipient.from_address(RCPT)
    envelope = DeliveryEnvelope(domain=r.domain, reverse_path="a@example.test", recipients=(r,))
    body = BodySource.from_bytes((CASES / "CASE-20" / "message.eml").read_bytes())
    return await deliver_domain(DnsResolver.from_settings(ws), envelope, body, ws, None, engine)


def verbs(mx: ScriptedMx) -> list[str]:
    return [c.split(" ", 1)[0].upper() for c in mx.commands]


async def test_enforce_with_non_matching_mx_defers_and_sends_nothing(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §4.1, §5.1: under enforce an MX matching no pattern is not used: 4.7.5,
    no connection at all (so nothing in plaintext); the reply says which policy."""
    policy_server.text = policy("enforce", mx="mx.elsewhere.example.test")
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    ctx = certs.server_context(MX_NAME)
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=ctx) as mx:
        result = await attempt(engine, ws)
    reply = result.replies[RCPT]
    assert reply.is_temporary and reply.enhanced == "4.7.5", reply
    assert reply.remote_host is None  # this queue's deferral: an expiry reports 5.7.5
    assert reply.tls is not None and reply.tls.policy == "mta-sts enforce"
    assert reply.tls.policy_id == "20260301T000000"
    assert mx.connections == 0
    assert ("mta-sts.strict.example.test", "A") in dns_server.queried  # our resolver


async def test_enforce_with_an_extension_field_is_still_enforced(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §3.2: a field of an extension (``sts-policy-ext-name`` may hold ``-`` and
    ``.``) is ignored, not a reason to drop the policy: enforce still keeps mail off an MX
    that matches no pattern (4.7.5, never connected), where an unparsed policy meant
    opportunistic delivery in plaintext."""
    text = policy("enforce", mx="mx.elsewhere.example.test") + "x-report.v2: on\r\n"
    policy_server.text = text
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    async with ScriptedMx(MX_HOST, port, name=MX_NAME) as mx:
        result = await attempt(engine, ws)
    reply = result.replies[RCPT]
    assert reply.is_temporary and reply.enhanced == "4.7.5", reply
    assert reply.tls is not None and reply.tls.policy == "mta-sts enforce"
    assert mx.connections == 0


async def test_a_policy_body_arriving_in_parts_is_read_whole(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §3.3: the policy is the whole HTTP body. A server that sends it in two
    pieces (the MX pattern of our MX in the second) yields the whole policy, not the first
    piece: enforce then allows the MX and the mail goes out over verified TLS, where a
    policy cut after the first read deferred it (4.7.5, MX outside the policy)."""
    policy_server.text = (
        "version: STSv1\r\nmode: enforce\r\nmax_age: 86400\r\n"
        f"mx: mx.elsewhere.example.test\r\nmx: {MX_NAME}\r\n"
    )
    policy_server.split_at = policy_server.text.index(f"mx: {MX_NAME}")
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=certs.server_context(MX_NAME)) as mx:
        result = await attempt(engine, ws)
    assert result.delivered == [RCPT], result.replies
    assert mx.delivered[0].tls
    note = result.replies[RCPT].tls
    assert note is not None and note.policy == "mta-sts enforce" and note.result == "success"


async def test_case20_e_enforce_handshake_failure_never_plaintext(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """CASE-20 variant E under a real MTA-STS enforce policy (the case's mta-sts.txt): the
    handshake is aborted -> temporary 4.7.x, no MAIL outside TLS, no plaintext retry."""
    policy_server.text = (CASES / "CASE-20" / "mta-sts.txt").read_text()
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls_abort=True) as mx:
        result = await attempt(engine, ws)
    reply = result.replies[RCPT]
    assert reply.is_temporary and reply.enhanced is not None and reply.enhanced.startswith("4.7.")
    assert "MAIL" not in verbs(mx) and mx.connections == 1
    assert reply.tls is not None and reply.tls.policy == "mta-sts enforce"


async def test_enforce_rejects_an_untrusted_certificate(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §4.2: the MX certificate must be valid for the MX name: a rogue CA's
    certificate -> 4.7.5 after the handshake, no MAIL; a valid one -> delivered."""
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    rogue = certs.server_context(MX_NAME, untrusted=True)
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=rogue) as mx:
        result = await attempt(engine, ws)
    reply = result.replies[RCPT]
    assert reply.enhanced == "4.7.5" and "MAIL" not in verbs(mx)
    assert reply.remote_host is None  # this queue's deferral: an expiry reports 5.7.5
    assert reply.tls is not None and reply.tls.result == "certificate-not-trusted"
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=certs.server_context(MX_NAME)) as mx:
        result = await attempt(engine, ws)
    assert result.delivered == [RCPT] and mx.delivered[0].tls
    note = result.replies[RCPT].tls
    assert note is not None and note.policy == "mta-sts enforce" and note.result == "success"


async def test_testing_mode_delivers_and_notes_the_failure(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §5: testing -> delivered even with a non-matching MX and a bad
    certificate; the note records the failure for the TLS report."""
    policy_server.text = policy("testing", mx="mx.elsewhere.example.test")
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    bad = certs.server_context("other.invalid", untrusted=True)
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=bad) as mx:
        result = await attempt(engine, ws)
    assert result.delivered == [RCPT] and mx.delivered[0].tls
    note = result.replies[RCPT].tls
    assert note is not None and note.policy == "mta-sts testing"
    assert note.result != "success" and "matches no mx pattern" in note.detail


async def test_policy_change_is_picked_up_through_the_txt_id(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §3.3: the cached policy is used while the TXT id is unchanged (no fetch);
    a new id fetches the new policy."""
    policy_server.text = policy("enforce", mx="mx.elsewhere.example.test")
    port = shared_port([MX_HOST])
    engine, ws = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), port, MemoryPolicyCache()
    )
    ctx = certs.server_context(MX_NAME)
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls=ctx) as mx:
        first = await attempt(engine, ws)
        policy_server.text = policy("enforce")  # fixed, but the id is not changed yet
        second = await attempt(engine, ws)
        assert policy_server.hits == 1
        dns_server.zone.records.pop(("_mta-sts.strict.example.test", 16))
        dns_server.add('_mta-sts.strict.example.test. 0 IN TXT "v=STSv1; id=2;"')
        third = await attempt(engine, ws)
    assert first.replies[RCPT].enhanced == "4.7.5"
    assert second.replies[RCPT].enhanced == "4.7.5"
    assert policy_server.hits == 2
    assert third.delivered == [RCPT] and mx.delivered[0].tls
    assert third.replies[RCPT].tls is not None and third.replies[RCPT].tls.policy_id == "2"


async def test_none_forgets_and_failed_fetch_uses_the_cached_policy(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """RFC 8461 §3.3, §5.1: a failed fetch keeps the cached policy in force; a fetched
    ``none`` policy removes it and delivery is opportunistic."""
    cache = MemoryPolicyCache()
    port = shared_port([MX_HOST])
    engine, _ = engine_for(dns_server, policy_server, certs.ca_file(tmp_path), port, cache)
    found = await engine.sts.lookup("strict.example.test")
    assert found.policy is not None and await cache.get("strict.example.test") is not None
    await policy_server.stop()
    dns_server.zone.records.pop(("_mta-sts.strict.example.test", 16))
    dns_server.add('_mta-sts.strict.example.test. 0 IN TXT "v=STSv1; id=3;"')
    again = await engine.sts.lookup("strict.example.test")
    assert again.failure == "sts-policy-fetch-error"
    assert again.policy is not None and again.policy.id == "20260301T000000"
    await policy_server.start()
    policy_server.text = policy("none")
    engine, _ = engine_for(dns_server, policy_server, certs.ca_file(tmp_path), port, cache)
    gone = await engine.sts.lookup("strict.example.test")
    assert gone.policy is None and await cache.get("strict.example.test") is None


def test_strict_parser_and_patterns() -> None:
    """RFC 8461 §3.1, §3.2, §4.1."""
    assert parse_record(["v=STSv1; id=20160831085700Z;"]) == "20160831085700Z"
    assert parse_record(["v=STSv1; id=a;", "v=STSv1; id=b;"]) is None  # two records
    assert parse_record(["v=spf1 -all", "v=STSv1; id=x1"]) == "x1"
    assert parse_record(["v=STSv1; id=not-alnum;"]) is None
    p = parse_policy("example.com", "1", policy("enforce", "*.example.net") + "ext: 1\n", 0.0)
    assert p.mx == ("*.example.net",) and p.max_age_s == 86400
    # RFC 8461 §3.2 sts-policy-ext-name: letters, digits, "_", "-" and "." (up to 32)
    for ext in ("x-ext: 1", "vendor.example_opt: a b", "9" * 32 + ": v"):
        p = parse_policy("example.com", "1", policy("enforce") + ext + "\n", 0.0)
        assert p.mode.value == "enforce" and p.mx == (MX_NAME,)
    for bad in (
        "version: STSv2\nmode: enforce\nmx: a.example\nmax_age: 1\n",
        "version: STSv1\nmode: enforce\nmax_age: 1\n",
        "version: STSv1\nmode: strict\nmx: a.example\nmax_age: 1\n",
        "version: STSv1\nmode: enforce\nmx: a.example\nmax_age: 31557601\n",
        "version: STSv1\nmode: enforce\nmx: a.*.example\nmax_age: 1\n",
        "version: STSv1\nmode: enforce\nmode: none\nmx: a.example\nmax_age: 1\n",
        "version STSv1\n",
        policy("enforce") + "-ext: 1\n",  # an ext-name starts with a letter or digit
        policy("enforce") + "x" * 33 + ": 1\n",  # and has at most 32 characters
    ):
        with pytest.raises(PolicyError) as e:
            parse_policy("example.com", "1", bad, 0.0)
        assert e.value.result_type == "sts-policy-invalid"
    assert mx_matches("*.example.net", "mx1.example.net")
    assert mx_matches("mx.example.net", "MX.Example.NET.")
    assert not mx_matches("*.example.net", "example.net")
    assert not mx_matches("*.example.net", "a.b.example.net")


async def test_policy_host_with_untrusted_certificate_is_no_policy(
    certs: Certs, tmp_path: Path, dns_server: DnsServer
) -> None:
    """RFC 8461 §3.3: the policy host's certificate must validate: a rogue CA's ->
    ``sts-webpki-invalid``, no policy applied (nothing cached)."""
    server = PolicyServer(certs, policy("enforce"))
    server.context = certs.server_context("mta-sts.strict.example.test", untrusted=True)
    await server.start()
    try:
        cache = MemoryPolicyCache()
        engine, _ = engine_for(dns_server, server, certs.ca_file(tmp_path), 25, cache)
        found = await engine.sts.lookup("strict.example.test")
    finally:
        await server.stop()
    assert found.policy is None and found.failure == "sts-webpki-invalid"
    assert await cache.get("strict.example.test") is None


async def test_policy_cache_is_shared_through_jetstream(
    certs: Certs,
    tmp_path: Path,
    dns_server: DnsServer,
    policy_server: PolicyServer,
    js_stores: Stores,
) -> None:
    """RFC 8461 §5.1 across the cluster: a policy one worker fetched is in the KV bucket
    (with a TTL of its max_age); another worker with the policy host unreachable and a
    new TXT id still enforces it (failed fetch -> cached policy); ``none`` removes it."""
    assert js_stores.policies is not None
    port = shared_port([MX_HOST])
    ca = certs.ca_file(tmp_path)
    first, _ = engine_for(dns_server, policy_server, ca, port, js_stores.policies)
    found = await first.sts.lookup("strict.example.test")
    assert found.policy is not None
    cached = await js_stores.policies.get("strict.example.test")
    assert cached is not None and StsPolicy.from_json(cached).id == "20260301T000000"
    await policy_server.stop()
    dns_server.zone.records.pop(("_mta-sts.strict.example.test", 16))
    dns_server.add('_mta-sts.strict.example.test. 0 IN TXT "v=STSv1; id=4;"')
    second, ws = engine_for(dns_server, policy_server, ca, port, js_stores.policies)
    async with ScriptedMx(MX_HOST, port, name=MX_NAME, tls_abort=True) as mx:
        result = await attempt(second, ws)
    assert result.replies[RCPT].enhanced == "4.7.5" and "MAIL" not in verbs(mx)
    await js_stores.policies.delete("strict.example.test")
    assert await js_stores.policies.get("strict.example.test") is None


async def test_a_lookup_is_reused_for_recheck_s(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """``mta_sts_recheck_s``: within it a worker asks neither DNS nor the cache again."""
    engine, _ = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), 25, MemoryPolicyCache(), 60.0
    )
    first = await engine.sts.lookup("strict.example.test")
    asked = len(dns_server.queries)
    second = await engine.sts.lookup("strict.example.test")
    assert second is first and len(dns_server.queries) == asked


@pytest.mark.parametrize("variant", ["A", "B", "C", "D"])
async def test_case20_opportunistic_through_the_policy_engine(
    certs: Certs, variant: str, tmp_path: Path
) -> None:
    """CASE-20 A-D with the policy engine deciding (no MTA-STS record for the domain, so
    ``opportunistic``): delivered in the same attempt; A over a plaintext reconnect whose
    note records the failed handshake, B-D over TLS without verification."""
    host, name = "127.0.2.160", "mx.tlsfail.example.test"
    with DnsServer.from_file(CASES / "CASE-20" / "dns.txt") as dns:
        port = shared_port([host])
        ws = WorkerSettings(
            nameservers=dns.nameservers,
            nameserver_port=dns.port,
            mx_port=port,
            connect_timeout_s=5,
            greeting_timeout_s=5,
            mail_timeout_s=5,
        )
        engine = PolicyEngine(OutboundTlsSettings(mta_sts_timeout_s=2), ws)
        contexts = {
            "B": lambda: certs.server_context("other.invalid", untrusted=True),
            "C": lambda: certs.server_context(name, expired=True),
            "D": lambda: certs.server_context(name, max_tls12=True),
        }
        mx = (
            ScriptedMx(host, port, name=name, tls_abort=True)
            if variant == "A"
            else ScriptedMx(host, port, name=name, tls=contexts[variant]())
        )
        r = Recipient.from_address("user@tlsfail.example.test")
        envelope = DeliveryEnvelope(domain=r.domain, reverse_path="a@example.test", recipients=(r,))
        body = BodySource.from_bytes((CASES / "CASE-20" / "message.eml").read_bytes())
        async with mx:
            result = await deliver_domain(
                DnsResolver.from_settings(ws), envelope, body, ws, None, engine
            )
        assert ("_mta-sts.tlsfail.example.test", "TXT") in dns.queried
    assert result.delivered == [r.address] and len(mx.delivered) == 1
    note = result.replies[r.address].tls
    assert note is not None and note.policy == "opportunistic"
    if variant == "A":
        assert mx.connections == 2 and not mx.delivered[0].tls
        assert "MAIL" not in mx.sessions[0].verbs()
        assert not note.tls and [e.result for e in note.earlier] == ["validation-failure"]
    else:
        assert mx.connections == 1 and mx.delivered[0].tls and note.tls


async def test_concurrent_lookups_share_one_fetch(
    certs: Certs, tmp_path: Path, dns_server: DnsServer, policy_server: PolicyServer
) -> None:
    """A burst of deliveries to a domain with no cached policy fetches it once."""
    engine, _ = engine_for(
        dns_server, policy_server, certs.ca_file(tmp_path), 25, MemoryPolicyCache()
    )
    found = await asyncio.gather(*(engine.sts.lookup("strict.example.test") for _ in range(10)))
    assert policy_server.hits == 1
    assert all(f.policy is not None and f.policy.id == "20260301T000000" for f in found)


@pytest.mark.parametrize(
    "variable", ["JSQUEUE_OUTBOUND_TLS__MTA_STS_CA_FILE", "JSQUEUE_WORKER__TLS_CA_FILE"]
)
def test_worker_with_an_unusable_ca_file_stops_at_start_with_one_line(
    tmp_path: Path, variable: str
) -> None:
    """A CA bundle that is missing or holds no certificate stops ``jsqueue worker`` before
    it connects anywhere (exit 2, one line naming the setting), rather than failing every
    verified delivery later as ``certificate-not-trusted`` (no NATS runs for this test)."""
    setting = variable.removeprefix("JSQUEUE_").lower().replace("__", ".")
    empty = tmp_path / "empty.pem"
    empty.write_text("no certificate here\n")
    for path, why in ((tmp_path / "gone.pem", "No such file"), (empty, "")):
        env = {**os.environ, "JSQUEUE_NATS__URLS": '["nats://127.0.0.1:9"]', variable: str(path)}
        env.pop("JSQUEUE_CONFIG", None)
        proc = subprocess.run(
            [sys.executable, "-m", "jsqueue", "worker"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"jsqueue: invalid configuration: {setting} {path}: "), last
        assert why in last, last
