"""Store faults on a three-node nats-server cluster (DESIGN.md §6: a node loss stalls writes
for a Raft election, ~4–9 s measured): what the queue's processes do while one node is
lost, silent or lagging, and while the cluster has no quorum. Real nats-server processes,
jsqueue processes started through the CLI, a DNS server and MXes, all on loopback.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from jsqueue.config import NatsSettings, ReconcilerSettings, Settings
from jsqueue.metrics import Metrics
from jsqueue.nats_cluster import EmbeddedCluster
from jsqueue.reconciler import open_reconciler
from jsqueue.store.base import Stores
from support.queue import eventually

# Node-loss scenarios bound how soon mail flows again: alone, not beside the parallel suite.
pytestmark = pytest.mark.serial


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
