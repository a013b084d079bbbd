"""Single node vs three-node cluster: the same load through the same jsqueue processes.

For each mode, started fresh in a temporary directory:

* **single**: one nats-server (:class:`~jsqueue.nats_server.EmbeddedNats`, ``nats/jsqueue.conf``:
  ``sync_interval: always``), every bucket and stream R1;
* **cluster**: three nats-servers (:class:`~jsqueue.nats_cluster.EmbeddedCluster`, the same
  ``sync_interval: always`` on every node), every bucket and stream R3 (a write is
  acknowledged once two of the three nodes have it);

then ``jsqueue smtp`` and ``--workers`` × ``jsqueue worker`` as real processes through the
CLI (``JSQUEUE_…`` settings, every node's URL), a DNS server and a counting sink MX on
loopback (``tests/support``), and ``--messages`` messages of about ``--size`` octets, each to
its own recipient, sent by ``--clients`` concurrent SMTP sessions.

Printed per mode: ingest rate (250s per second while the clients send), end-to-end rate
(messages per second from the first send until the sink has them all), 451 replies,
duplicates at the sink; then the cluster / single ratios. A benchmark, not a test: nothing is
asserted. Both modes share the machine's cores with every nats-server, so on a small box the
three-node figures include three servers' worth of CPU and fsyncs.

Usage::

    python bench/cluster.py [--messages 2000] [--clients 16] [--size 1024] [--workers 1]

Nothing leaves 127.0.0.0/8; every loop is bounded by ``--messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from jsqueue.config import (  # noqa: E402
    HttpSettings,
    NatsSettings,
    ReconcilerSettings,
    Settings,
    SmtpSettings,
    WorkerSettings,
)
from jsqueue.nats_cluster import EmbeddedCluster  # noqa: E402
from jsqueue.nats_server import EmbeddedNats  # noqa: E402
from support.cluster import (  # noqa: E402  (tests/ is put on the path just above)
    CountingMx,
    JsqueueProc,
    Load,
    free_port,
    jsqueue_env,
    send_load,
)
from support.dns import DnsServer  # noqa: E402
from support.mx import shared_port  # noqa: E402

DOMAIN = "sink.bench.example.test"
SINK_IP = "127.0.2.200"
ZONE = f"{DOMAIN}. 300 IN MX 10 mx.{DOMAIN}.\nmx.{DOMAIN}. 300 IN A {SINK_IP}\n"


@dataclass
class Result:
    """One mode's figures."""

    mode: str
    messages: int
    send_s: float
    end_to_end_s: float
    rejected: int
    duplicates: int

    @property
    def ingest_per_s(self) -> float:
        return self.messages / self.send_s

    @property
    def delivered_per_s(self) -> float:
        return self.messages / self.end_to_end_s


@contextlib.asynccontextmanager
async def nats_servers(mode: str, base: Path) -> AsyncIterator[list[str]]:
    """The servers of one mode; their URLs."""
    if mode == "single":
        async with EmbeddedNats(base / "nats", port=0) as server:
            yield [server.url]
    else:
        async with EmbeddedCluster(base / "cluster", 3, client_port=0) as cluster:
            yield cluster.urls


async def run_mode(mode: str, args: argparse.Namespace) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"jsq-bench-{mode}-") as tmp:
        base = Path(tmp)
        async with nats_servers(mode, base) as urls, contextlib.AsyncExitStack() as stack:
            dns = stack.enter_context(DnsServer(ZONE))
            port = shared_port([SINK_IP])
            mx = await stack.enter_async_context(CountingMx(SINK_IP, port))
            settings = Settings(
                nats=NatsSettings(urls=urls, replicas=1 if mode == "single" else 3),
                smtp=SmtpSettings(port=free_port(), max_sessions=1000),
                worker=WorkerSettings(
                    mx_port=port,
                    nameservers=dns.nameservers,
                    nameserver_port=dns.port,
                    concurrency=args.concurrency,
                    batch=args.concurrency,
                ),
                http=HttpSettings(enabled=False),
                reconciler=ReconcilerSettings(enabled=False),
            )
            env = {**jsqueue_env(settings), "JSQUEUE_LOG__LEVEL": "WARNING"}
            procs = [JsqueueProc(["smtp"], env, base / "smtp.log")]
            for i in range(args.workers):
                cache = {"JSQUEUE_WORKER__BODY_CACHE_DIR": str(base / f"cache-{i}")}
                procs.append(JsqueueProc(["worker"], {**env, **cache}, base / f"worker-{i}.log"))
            for p in procs:
                stack.push_async_callback(p.stop)
            # WARNING level hides the readiness lines: wait for the SMTP port instead
            for p in procs:
                await p.start(ready="", timeout_s=30)
            await _wait_port(settings.smtp.port)
            load = Load()
            started = time.monotonic()
            await send_load(
                "127.0.0.1",
                settings.smtp.port,
                args.messages,
                DOMAIN,
                size=args.size,
                clients=args.clients,
                load=load,
            )
            sent = time.monotonic()
            wanted = {f"m{i}@{DOMAIN}" for i in range(args.messages)}
            await mx.wait_for(lambda: wanted <= {r for _, r in mx.arrivals}, timeout_s=600)
            last = max(t for t, _ in mx.arrivals)
            copies = mx.copies()
            return Result(
                mode=mode,
                messages=args.messages,
                send_s=sent - started,
                end_to_end_s=last - started,
                rejected=load.count(lambda a: a.code != 250),
                duplicates=sum(n - 1 for n in copies.values()),
            )


async def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--size", type=int, default=1024, help="octets per message")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=50, help="deliveries per worker")
    parser.add_argument("--json", action="store_true", help="one JSON line per mode as well")
    args = parser.parse_args()
    results = [asyncio.run(run_mode(mode, args)) for mode in ("single", "cluster")]
    print(
        f"\n{args.messages} messages x {args.size} octets, {args.clients} SMTP sessions, "
        f"{args.workers} worker process(es) x {args.concurrency}, sync_interval always\n"
    )
    print("| mode | replicas | ingest msg/s | end-to-end msg/s | 451s | duplicates |")
    print("|---|---|---|---|---|---|")
    for r in results:
        replicas = 1 if r.mode == "single" else 3
        print(
            f"| {r.mode} | R{replicas} | {r.ingest_per_s:.0f} | {r.delivered_per_s:.0f} | "
            f"{r.rejected} | {r.duplicates} |"
        )
    single, cluster = results
    print(
        f"\ncluster / single: ingest {cluster.ingest_per_s / single.ingest_per_s:.2f}, "
        f"end-to-end {cluster.delivered_per_s / single.delivered_per_s:.2f}"
    )
    if args.json:
        for r in results:
            print(json.dumps({**r.__dict__, "ingest_per_s": r.ingest_per_s}))


if __name__ == "__main__":
    main()
