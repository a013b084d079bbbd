"""Store faults on a three-node nats-server cluster (DESIGN.md §6: a node loss stalls writes
for a Raft election, ~4–9 s measured): what the queue's processes do while one node is
lost, silent or lagging, and while the cluster has no quorum. Real nats-server processes,
jsqueue processes started through the CLI, a DNS server and MXes, all on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from jsqueue.config import NatsSettings, ReconcilerSettings, Settings
from jsqueue.metrics import Metrics
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_cluster import EmbeddedCluster
from jsqueue.reconciler import open_reconciler
from jsqueue.runtime import build_worker
from jsqueue.store.base import BodyInfo, Stores
from jsqueue.store.jetstream import close_nats, connect_nats, open_jetstream
from jsqueue.store.jetstream.bodies import JetStreamBodyStore
from support.cluster import CountingMx, JsqueueProc, Load, free_port, jsqueue_env, send_load
from support.dns import DnsServer
from support.mx import shared_port
from support.nats import chunks_of
from support.queue import MX_HOSTS, eventually
from support.queue import test_settings as harness_settings

# Node-loss scenarios bound how soon mail flows again: alone, not beside the parallel suite.
pytestmark = pytest.mark.serial


SINK = "sink.example.test"
SINK_IP = "127.0.2.131"  # one of MX_HOSTS[:140]
ZONE = f"{SINK}. 300 IN MX 10 mx.{SINK}.\nmx.{SINK}. 300 IN A {SINK_IP}\n"
#: smtp.store_timeout_s in these tests, seconds: what a client may wait before a 451.
STORE_TIMEOUT_S = 30.0


def front_end_settings(nats: NatsSettings, dns: DnsServer, tmp_path: Path, **smtp: Any) -> Settings:
    """The harness's test settings on the cluster with a free SMTP port."""
    settings = harness_settings(nats, dns, free_port(), tmp_path / "cache")
    update = {"port": free_port(), "store_timeout_s": STORE_TIMEOUT_S, **smtp}
    return settings.model_copy(update={"smtp": settings.smtp.model_copy(update=update)})


@asynccontextmanager
async def front_ends(
    settings: Settings, tmp_path: Path, n: int
) -> AsyncIterator[list[tuple[JsqueueProc, int]]]:
    """``n`` ``jsqueue smtp`` processes, each on its own port, with the port; SIGKILLed at exit."""
    procs: list[tuple[JsqueueProc, int]] = []
    try:
        for i in range(n):
            port = free_port() if i else settings.smtp.port
            env = jsqueue_env(settings)
            env["JSQUEUE_SMTP__PORT"] = str(port)
            proc = JsqueueProc(["smtp"], env, tmp_path / f"smtp-{i}.log")
            procs.append((proc, port))
            await proc.start(r"listening on [\d.]+:\d+")
        yield procs
    finally:
        for proc, _ in procs:
            await proc.kill()


def replies(load: Load) -> dict[str, int]:
    """How many tries got each reply code ("no reply": the connection broke)."""
    out: dict[str, int] = {}
    for a in load.attempts:
        key = str(a.code) if a.code is not None else "no reply"
        out[key] = out.get(key, 0) + 1
    return out


# --------------------------------------------------------------------------- ingest


@pytest.mark.timeout(240)
async def test_losing_the_leading_node_delays_clients_and_refuses_none(
    nats_cluster: EmbeddedCluster,
    cluster_settings: NatsSettings,
    cluster_stores: Stores,
    names: Names,
    tmp_path: Path,
) -> None:
    """The node leading the bodies, entries, ingest-log and work streams is SIGKILLed
    during a burst of 40 messages over two front ends: every client gets its 250, the
    ones caught in the election after a delay, and none a 4xx or a broken connection
    (each write of the ingest path is retried with its message id until
    smtp.store_timeout_s). The longest stall a client saw is printed."""
    victim = await nats_cluster.stream_leader(f"OBJ_{names.bodies_bucket}")
    for stream in (f"KV_{names.entries_bucket}", f"KV_{names.ingest_bucket}", names.work_stream):
        await nats_cluster.move_leader(stream, victim)
    with DnsServer(ZONE) as dns:
        settings = front_end_settings(cluster_settings, dns, tmp_path)
        async with front_ends(settings, tmp_path, 2) as procs:
            load = Load()
            sending = [
                asyncio.create_task(
                    send_load("127.0.0.1", port, 20, SINK, first=20 * i, clients=6, load=load)
                )
                for i, (_, port) in enumerate(procs)
            ]
            await eventually(lambda: len(load.accepted()) >= 4, 60, what="the first 250s")
            killed_at = time.monotonic()
            nats_cluster.node(victim).kill()
            await asyncio.wait_for(asyncio.gather(*sending), 180)
    caught = [a for a in load.attempts if a.ended > killed_at]
    stall = max(a.ended - max(a.started, killed_at) for a in caught)
    print(
        f"\nleader {victim} killed in a burst of 40: replies {replies(load)}; longest stall "
        f"of a client {stall:.1f} s (store_timeout_s {STORE_TIMEOUT_S:g} s)"
    )
    assert len(load.accepted()) == 40
    assert replies(load) == {"250": 40}, "a delay, never a 4xx"
    assert stall < STORE_TIMEOUT_S
    for i, a in load.accepted().items():  # each stored once, under the id answered
        assert a.queue_id is not None
        assert (await cluster_stores.entries.get(a.queue_id)).entry.recipients[0].address == (
            f"m{i}@{SINK}"
        )


@pytest.mark.timeout(240)
async def test_a_paused_node_costs_its_clients_a_delay_not_their_mail(
    nats_cluster: EmbeddedCluster,
    cluster_settings: NatsSettings,
    cluster_stores: Stores,
    tmp_path: Path,
) -> None:
    """The node a front end is connected to is stopped (SIGSTOP: alive, TCP connections
    open, silent) while clients send: the front end notices the silence (PINGs
    unanswered) and reconnects to a healthy node, so every message gets its 250 within
    smtp.store_timeout_s, none a 4xx, while the two others keep a quorum. The longest
    stall a client saw is printed. The node is resumed (SIGCONT) at the end."""
    assert cluster_stores  # the queue is provisioned
    with DnsServer(ZONE) as dns:
        settings = front_end_settings(cluster_settings, dns, tmp_path)
        async with front_ends(settings, tmp_path, 1) as [(proc, port)]:
            found = await proc.wait_for_log(r"nats: connected to [\w.]+:(\d+)")
            victim = next(n for n in nats_cluster.nodes if n.port == int(found.group(1)))
            assert victim.pid is not None
            # a few messages first: the front end's path is warm, its node is the victim
            assert len((await send_load("127.0.0.1", port, 4, SINK, clients=2)).accepted()) == 4
            os.kill(victim.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                load = await send_load(
                    "127.0.0.1", port, 20, SINK, first=4, clients=20, max_tries=1
                )
                reconnected = "nats: reconnected to" in proc.log()
            finally:
                os.kill(victim.pid, signal.SIGCONT)
    stall = max(a.ended - a.started for a in load.attempts)
    print(
        f"\nnode paused under a front end: replies {replies(load)}; longest stall of a "
        f"client {stall:.1f} s; all sent {time.monotonic() - stopped_at:.1f} s after the "
        f"pause began (store_timeout_s {STORE_TIMEOUT_S:g} s)"
    )
    assert replies(load) == {"250": 20}, "a delay, never a 4xx"
    assert stall < STORE_TIMEOUT_S
    assert reconnected, "moved to a healthy node"


# --------------------------------------------------------------------------- body reads


async def lead_everything(cluster: EmbeddedCluster, names: Names, node: str) -> None:
    """Make ``node`` the leader of the queue's streams and of the work consumer."""
    streams = (f"OBJ_{names.bodies_bucket}", f"KV_{names.entries_bucket}", names.work_stream)
    for stream in streams:
        await cluster.move_leader(stream, node)
    await cluster.move_leader(names.work_stream, node, consumer=names.work_consumer)


#: Bodies stored while the replica is paused, per round: its catch-up outlasts the reads.
BODIES = 100
#: Rounds of pause, writes, reads and resume.
ROUNDS = 5


@pytest.mark.timeout(120)
async def test_a_body_read_answered_by_a_lagging_replica_is_confirmed_on_the_leader(
    nats_cluster: EmbeddedCluster,
    cluster_settings: NatsSettings,
    cluster_stores: Stores,
    names: Names,
) -> None:
    """Bodies stored while a replica was paused, read through that replica right as it
    resumes (the reads wait in its socket, so it answers them before it has caught up):
    every body is read whole; a "not found" from the replica is asked again of the
    stream leader instead of being believed."""
    lagging = nats_cluster.nodes[2]
    assert lagging.pid is not None
    await lead_everything(nats_cluster, names, "jsqueue-1")
    # stays on the lagging node while it is paused (PINGs rare)
    near = cluster_settings.model_copy(update={"urls": [lagging.url], "ping_interval_s": 600.0})
    nc = await connect_nats(near, [lagging.url])
    through_lagging = JetStreamBodyStore(nc, names, timeout_s=10.0)

    async def read(qid: str, expect: BodyInfo | None) -> bytes | Exception:
        try:
            return b"".join([c async for c in through_lagging.open(qid, expect=expect)])
        except Exception as e:  # counted below
            return e

    failed: list[tuple[str, Exception]] = []
    try:
        await through_lagging.meta(new_queue_id())  # the connection is up
        for _ in range(ROUNDS):  # whether the replica answers before it caught up varies
            os.kill(lagging.pid, signal.SIGSTOP)
            try:
                bodies = {}
                for i in range(BODIES):
                    data = f"Subject: {i}\r\n\r\n".encode() + b"x" * 2000
                    qid = new_queue_id()
                    info = await cluster_stores.bodies.put(qid, chunks_of(data), fresh=True)
                    bodies[qid] = (data, info)
                reads = [
                    asyncio.ensure_future(read(q, info if n % 2 else None))
                    for n, (q, (_, info)) in enumerate(bodies.items())
                ]
                await asyncio.sleep(0.2)  # the requests reach the paused node's socket
            finally:
                os.kill(lagging.pid, signal.SIGCONT)
            got = await asyncio.gather(*reads)
            failed += [(q, g) for q, g in zip(bodies, got, strict=True) if isinstance(g, Exception)]
            assert [g for g in got if not isinstance(g, Exception)] == [
                data
                for (data, _), g in zip(bodies.values(), got, strict=True)
                if not isinstance(g, Exception)
            ]
    finally:
        await close_nats(nc)
    print(
        f"\nbodies read through a replica just resumed: {len(failed)} of {ROUNDS * BODIES} failed"
    )
    assert failed == [], failed[:3]


@pytest.mark.timeout(180)
async def test_a_body_store_outage_costs_the_mail_no_backoff_step(
    nats_cluster: EmbeddedCluster,
    cluster_settings: NatsSettings,
    cluster_stores: Stores,
    names: Names,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker whose body reads go through a node that is paused while it delivers: the
    reads fail (after their retries on the leader), the transaction is abandoned before its
    final dot, and the destination is given back for a few seconds: not deferred for
    retry.base_s (300 s here), not counted as an attempt. Once the node resumes, the mail
    is delivered, once."""
    caplog.set_level(logging.INFO, logger="jsqueue.worker")
    await lead_everything(nats_cluster, names, "jsqueue-1")
    healthy = [n.url for n in nats_cluster.nodes[:2]]
    paused = nats_cluster.nodes[2]
    assert paused.pid is not None
    nats = cluster_settings.model_copy(update={"urls": healthy})
    stores = await open_jetstream(nats, names=names)
    # The body store's own connection, to the node paused: it does not leave the node
    # while it is silent (PINGs rare), so its reads fail until the node resumes.
    slow = nats.model_copy(
        update={"urls": [paused.url], "request_timeout_s": 1.0, "ping_interval_s": 600.0}
    )
    nc = await connect_nats(slow, [paused.url])
    stop = asyncio.Event()
    resumed = False
    try:
        worker_stores = dataclasses.replace(
            stores, bodies=JetStreamBodyStore(nc, names, timeout_s=1.0)
        )
        with DnsServer(ZONE) as dns:
            port = shared_port(MX_HOSTS[:140])
            settings = harness_settings(
                nats, dns, port, tmp_path / "cache", retry={"base_s": 300.0}
            )
            fe = front_end_settings(nats, dns, tmp_path)
            async with CountingMx(SINK_IP, port) as mx, front_ends(fe, tmp_path, 1) as [(_, smtp)]:
                worker = build_worker(settings, worker_stores)
                running = asyncio.create_task(worker.run(stop))
                # (its presence bucket is made first: an R3 stream needs every node)
                await eventually(lambda: "worker running" in caplog.text, 30, what="running")
                os.kill(paused.pid, signal.SIGSTOP)
                load = await send_load("127.0.0.1", smtp, 1, SINK, clients=1)
                [sent] = load.accepted().values()
                # the attempt's end: given back (or, recorded, deferred)
                ended = ("the queue's own trouble, not counted", "outcome=deferred")
                await eventually(
                    lambda: any(e in caplog.text for e in ended), 60, what="a failed read"
                )
                os.kill(paused.pid, signal.SIGCONT)
                resumed = True
                await eventually(lambda: bool(mx.arrivals), 60, what="the delivery")
                stop.set()
                await asyncio.wait_for(running, 30)
    finally:
        if not resumed:
            os.kill(paused.pid, signal.SIGCONT)
        stop.set()
        await close_nats(nc)
        await stores.close()
    assert mx.copies() == {f"m0@{SINK}": 1}
    assert "outcome=deferred" not in caplog.text
    assert sent.queue_id is not None
    assert cluster_stores  # the queue was provisioned on every node


# --------------------------------------------------------------------------- reconciler


async def test_failed_reconciler_passes_back_off(
    nats_cluster: EmbeddedCluster, cluster_settings: NatsSettings, cluster_stores: Stores
) -> None:
    """Two nodes of three are killed (no quorum: the survivor answers every write "no
    response from stream" at once) while a recovery pass is wanted: the failed passes are
    counted, and each is followed by a growing pause instead of the next pass at once
    (thousands of passes in seconds before). Once the nodes are back, a pass succeeds."""
    reconciler = ReconcilerSettings(
        recovery_margin_s=0.1, failed_pass_pause_s=0.5, failed_pass_pause_max_s=4.0
    )
    settings = Settings(nats=cluster_settings, reconciler=reconciler)
    assert cluster_stores  # the queue is provisioned
    rec = await open_reconciler(settings, cluster_settings.urls)
    metrics = Metrics()
    metrics.watch_reconciler(lambda: rec.failed_passes)
    stop = asyncio.Event()
    try:
        await rec.run_once()  # the lock is this reconciler's
        nats_cluster.node(2).kill()
        nats_cluster.node(3).kill()
        running = asyncio.create_task(rec.run(stop))
        rec.nats_reconnected()
        await eventually(lambda: rec.failed_passes >= 1, 20, what="a failed pass")
        # The count over a fixed window is what is measured: 6 s after the first failure.
        # Pauses of at least 0.25, 0.5, 1, 2, 2 s allow 6 passes at most in it.
        first = rec.failed_passes
        await asyncio.sleep(6.0)
        failed = rec.failed_passes - first
        text = generate_latest(metrics.registry).decode()
        assert f"jsqueue_reconciler_failed_passes_total {float(rec.failed_passes)}" in text
        print(f"\nno quorum: {failed} failed reconciler passes in 6 s after the first")
        # (at most: a pass that waits out its requests' timeouts may take the whole window)
        assert failed <= 6, failed
        passes = rec.passes
        await nats_cluster.node(2).start()
        await nats_cluster.node(3).start()
        await eventually(lambda: rec.passes > passes, 60, what="a pass once the quorum is back")
        stop.set()
        await asyncio.wait_for(running, 30)
    finally:
        stop.set()
        await rec.close()
