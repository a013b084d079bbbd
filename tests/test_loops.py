"""Mail loops: a message whose MX (or smarthost) is this queue itself. Real nats-server, DNS
server, front ends and scripted MXes on loopback.

Two guards, as RFC 5321 has them: the worker knows itself in the next hop's EHLO reply
(§5.1, "loops back to myself") and bounces at the first hop; a loop it cannot see (another
name, a chain of hosts) is cut by the front end, which refuses a message that arrives with
more ``Received:`` fields than a loop-free path has (§6.3), so it bounces after at most
``smtp.max_received`` hops instead of going round for ever.
"""

from __future__ import annotations

import random

import pytest
from test_worker import SENDER_ZONE, dsn_parts, gone, one_mx

from jsqueue.config import SmtpSettings, WorkerSettings
from jsqueue.delivery.base import BodySource, DeliveryEnvelope
from jsqueue.delivery.client import deliver
from jsqueue.delivery.resolver import DnsResolver, MxTarget, without_myself
from jsqueue.delivery.signals import ours
from jsqueue.envelope import Recipient
from jsqueue.frontend.data import DataDecoder
from jsqueue.frontend.server import SmtpServer
from support.cases import case_message
from support.dns import DnsServer
from support.mx import Certs, ScriptedMx, SmtpdMx, shared_port
from support.queue import REPORTING_MTA, Harness, eventually

ME = "out.jsqueue.example.test"


def test_ours_takes_the_first_word_of_the_reply_and_never_a_bare_name() -> None:
    """RFC 5321 §4.1.1.1: the EHLO reply starts with the server's domain. Matched
    case-insensitively, a final dot ignored; ``localhost`` and names without a dot (what
    many servers call themselves) are never taken for ours."""
    assert ours("OUT.jsqueue.example.test. Hello you\nPIPELINING", [ME]) == ME
    assert ours("mx.example.test Hello\nPIPELINING", [ME]) is None
    assert ours(f"greets {ME}", [ME]) is None
    assert ours("localhost", ["localhost"]) is None
    assert ours("localhost.localdomain", ["localhost.localdomain"]) is None
    assert ours("mailhost", ["mailhost"]) is None
    assert ours("", [ME]) is None


def test_a_worker_that_cannot_tell_itself_by_name_says_so(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``localhost`` (the defaults) or names without a dot, the EHLO check cannot find
    this queue behind an MX: the worker says so when it is built, naming both settings,
    and stays silent when a name can tell."""
    h = queue_harness
    h.configure(worker={"ehlo_name": "localhost"}, smtp={"hostname": "localhost"})
    h.worker()
    assert "worker.ehlo_name and smtp.hostname are 'localhost' and 'localhost'" in caplog.text
    caplog.clear()
    h.configure(worker={"ehlo_name": ME})
    h.worker()
    assert "smtp.max_received hops" not in caplog.text


def test_the_data_decoder_counts_received_fields_of_the_header_only() -> None:
    """RFC 5321 §6.3: one ``Received:`` more than ``max_received`` (in any case, with white
    space before the colon, RFC 5322 §4.5) is refused with 554 5.4.6 after the terminator;
    lines of the body and folded continuations do not count."""
    header = b"".join(b"Received: from h%d by h\r\n\t(folded)\r\n" % i for i in range(9))
    ok = header + b"RECEIVED : from x\r\nSubject: t\r\n\r\nReceived: in the body\r\n.\r\n"
    decoder = DataDecoder(max_size=10_000, max_received=10)
    for i in range(0, len(ok), 7):  # split anywhere
        decoder.feed(ok[i : i + 7])
    assert decoder.done and decoder.error is None and decoder.received == 10
    too_many = b"Received: from y\r\n" + ok
    decoder = DataDecoder(max_size=10_000, max_received=10)
    content, rest = decoder.feed(too_many + b"QUIT\r\n")
    assert rest == b"QUIT\r\n" and content == b""
    assert decoder.error is not None and (decoder.error.code, decoder.error.enhanced) == (
        554,
        "5.4.6",
    )


def _client_settings(port: int) -> WorkerSettings:
    return WorkerSettings.model_validate({"mx_port": port, "ehlo_name": ME})


def _envelope() -> DeliveryEnvelope:
    return DeliveryEnvelope(
        domain="loop.example.test",
        reverse_path="alice@example.test",
        recipients=(Recipient.from_address("u@loop.example.test"),),
    )


BODY = BodySource.from_bytes(b"Subject: loop\r\n\r\nbody\r\n")


async def test_the_best_mx_being_myself_is_a_bounce_and_the_rest_are_not_tried() -> None:
    """RFC 5321 §5.1: the client that finds itself among the MXes drops that MX and every
    one of the same or a lower preference. The first MX answers EHLO with our name: no
    MAIL is sent to it, the MX after it is not tried, and the recipient fails with
    ``554 5.4.6`` (RFC 3463 X.4.6), so it is bounced, not retried."""
    me, other = "127.0.2.140", "127.0.2.141"
    port = shared_port([me, other])
    async with ScriptedMx(me, port, name=ME) as mirror, ScriptedMx(other, port) as second:
        result = await deliver(
            [
                MxTarget(host="mx1.loop.example.test", address=me, preference=10),
                MxTarget(host="mx2.loop.example.test", address=other, preference=20),
            ],
            _envelope(),
            BODY,
            _client_settings(port),
        )
    reply = result.replies["u@loop.example.test"]
    assert (reply.code, reply.enhanced) == (554, "5.4.6") and reply.is_permanent
    assert "loops back to myself" in reply.text and ME in reply.text
    assert "MAIL" not in [v for s in mirror.sessions for v in s.verbs()]
    assert second.connections == 0


async def test_myself_after_a_better_mx_that_failed_defers_with_its_failure() -> None:
    """A better MX (a lower preference) was tried and failed for now; then the next one is
    this queue: the attempt ends there, deferred with the better MX's failure (it may take
    the mail later), not bounced."""
    better, me = "127.0.2.142", "127.0.2.143"
    port = shared_port([better, me])
    async with (
        ScriptedMx(better, port, greeting="421 4.3.2 busy") as first,
        ScriptedMx(me, port, name=ME) as mirror,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.loop.example.test", address=better, preference=5),
                MxTarget(host="mx2.loop.example.test", address=me, preference=10),
            ],
            _envelope(),
            BODY,
            _client_settings(port),
        )
    reply = result.replies["u@loop.example.test"]
    assert reply.is_temporary and reply.remote_host == "mx1.loop.example.test", reply
    assert (reply.code, reply.text) == (421, "busy")  # the better MX's own reply
    assert first.connections == 1 and mirror.connections == 1


def test_without_myself_drops_my_mx_and_every_one_not_better() -> None:
    """RFC 5321 §5.1: the client that finds itself among the MX records discards that MX
    and every MX of the same or a lower preference (a greater value), also ones listed
    before it (equal preferences come in a random order); matched by address, an
    IPv4-mapped address as its IPv4 address; the smarthost is never matched."""
    me = "192.0.2.25"
    targets = [
        MxTarget(host="a.example.test", address="192.0.2.1", preference=5),
        MxTarget(host="b.example.test", address="192.0.2.2", preference=10),
        MxTarget(host="me.example.test", address=f"::ffff:{me}", preference=10),
        MxTarget(host="c.example.test", address="192.0.2.3", preference=20),
    ]
    left, found = without_myself(targets, [me])
    assert [t.host for t in left] == ["a.example.test"] and found == targets[2]
    assert without_myself(targets, []) == (targets, None)
    assert without_myself(targets, ["192.0.2.99"]) == (targets, None)
    implicit = [MxTarget(host="example.test", address=me)]
    assert without_myself(implicit, [me]) == ([], implicit[0])
    relay = [MxTarget(host="relay.example.test", address=me, port=2526, relay=True)]
    assert without_myself(relay, [me]) == (relay, None)


async def test_the_best_mx_at_my_own_address_bounces_without_a_connection() -> None:
    """An MX whose address is one of worker.own_addresses is this queue, whatever name it
    would give: with it the best MX, the recipient fails with 554 5.4.6 and no target is
    connected to (this one would take the mail again, the next one is discarded)."""
    me, other = "127.0.2.144", "127.0.2.145"
    port = shared_port([me, other])
    async with ScriptedMx(me, port) as mirror, ScriptedMx(other, port) as second:
        result = await deliver(
            [
                MxTarget(host="mx1.loop.example.test", address=me, preference=10),
                MxTarget(host="mx2.loop.example.test", address=other, preference=20),
            ],
            _envelope(),
            BODY,
            WorkerSettings.model_validate({"mx_port": port, "own_addresses": [me]}),
        )
    reply = result.replies["u@loop.example.test"]
    assert (reply.code, reply.enhanced) == (554, "5.4.6") and reply.is_permanent
    assert "loops back to myself" in reply.text and "worker.own_addresses" in reply.text
    assert mirror.connections == 0 and second.connections == 0


async def test_my_own_address_is_found_past_max_mx_addresses_among_equal_preferences() -> None:
    """RFC 5321 §5.1: three MX hosts of the same preference, one of them this queue, and
    ``max_mx_addresses`` 2. Whatever the shuffle of equal preferences, the resolver keeps
    this queue past the cut, so the loop check sees it and discards its equal-preference
    peers: 554 5.4.6, nothing connected to. Cut first, a shuffle that put this queue
    third delivered to a peer the RFC says to discard."""
    me, peers = "127.0.2.146", ["127.0.2.147", "127.0.2.148"]
    port = shared_port([me, *peers])
    zone = "".join(
        f"eq.loop.example.test. 300 IN MX 10 mx{i}.eq.loop.example.test.\n"
        f"mx{i}.eq.loop.example.test. 300 IN A {address}\n"
        for i, address in enumerate([me, *peers])
    )
    with DnsServer(zone) as dns:
        settings = WorkerSettings.model_validate(
            {
                "mx_port": port,
                "own_addresses": [me],
                "max_mx_addresses": 2,
                "nameservers": dns.nameservers,
                "nameserver_port": dns.port,
            }
        )
        for seed in range(12):
            resolver = DnsResolver.from_settings(settings)
            resolver._rng = random.Random(seed)
            targets = await resolver.resolve("eq.loop.example.test")
            assert me in [t.address for t in targets], seed
            assert len(targets) <= 3
        async with ScriptedMx(peers[0], port) as one, ScriptedMx(peers[1], port) as two:
            recipient = Recipient.from_address("u@eq.loop.example.test")
            result = await deliver(
                targets,
                DeliveryEnvelope(
                    domain=recipient.domain, reverse_path="a@src.test", recipients=(recipient,)
                ),
                BODY,
                settings,
            )
    reply = result.replies["u@eq.loop.example.test"]
    assert (reply.code, reply.enhanced) == (554, "5.4.6")
    assert one.connections == two.connections == 0


async def test_a_better_mx_than_my_own_address_is_still_tried() -> None:
    """A better MX is tried, and its temporary failure defers the message; the MX at this
    queue's address and the worse one are not tried."""
    better, me, worse = "127.0.2.146", "127.0.2.147", "127.0.2.148"
    port = shared_port([better, me, worse])
    async with (
        ScriptedMx(better, port, greeting="421 4.3.2 busy") as first,
        ScriptedMx(me, port) as mirror,
        ScriptedMx(worse, port) as third,
    ):
        result = await deliver(
            [
                MxTarget(host="mx1.loop.example.test", address=better, preference=5),
                MxTarget(host="mx2.loop.example.test", address=me, preference=10),
                MxTarget(host="mx3.loop.example.test", address=worse, preference=20),
            ],
            _envelope(),
            BODY,
            WorkerSettings.model_validate({"mx_port": port, "own_addresses": [me]}),
        )
    reply = result.replies["u@loop.example.test"]
    assert reply.is_temporary and reply.remote_host == "mx1.loop.example.test", reply
    assert (reply.code, reply.text) == (421, "busy")  # the better MX's own reply
    assert (first.connections, mirror.connections, third.connections) == (1, 0, 0)


@pytest.mark.parametrize("starttls", [False, True])
async def test_under_required_tls_only_the_ehlo_after_starttls_can_say_myself(
    starttls: bool,
) -> None:
    """A cleartext EHLO reply can be forged on the path (RFC 3207 §6): under a policy that
    requires TLS (``required``, and so DANE and MTA-STS enforce) it is not believed to say
    "this is myself", so a forged one cannot turn a deferral into a bounce. The next hop
    that offers no STARTTLS is deferred as any such hop is (never bounced); one that does
    is judged by its EHLO reply after the handshake (here still ours: 554 5.4.6)."""
    host = "127.0.2.146"
    port = shared_port([host])
    certs = Certs()
    tls = certs.server_context("mx1.loop.example.test") if starttls else None
    settings = WorkerSettings.model_validate({"mx_port": port, "ehlo_name": ME, "tls": "required"})
    async with ScriptedMx(host, port, name=ME, tls=tls) as mirror:
        result = await deliver(
            [MxTarget(host="mx1.loop.example.test", address=host, preference=10)],
            _envelope(),
            BODY,
            settings,
        )
    reply = result.replies["u@loop.example.test"]
    if starttls:
        assert (reply.code, reply.enhanced) == (554, "5.4.6"), reply
        assert "STARTTLS" in [v for s in mirror.sessions for v in s.verbs()]
    else:
        assert reply.is_temporary and "loops back" not in reply.text, reply


async def _own_frontend(h: Harness, address: str, **smtp: object) -> SmtpServer:
    settings = SmtpSettings.model_validate({"host": address, "port": h.mx_port, **smtp})
    server = SmtpServer(settings, h.stores)
    await server.start()
    return server


async def _settled(h: Harness) -> bool:
    """Nothing left to deliver: only the (final) bounce's entry stays, as DSN entries do."""
    page = await h.stores.entries.page()
    return [(v.entry.is_dsn, v.entry.is_final) for v in page] == [(True, True)]


async def _bounce_of(h: Harness, sender_mx: SmtpdMx, status: str) -> None:
    await eventually(lambda: len(sender_mx.delivered) == 1, timeout_s=20, what="the bounce")
    _, groups = dsn_parts(sender_mx.delivered[0].content or b"")
    assert [g["Status"] for g in groups] == [status]
    assert groups[0]["Action"] == "failed"


async def test_an_mx_that_is_this_queue_bounces_at_the_first_hop(queue_harness: Harness) -> None:
    """The MX of loop.example.test is this queue's own front end, which answers EHLO with
    ``smtp.hostname``: the worker knows itself (the front end's name is one of its own
    names), sends nothing there and bounces the message once with 5.4.6. Nothing was queued
    a second time: the bounce is all that is left."""
    h = queue_harness
    h.dns.add(one_mx("loop.example.test", "127.0.2.144"))
    own = await _own_frontend(h, "127.0.2.144", hostname=REPORTING_MTA)
    try:
        async with SmtpdMx("127.0.2.1", h.mx_port) as sender_mx:
            qid = await h.submit(case_message("CASE-07"), ["u@loop.example.test"])
            async with h.running():
                await _bounce_of(h, sender_mx, "5.4.6")
                await eventually(lambda: gone(h, qid), what="the message removed")
                await eventually(lambda: _settled(h), timeout_s=20, what="the bounce sent")
    finally:
        await own.stop(timeout_s=2)


@pytest.mark.parametrize("max_received", [10, 30])
async def test_a_loop_under_another_name_is_cut_by_the_received_count(
    queue_harness: Harness, max_received: int
) -> None:
    """The MX is this queue's front end under a name the worker does not know as its own (a
    second host name, a chain of relays): each round adds a ``Received:`` field, and the
    round that brings one more than ``smtp.max_received`` is refused with 554 5.4.6 (RFC
    5321 §6.3), so the message bounces after that many hops and nothing else is left."""
    h = queue_harness
    h.dns.add(SENDER_ZONE + one_mx("loop.example.test", "127.0.2.145"))
    own = await _own_frontend(
        h, "127.0.2.145", hostname="inbound.other.example.test", max_received=max_received
    )
    try:
        async with SmtpdMx("127.0.2.1", h.mx_port) as sender_mx:
            await h.submit(case_message("CASE-07"), ["u@loop.example.test"])
            async with h.running():
                await _bounce_of(h, sender_mx, "5.4.6")
                await eventually(lambda: _settled(h), timeout_s=20, what="every copy gone")
            raw = sender_mx.delivered[0].content or b""
            assert b"Too many Received: header fields" in raw
    finally:
        await own.stop(timeout_s=2)
