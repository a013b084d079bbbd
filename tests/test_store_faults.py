"""Store faults on a three-node nats-server cluster (DESIGN.md §6: a node loss stalls writes
for a Raft election, ~4–9 s measured): what the queue's processes do while one node is
lost, silent or lagging, and while the cluster has no quorum. Real nats-server processes,
jsqueue processes started through the CLI, a DNS server and MXes, all on loopback.
"""

from __future__ import annotations

import asyncio
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
from jsqueue.names import Names
from jsqueue.nats_cluster import EmbeddedCluster
from jsqueue.reconciler import open_reconciler
from jsqueue.store.base import Stores
from support.cluster import JsqueueProc, Load, free_port, jsqueue_env, send_load
from support.dns import DnsServer
from support.queue import eventually
from support.queue import test_settings as harness_settings

# Node-loss scenarios bound how soon mail flows again: alone, not beside the parallel suite.
pytestmark = pytest.mark.serial


SINK = "sink.example.test"
SINK_IP = "127.0.2.131"
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
        assert 2 <= failed <= 6, failed
        passes = rec.passes
        await nats_cluster.node(2).start()
        await nats_cluster.node(3).start()
        await eventually(lambda: rec.passes > passes, 60, what="a pass once the quorum is back")
        stop.set()
        await asyncio.wait_for(running, 30)
    finally:
        stop.set()
        await rec.close()
