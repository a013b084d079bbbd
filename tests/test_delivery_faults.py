"""Delivery faults end to end: an uncertain outcome after the final dot (RFC 5321 §6.1,
§4.5.3.2.6). Real nats-server, DNS server and scripted MXes on loopback."""

from __future__ import annotations

import logging

import pytest
from test_worker import _Events, one_mx, tried_once

from jsqueue.events import EventKind
from support.mx import CLOSE, SILENT, ScriptedMx
from support.queue import Harness, eventually


@pytest.mark.parametrize("end_of_data", [CLOSE, SILENT])
async def test_no_reply_to_the_final_dot_is_an_uncertain_deferral(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture, end_of_data: str
) -> None:
    """RFC 5321 §4.5.3.2.6, §6.1: the connection dies (or the reply times out) after the
    final dot. The recipient is deferred, and the log line, the deferred event and
    ``jsqueue_delivery_uncertain_total`` say the outcome is uncertain (it may be delivered
    twice); ordinary deferrals stay unmarked."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    h = queue_harness
    h.configure(retry={"base_s": 3600.0}, worker={"data_final_timeout_s": 0.5})
    domain = "dot.example.test"
    h.dns.add(one_mx(domain, "127.0.2.27"))
    rcpt, busy = f"u@{domain}", f"busy@{domain}"
    replies = {busy: "450 4.2.1 busy"}
    async with ScriptedMx(
        "127.0.2.27", h.mx_port, end_of_data=end_of_data, rcpt_replies=replies
    ) as mx:
        qid = await h.submit(b"Subject: dot\r\n\r\nbody\r\n", [rcpt, busy])
        seen = _Events()
        async with h.running(h.worker(observer=seen)):
            await eventually(lambda: tried_once(h, qid), what="the attempt recorded")
            await eventually(lambda: len(seen.events) >= 2, what="the events")
    assert mx.transactions and mx.transactions[0].rcpt_to == [rcpt]
    e = await h.entry(qid)
    assert e is not None
    states = {r.address: r.state.value for r in e.recipients}
    assert states == {rcpt: "deferred", busy: "deferred"}
    deferred = {ev.recipient: ev for ev in seen.events if ev.kind is EventKind.DEFERRED}
    assert deferred[rcpt].uncertain is True
    assert deferred[busy].uncertain is None
    assert b'"uncertain":true' in deferred[rcpt].to_json()
    lines = [r.getMessage() for r in caplog.records if qid in r.getMessage()]
    [line] = [x for x in lines if f"to=<{rcpt}>" in x]
    assert "outcome=deferred" in line and "uncertain=yes" in line
    [other] = [x for x in lines if f"to=<{busy}>" in x]
    assert "uncertain" not in other
    registry = seen.metrics.registry
    assert registry.get_sample_value("jsqueue_delivery_uncertain_total") == 1
    sample = registry.get_sample_value("jsqueue_delivery_attempts_total", {"outcome": "deferred"})
    assert sample == 2
