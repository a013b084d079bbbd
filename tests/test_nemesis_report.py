"""The fault soak's checker (``bench/nemesis_report.py``) on made-up records: what counts as
lost, which duplicates are explained, refusals with a quorum, the longest refusal window."""

from __future__ import annotations

import sys
from pathlib import Path

from support.cluster import Attempt, CountingMx, Load
from support.mx import Session, Transaction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from nemesis_report import (  # bench/ is put on the path just above
    Death,
    Fault,
    LogLine,
    Summary,
    check_clients,
    check_sink,
    check_worker_logs,
    count_refusals_with_quorum,
    explain_duplicates,
    resent_messages,
)

DOMAIN = "sink.example.test"
#: Monotonic 10.0 with the wall clock offset 1000 s the tests use.
ISO_10 = "1970-01-01T00:16:50+00:00"


def rcpt(index: int) -> str:
    return f"m{index}@{DOMAIN}"


def summary() -> Summary:
    return Summary(seed=1, duration_s=60.0, rate_per_s=10.0, shortened={})


def sink(*copies: tuple[float, int, str]) -> CountingMx:
    """A sink that received message ``index`` at ``at`` from client ``ehlo``, per copy."""
    mx = CountingMx("127.0.0.1", 0)
    for at, index, ehlo in copies:
        tx = Transaction(mail_from="a@b.test", mail_params=[], rcpt_to=[rcpt(index)])
        tx.reply = "250 2.0.0 ok"
        mx.sessions.append(Session(peer=None, commands=[f"EHLO {ehlo}"], transactions=[tx]))
        mx.accepted.append((at, tx))
        mx.arrivals.append((at, rcpt(index)))
    return mx


def delivered(worker: str, wall: float, index: int, queue_id: str = "q") -> LogLine:
    fields = {"outcome": "delivered", "recipient": rcpt(index), "queue_id": queue_id}
    return LogLine(worker, wall, {"message": "queue=...", **fields})


def test_lost_latency_and_duplicates() -> None:
    load = Load([Attempt(1, 0.0, 1.0, 250, "q1"), Attempt(2, 0.0, 1.0, 250, "q2")])
    s = summary()
    copies = check_sink(s, {"fe": load}, sink((3.0, 1, "w1"), (5.0, 1, "w2")), rcpt)
    assert (s.lost, s.lost_examples) == (1, [f"{rcpt(2)} queue id q2"])
    assert s.latency_p50_s == 2.0
    assert s.duplicates == 1
    assert copies[rcpt(1)] == [(3.0, "w1"), (5.0, "w2")]


def test_a_copy_before_its_worker_was_killed_is_explained() -> None:
    copies = {rcpt(1): [(10.0, "w1"), (40.0, "w2")], rcpt(2): [(10.0, "w2"), (40.0, "w1")]}
    kill = Fault("worker-kill", "worker-1", at=11.0, wall=1011.0)
    # worker-2 recorded m2 before anything stopped it: its second copy is a fault
    logs = [delivered("worker-2", 1010.5, 2)]
    s = summary()
    workers = {"w1": "worker-1", "w2": "worker-2"}
    explain_duplicates(s, copies, [kill], logs, workers, resent={}, wall_offset_s=1000.0)
    assert s.duplicates_explained == {"worker-kill before its record": 1}
    assert s.duplicates_unexplained == [f"{rcpt(2)} by worker-2 at {ISO_10}"]


def test_a_copy_recorded_before_the_kill_is_not_explained_by_it() -> None:
    copies = {rcpt(1): [(10.0, "w1"), (40.0, "w2")]}
    kill = Fault("worker-term", "worker-1", at=12.0, wall=1012.0)
    s = summary()
    logs = [delivered("worker-1", 1010.2, 1)]
    explain_duplicates(s, copies, [kill], logs, {"w1": "worker-1"}, resent={}, wall_offset_s=1000.0)
    assert len(s.duplicates_unexplained) == 1


def test_a_message_stored_twice_after_a_lost_connection_is_explained() -> None:
    load = Load([Attempt(1, 0.0, 1.0, None), Attempt(1, 1.5, 2.0, 250, "q2")])
    copies = {rcpt(1): [(3.0, "w1"), (4.0, "w1")]}
    logs = [delivered("worker-1", 1003.0, 1, "q1"), delivered("worker-1", 1004.0, 1, "q2")]
    s = summary()
    resent = resent_messages({"fe": load}, rcpt)
    explain_duplicates(s, copies, [], logs, {"w1": "worker-1"}, resent, wall_offset_s=1000.0)
    assert s.duplicates_explained == {"stored twice: the client resent after a lost connection": 1}


def test_refusals_windows_and_quorum() -> None:
    load = Load(
        [
            Attempt(1, 10.0, 10.1, 451),
            Attempt(1, 12.0, 12.1, 451),
            Attempt(1, 14.0, 14.5, 250, "q1"),
            Attempt(2, 30.0, 30.1, 451),
            Attempt(2, 31.0, 31.2, 250, "q2"),
            Attempt(3, 40.0, 40.1, None),
            Attempt(3, 41.0, 41.1, 250, "q3"),
        ]
    )
    s = summary()
    check_clients(s, {"frontend-1": load}, t0=0.0)
    assert (s.accepted, s.refusals, s.connections_lost) == (3, 3, 1)
    assert s.longest_refusal_window_s == 4.5
    assert s.longest_refusal_window_at == "frontend-1, message 1"
    pause = Fault("nats-pause", "jsqueue-1", at=9.0, wall=0.0, back_at=20.0)
    death = Death("jsqueue-2", at=11.0, returncode=None, tail="")
    count_refusals_with_quorum(s, {"frontend-1": load}, [pause], [death])
    assert s.refusals_with_quorum == 2  # the one at 12 s: two nodes out


def test_store_trouble_deferrals() -> None:
    lines = [
        LogLine("worker-1", 0.0, {"outcome": "deferred", "reply": "451 4.3.0 body unreadable"}),
        LogLine("worker-1", 0.0, {"outcome": "deferred", "reply": "421 4.4.2 timeout"}),
        LogLine("worker-2", 0.0, {"message": "queue q: store unavailable: nats: timeout"}),
    ]
    s = summary()
    check_worker_logs(s, lines)
    assert (s.deferrals, s.store_trouble_deferrals, s.store_unavailable_lines) == (2, 1, 1)


def test_a_record_the_worker_logged_as_failed_after_the_copy_explains_it() -> None:
    copies = {rcpt(1): [(10.0, "w1"), (40.0, "w2")], rcpt(2): [(10.0, "w1"), (40.0, "w2")]}
    logs = [
        delivered("worker-1", 1012.0, 1, "q1"),
        LogLine("worker-1", 1012.0, {"message": "queue q1: store unavailable: nats: timeout"}),
        # before the copy arrived: about its first read, not its record
        LogLine("worker-1", 1005.0, {"message": "queue q2: store unavailable: nats: timeout"}),
        delivered("worker-1", 1012.0, 2, "q2"),
    ]
    s = summary()
    explain_duplicates(s, copies, [], logs, {"w1": "worker-1"}, {}, wall_offset_s=1000.0)
    assert s.duplicates_explained == {"record failed (logged)": 1}
    assert s.duplicates_unexplained == [f"{rcpt(2)} by worker-1 at {ISO_10}"]
