"""The outbound client against scripted MXes for faults other MTAs had public reports
about: STARTTLS response injection (RFC 3207 §4.2), reply syntax and 421 (RFC 5321 §4.2,
§3.8), capability checks (RFC 6531, 6152, 1870), per-recipient results (RFC 5321 §3.3,
RFC 2920). MX addresses 127.0.5.x."""

from __future__ import annotations

import pytest

from jsqueue.config import WorkerSettings
from jsqueue.delivery import BodySource, DeliveryEnvelope, MxTarget, deliver
from jsqueue.envelope import Notify, Recipient
from support.mx import Certs, ScriptedMx, Session, shared_port

MESSAGE = b"From: a@example.test\r\nTo: b@inj.example.test\r\nSubject: t\r\n\r\nhello\r\n"


def settings_for(port: int, **overrides: object) -> WorkerSettings:
    values: dict[str, object] = {
        "mx_port": port,
        "ehlo_name": "worker.example.test",
        "connect_timeout_s": 5.0,
        "greeting_timeout_s": 5.0,
        "mail_timeout_s": 5.0,
        "rcpt_timeout_s": 5.0,
        "data_init_timeout_s": 5.0,
        "data_block_timeout_s": 10.0,
        "data_final_timeout_s": 10.0,
    }
    values.update(overrides)
    return WorkerSettings.model_validate(values)


def envelope(*recipients: Recipient, sender: str = "a@example.test") -> DeliveryEnvelope:
    return DeliveryEnvelope(
        domain=recipients[0].domain, reverse_path=sender, recipients=tuple(recipients)
    )


async def test_starttls_injected_cleartext_is_discarded_and_ehlo_repeated() -> None:
    """RFC 3207 §4.2 (CVE-2011-0411 class): replies a man in the middle appends in
    cleartext to the 220 of STARTTLS are discarded, never read as the replies to EHLO,
    MAIL, RCPT or DATA after the handshake; the client says EHLO again and uses only what
    that EHLO advertised (here: no DSN, no SIZE limit), forgetting the cleartext one's."""
    host = "127.0.5.1"
    port = shared_port([host])
    name = "mx.inj.example.test"
    plain = f"250-{name}\n250-DSN\n250-SIZE 10\n250 STARTTLS"
    secure = f"250-{name}\n250 8BITMIME"

    def ehlo(session: Session, line: str) -> str | None:
        if line.upper().startswith("EHLO"):
            return secure if session.tls else plain
        return None

    injected = "\n".join(["250-evil.example.test", "250 DSN", *["550 5.1.1 injected"] * 4])
    rcpt = Recipient.from_address("b@inj.example.test").model_copy(
        update={"notify": frozenset({Notify.SUCCESS, Notify.FAILURE})}
    )
    certs = Certs()
    async with ScriptedMx(
        host, port, name=name, tls=certs.server_context(name), hook=ehlo, tls_inject=injected
    ) as mx:
        result = await deliver(
            [MxTarget(host=name, address=host)],
            envelope(rcpt),
            BodySource.from_bytes(MESSAGE),
            settings_for(port),
        )
    assert result.delivered == [rcpt.address], result.replies
    assert result.tls and not result.dsn
    assert len(mx.delivered) == 1 and mx.delivered[0].tls
    verbs = [c.split(" ", 1)[0].upper() for c in mx.commands]
    assert verbs[:6] == ["EHLO", "STARTTLS", "EHLO", "MAIL", "RCPT", "DATA"]
    rcpt_lines = [c for c in mx.commands if c.upper().startswith("RCPT")]
    assert rcpt_lines == [f"RCPT TO:<{rcpt.address}>"]  # no NOTIFY: no DSN after TLS
    mail_lines = [c for c in mx.commands if c.upper().startswith("MAIL")]
    assert "SIZE=" not in mail_lines[0]


BROKEN = {
    "greeting-codes-differ": {"greeting": "220-mx.bad.example.test\n554 no"},
    "greeting-no-separator": {"greeting": "220mx.bad.example.test"},
    "greeting-554": {"greeting": "554 5.3.2 no service"},
    "greeting-421": {"greeting": "421 4.3.2 busy"},
    "greeting-then-extra": {"greeting": "220 mx.bad.example.test\n250 unsolicited"},
    "ehlo-421": {"ehlo": "421 4.3.2 closing"},
    "ehlo-codes-differ": {"ehlo": "250-mx.bad.example.test\n251 PIPELINING"},
    "ehlo-then-extra": {"ehlo": "250 mx.bad.example.test\n250 again"},
    "mail-421": {"mail": "421 4.3.2 closing"},
    "mail-two-replies": {"extra_replies": {"MAIL": "250 2.1.0 again"}},
    "rcpt-two-replies": {"extra_replies": {"RCPT": "550 5.1.1 not yours"}},
    "rcpt-421": {"rcpt": "421 4.3.2 closing"},
    "rcpt-codes-differ": {"rcpt": "250-ok\n550 5.1.1 no"},
    "data-421": {"data": "421 4.3.2 closing"},
    "helo-too": {"ehlo": "502 5.5.1 no", "helo": "421 4.3.2 bye"},
}


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("fault", sorted(BROKEN))
async def test_broken_primary_goes_to_the_next_mx(fault: str, pipelining: bool) -> None:
    """RFC 5321 §3.8, §4.2, §5.1: a primary that breaks the protocol before the body went
    out (421 at any stage, a malformed or unsolicited reply) sends the message to the next
    MX; nothing is bounced."""
    bad, good = "127.0.5.2", "127.0.5.3"
    port = shared_port([bad, good])
    rcpt = Recipient.from_address("b@two.example.test")
    kw: dict[str, object] = {"name": "mx.bad.example.test", **BROKEN[fault]}
    async with (
        ScriptedMx(bad, port, **kw) as primary,  # type: ignore[arg-type]
        ScriptedMx(good, port, name="mx2.two.example.test") as backup,
    ):
        result = await deliver(
            [
                MxTarget(host="mx.bad.example.test", address=bad, preference=10),
                MxTarget(host="mx2.two.example.test", address=good, preference=20),
            ],
            envelope(rcpt),
            BodySource.from_bytes(MESSAGE),
            settings_for(port, pipelining=pipelining),
        )
    assert not primary.delivered
    assert result.delivered == [rcpt.address], result.replies
    assert len(backup.delivered) == 1
