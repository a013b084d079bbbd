"""Leases after a crash (issue item 4): a worker that restarts with the same lease owner
takes its own leases back when the work items return, a dead worker's lease is taken over
after the presence grace, a live worker's lease is never taken (a second worker of the same
name runs under a suffixed name), and the operators' ``queue flush --break-lease`` and
``queue requeue``. Real nats-server, DNS and a scripted MX that holds the reply to the final
dot, so that a lease stays taken while the worker is killed."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_admin import DEST_ZONE, MESSAGE, RCPT
from test_cli import jsqueue, queue_env

from jsqueue.admin import Admin
from jsqueue.envelope import Entry, RecipientState, utcnow
from jsqueue.errors import StoreUnavailable
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.state import claim
from jsqueue.store import presence as presence_mod
from jsqueue.store.jetstream.work import JetStreamDue
from jsqueue.store.memory import MemoryPresence
from jsqueue.views import Outcome
from jsqueue.worker import Worker
from support.mx import SILENT, ScriptedMx
from support.nats import ACK_WAIT_S
from support.queue import Harness, eventually

DOMAIN = "dest.example.test"
#: Long: every delivery below must happen long before a lease of this length runs out.
LEASE_S = 600.0
GRACE_S = 2.0


async def start(w: Worker) -> tuple[asyncio.Task[None], asyncio.Event]:
    stop = asyncio.Event()
    return asyncio.create_task(w.run(stop)), stop


async def kill(w: Worker, task: asyncio.Task[None]) -> None:
    """Stands for kill -9: deliveries end without giving anything back (no lease released,
    no NAK), heartbeats and presence stop, nothing is drained."""

    async def nothing(due: JetStreamDue, uncertain: bool) -> None:
        return None

    w._give_back = nothing  # type: ignore[assignment,method-assign]
    handlers = list(w._tasks)
    task.cancel()
    for t in handlers:
        t.cancel()
    await asyncio.gather(task, *handlers, return_exceptions=True)


async def leased(h: Harness, qid: str, owner: str) -> bool:
    e: Entry | None = await h.entry(qid)
    return e is not None and DOMAIN in e.leases and e.leases[DOMAIN].owner == owner


def configure(h: Harness) -> None:
    h.dns.add(DEST_ZONE)
    h.configure(worker={"lease_s": LEASE_S, "presence_grace_s": GRACE_S})


async def crashed_mid_delivery(h: Harness, mx: ScriptedMx, owner: str) -> str:
    """Submit one message; a worker named ``owner`` claims it, sends it and sits in the
    wait for the reply to the final dot; then it is killed. Returns the queue id."""
    qid = await h.submit(MESSAGE, [RCPT])
    w1 = h.worker(owner=owner)
    task, _ = await start(w1)
    await mx.wait_for(lambda: mx.held == 1, timeout_s=15)
    assert await leased(h, qid, owner)
    await kill(w1, task)
    mx.hold = None  # later sessions are answered at once
    return qid


async def test_restarted_worker_takes_its_own_lease_back(queue_harness: Harness) -> None:
    """A worker killed while delivering and restarted with the same lease owner delivers
    the message soon after the work item comes back (ack wait), not after the lease."""
    h = queue_harness
    configure(h)
    async with ScriptedMx("127.0.2.20", h.mx_port, hold=asyncio.Event()) as mx:
        qid = await crashed_mid_delivery(h, mx, "pod-a")
        began = time.monotonic()
        w2 = h.worker(owner="pod-a")
        async with h.running(w2):
            await eventually(lambda: len(mx.delivered) == 1, timeout_s=20, what="redelivered")
        took = time.monotonic() - began
        assert w2.owner == "pod-a"  # the dead process's mark expired: the name is ours
        assert took < ACK_WAIT_S + GRACE_S + 15 < LEASE_S
        assert await h.entry(qid) is None


async def test_dead_workers_lease_is_taken_over_after_the_grace(queue_harness: Harness) -> None:
    """Another worker finds the destination leased by pod-a, sees pod-a is not present
    (no heartbeat within the grace) and takes the lease over by compare-and-set."""
    h = queue_harness
    configure(h)
    async with ScriptedMx("127.0.2.20", h.mx_port, hold=asyncio.Event()) as mx:
        qid = await crashed_mid_delivery(h, mx, "pod-a")
        began = time.monotonic()
        w2 = h.worker(owner="pod-b")
        async with h.running(w2):
            await eventually(lambda: len(mx.delivered) == 1, timeout_s=25, what="taken over")
        assert time.monotonic() - began < ACK_WAIT_S + 2 * GRACE_S + 15 < LEASE_S
        assert w2.owner == "pod-b"
        assert await h.entry(qid) is None


async def test_a_lease_of_a_process_that_restarted_under_its_name_is_taken_over_at_once(
    queue_harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """pod-a is killed mid-delivery and restarts under its name: its new process's
    presence stands, but the lease names the dead process (its instance). Another worker
    that gets the item takes the lease over as soon as the item comes back, rather than
    taking pod-a for alive and putting the mail back until the lease runs out (600 s); the
    takeover is logged as a possible duplicate (RFC 5321 §6.1)."""
    h = queue_harness
    configure(h)
    presence = h.stores.presence
    assert presence is not None
    async with ScriptedMx("127.0.2.20", h.mx_port, hold=asyncio.Event()) as mx:
        qid = await crashed_mid_delivery(h, mx, "pod-a")
        restarted = presence_mod.Liveness(LEASE_S)
        await presence.beat("pod-a", "restarted-process", LEASE_S)
        beats = asyncio.create_task(
            presence_mod.keep_alive(presence, "pod-a", "restarted-process", LEASE_S, restarted)
        )
        try:
            w2 = h.worker(owner="pod-b")
            with caplog.at_level(logging.WARNING, logger="jsqueue.worker"):
                async with h.running(w2):
                    await eventually(
                        lambda: len(mx.delivered) == 1, ACK_WAIT_S + 15, what="taken over"
                    )
        finally:
            beats.cancel()
        assert (await presence.seen("pod-a")) is not None, "pod-a was present throughout"
        assert await h.entry(qid) is None
    [line] = [r.getMessage() for r in caplog.records if "possible duplicate" in r.getMessage()]
    assert "lease of a dead worker pod-a taken over" in line and "reached DATA" in line


async def test_a_worker_that_took_another_name_holds_its_sites_under_it(
    queue_harness: Harness,
) -> None:
    """A worker whose name a live worker uses runs as ``<name>-<random>``; its destination
    limits (slots, demand, probes) carry that name too, not the one it was built with:
    two workers of one host would otherwise share one demand key, each keeping the whole
    fair share, and ``dest show`` would name the wrong one."""
    h = queue_harness
    configure(h)
    presence = h.stores.presence
    assert presence is not None
    await presence.beat("pod-a", "a-live-process", LEASE_S)
    w = h.worker(owner="pod-a")
    await w.take_name()
    assert w.owner.startswith("pod-a-")
    assert w.sites is not None
    assert w.sites.owner == w.sites.shared.owner == w.owner


async def test_live_workers_lease_is_never_taken(queue_harness: Harness) -> None:
    """A second worker started with the name of a live one runs under a suffixed name;
    neither it nor a flush takes the live worker's lease; the message is sent once."""
    h = queue_harness
    configure(h)
    hold = asyncio.Event()
    async with ScriptedMx("127.0.2.20", h.mx_port, hold=hold) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        w1 = h.worker(owner="pod-a")
        async with h.running(w1):
            await mx.wait_for(lambda: mx.held == 1, timeout_s=15)
            w2 = h.worker(owner="pod-a")
            async with h.running(w2):
                await eventually(lambda: w2.owner != "pod-a", timeout_s=10, what="renamed")
                assert w2.owner.startswith("pod-a-")
                flush = await Admin(h.stores).flush(qid)
                assert flush.outcome is Outcome.UNCHANGED and "pod-a" in flush.detail
                await asyncio.sleep(ACK_WAIT_S + GRACE_S)
                assert await leased(h, qid, "pod-a")
                assert mx.connections == 1
                hold.set()
                await eventually(lambda: len(mx.delivered) == 1, timeout_s=15, what="sent")
                await asyncio.sleep(1.0)
        assert len(mx.delivered) == 1


async def test_cli_flush_break_lease_and_requeue(
    queue_harness: Harness, nats_server: EmbeddedNats, names: Names
) -> None:
    """``queue flush`` breaks the lease of an owner that is not present and refuses a live
    one, saying so; ``--break-lease`` breaks a live one with the warning; ``queue requeue``
    drops a live lease with the same warning, bumps the generation, keeps the attempts and
    makes the message due now."""
    h = queue_harness
    configure(h)
    env = queue_env(nats_server, names)
    presence = h.stores.presence
    assert presence is not None
    await presence.beat("pod-live", "its-process", 600.0)
    qid = await h.submit(MESSAGE, [RCPT])

    async def lease(owner: str, attempts: int = 0) -> Entry:
        v = await h.stores.entries.get(qid)
        entry = v.entry.model_copy(deep=True)
        entry.recipients[0].attempts = attempts
        entry = claim(entry, DOMAIN, owner, utcnow(), LEASE_S)
        await h.stores.entries.update(entry, v.revision)
        return entry

    await lease("pod-dead")
    safe = await jsqueue("queue", "flush", qid, env=env)
    assert safe.code == 0, safe
    assert "lease of pod-dead broken" in safe.out
    e = await h.entry(qid)
    assert e is not None and DOMAIN not in e.leases

    before = await lease("pod-live")
    refused = await jsqueue("queue", "flush", qid, env=env)
    assert "pod-live" in refused.out and await leased(h, qid, "pod-live")
    broken = await jsqueue("queue", "flush", "--break-lease", qid, env=env)
    assert broken.code == 0, broken
    assert "sent twice" in broken.err
    assert "live lease of pod-live broken" in broken.out
    e = await h.entry(qid)
    assert e is not None and DOMAIN not in e.leases and e.generation > before.generation

    before = await lease("pod-live", attempts=3)
    requeue = await jsqueue("queue", "requeue", qid, "--json", env=env)
    assert requeue.code == 0, requeue
    assert "sent twice" in requeue.err
    [result] = requeue.json_lines()[0]["results"]  # type: ignore[misc]
    assert result["outcome"] == "done" and "pod-live" in result["detail"]
    e = await h.entry(qid)
    assert e is not None and DOMAIN not in e.leases and e.generation > before.generation
    r = e.recipients[0]
    assert r.attempts == 3 and r.state is RecipientState.DEFERRED
    assert r.next_attempt_at is not None and r.next_attempt_at <= utcnow()


def worker_env(h: Harness, nats_server: EmbeddedNats, tmp_path: Path) -> dict[str, str]:
    """The environment of a ``jsqueue worker`` process on the harness's queue, named
    ``pod-k``, with a long lease and a short presence grace."""
    return {
        **os.environ,
        "JSQUEUE_NATS__URLS": f'["{nats_server.url}"]',
        "JSQUEUE_NATS__PREFIX": h.settings.nats.prefix,
        "JSQUEUE_NATS__ACK_WAIT_S": str(h.settings.nats.ack_wait_s),
        "JSQUEUE_WORKER__MX_PORT": str(h.mx_port),
        "JSQUEUE_WORKER__NAMESERVERS": f'["{h.dns.host}"]',
        "JSQUEUE_WORKER__NAMESERVER_PORT": str(h.dns.port),
        "JSQUEUE_WORKER__LEASE_S": str(LEASE_S),
        "JSQUEUE_WORKER__LEASE_OWNER": "pod-k",
        "JSQUEUE_WORKER__PRESENCE_GRACE_S": str(GRACE_S),
        "JSQUEUE_WORKER__BODY_CACHE_DIR": str(tmp_path / "proc-cache"),
        "JSQUEUE_HTTP__ENABLED": "false",
        "JSQUEUE_RECONCILER__ENABLED": "false",
    }


async def spawn_worker(env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        "worker",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


async def test_sigkilled_worker_process_restarted_with_its_name(
    queue_harness: Harness, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """kill -9 of a ``jsqueue worker`` process mid-delivery (the MX never answers the final
    dot); a new process with the same ``worker.lease_owner`` delivers the message soon after
    the work item comes back, long before the 600 s lease would run out."""
    h = queue_harness
    configure(h)
    env = worker_env(h, nats_server, tmp_path)
    async with ScriptedMx("127.0.2.20", h.mx_port, end_of_data=SILENT) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        first = await spawn_worker(env, tmp_path / "first.log")
        second: asyncio.subprocess.Process | None = None
        try:
            await eventually(
                lambda: any(s.transactions for s in mx.sessions), 30, what="first worker at DATA"
            )
            assert await leased(h, qid, "pod-k")
            first.send_signal(signal.SIGKILL)
            await asyncio.wait_for(first.wait(), 10)
            mx.end_of_data = "250 2.0.0 ok"
            began = time.monotonic()
            second = await spawn_worker(env, tmp_path / "second.log")
            await eventually(
                lambda: len(mx.delivered) == 1,
                ACK_WAIT_S + GRACE_S + 25,
                what="delivered by the restarted process",
            )
            assert time.monotonic() - began < LEASE_S / 10
        finally:
            for proc in (first, second):
                if proc is not None and proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    assert [t.rcpt_to for t in mx.delivered] == [[RCPT]]


async def test_a_worker_started_while_the_presence_bucket_elects_a_leader_waits_for_it() -> None:
    """A worker started while the presence bucket's stream has no leader (a cluster
    starting, a node lost: "no response from stream") tries again instead of stopping its
    process; one whose bucket stays unavailable for the whole grace still fails."""

    class Electing(MemoryPresence):
        def __init__(self, refusals: int) -> None:
            super().__init__()
            self.refusals = refusals

        async def beat(
            self, owner: str, instance: str, ttl_s: float, *, first: bool = False
        ) -> bool:
            if self.refusals > 0:
                self.refusals -= 1
                raise StoreUnavailable(f"presence {owner}: write: nats: no response from stream")
            return await super().beat(owner, instance, ttl_s, first=first)

    store = Electing(refusals=2)
    liveness = presence_mod.Liveness(3.0)
    name = await presence_mod.take_name(store, "w1", "pid-1", 3.0, liveness)
    assert name == "w1" and store.refusals == 0
    assert (await store.seen("w1")) is not None
    with pytest.raises(StoreUnavailable, match="no response from stream"):
        await presence_mod.take_name(Electing(refusals=100), "w2", "pid-2", 0.6, liveness)
