"""Fairness: does a dead site with a large backlog delay fresh mail to another site?

One nats-server (``EmbeddedNats``), two jsqueue installations on it (two name prefixes):

* **clean**: nothing queued;
* **backlog**: ``--backlog`` messages (10 000) queued for a site whose MX drops every
  connection at the greeting; after ``dead_after`` failures it is down (cool-off 600 s), and
  its items are parked (deferred without connecting, NAKed to the end of the cool-off).

Each installation has its own ``jsqueue worker`` process (real processes through the CLI),
the same settings. Then, alternating ``--rounds`` times between the two, ``--fresh`` messages
are sent one after the other to a live sink site and the time from the 250 at the front end
to the arrival at the sink is taken per message. Printed: p50 and p99 per installation and
round, the medians over the rounds, the backlog / clean ratios, and the load average. A
benchmark, not a test: nothing is asserted (``tests/test_destinations.py`` asserts the
behaviour).

Usage::

    python bench/destinations.py [--backlog 10000] [--fresh 40] [--rounds 5]

Nothing leaves 127.0.0.0/8; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from jsqueue.config import DestinationSettings, Settings  # noqa: E402
from jsqueue.destinations_admin import show_destination  # noqa: E402
from jsqueue.frontend.server import SmtpServer  # noqa: E402
from jsqueue.names import Names  # noqa: E402
from jsqueue.nats_server import EmbeddedNats  # noqa: E402
from jsqueue.store.base import Stores  # noqa: E402
from jsqueue.store.jetstream import open_jetstream  # noqa: E402
from support.cluster import CountingMx, JsqueueProc, jsqueue_env, send_load  # noqa: E402
from support.dns import DnsServer  # noqa: E402
from support.mx import CLOSE, shared_port  # noqa: E402
from support.nats import make_settings  # noqa: E402
from support.queue import test_settings  # noqa: E402

DEAD, DEAD_IP = "dead.bench.test", "127.0.2.201"
LIVE, LIVE_IP = "live.bench.test", "127.0.2.202"
ZONE = "".join(
    f"{d}. 300 IN MX 10 mx.{d}.\nmx.{d}. 300 IN A {ip}\n"
    for d, ip in ((DEAD, DEAD_IP), (LIVE, LIVE_IP))
)


class Install:
    """One prefix: its stores, front end and worker process."""

    def __init__(
        self, settings: Settings, stores: Stores, smtp: SmtpServer, worker: JsqueueProc
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.smtp = smtp
        self.worker = worker


async def install(name: str, server: EmbeddedNats, dns: DnsServer, port: int, tmp: Path) -> Install:
    nats = make_settings(urls=[server.url], prefix=f"bench{name}")
    settings = test_settings(nats, dns, port, tmp / f"cache-{name}")
    dest = DestinationSettings(dead_after=2, cool_off_s=600.0)
    settings = settings.model_copy(update={"destinations": dest})
    stores = await open_jetstream(settings.nats, [server.url], names=Names(f"bench{name}"))
    smtp = SmtpServer(settings.smtp, stores)
    await smtp.start()
    env = jsqueue_env(settings)
    env["JSQUEUE_RECONCILER__ENABLED"] = "false"
    env["JSQUEUE_WORKER__LEASE_OWNER"] = name
    worker = JsqueueProc(["worker"], env, tmp / f"worker-{name}.log")
    return Install(settings, stores, smtp, worker)


async def latencies(inst: Install, sink: CountingMx, first: int, count: int) -> list[float]:
    """Send ``count`` messages one by one to the live site; seconds from 250 to arrival."""
    host, port = inst.smtp.address
    out = []
    for i in range(first, first + count):
        load = await send_load(host, port, 1, LIVE, first=i, clients=1)
        accepted = load.accepted()[i].ended
        rcpt = f"m{i}@{LIVE}"
        deadline = time.monotonic() + 60
        while not any(r == rcpt for _, r in sink.arrivals):
            if time.monotonic() > deadline:
                raise SystemExit(f"{rcpt} not delivered within 60 s")
            await asyncio.sleep(0.005)
        arrived = next(t for t, r in sink.arrivals if r == rcpt)
        out.append(arrived - accepted)
    return out


async def poll(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    """Wait until ``check`` holds, polling every 0.2 s, at most ``timeout_s`` seconds."""
    for _ in range(int(timeout_s / 0.2)):
        if await check():
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"not within {timeout_s} s: {check.__name__}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d, DnsServer(ZONE) as dns:
        tmp = Path(d)
        server = EmbeddedNats(tmp / "nats", port=0)
        await server.start()
        port = shared_port([DEAD_IP, LIVE_IP])
        trap = CountingMx(DEAD_IP, port, greeting=CLOSE)
        sink = CountingMx(LIVE_IP, port)
        await trap.start()
        await sink.start()
        clean = await install("clean", server, dns, port, tmp)
        backlog = await install("backlog", server, dns, port, tmp)
        try:
            host, smtp_port = backlog.smtp.address
            began = time.monotonic()
            await send_load(host, smtp_port, args.backlog, DEAD, clients=16)
            print(f"backlog of {args.backlog} queued in {time.monotonic() - began:.0f} s")
            await clean.worker.start("running")
            await backlog.worker.start("running")
            store = backlog.stores.destinations
            assert store is not None
            dest = backlog.settings.destinations

            async def down() -> bool:
                return (await show_destination(store, dest, DEAD)).status == "down"

            async def parked() -> bool:  # every backlog item deferred once (its log line)
                return backlog.worker.log().count("outcome=deferred") >= args.backlog

            await poll(down, 120)
            await poll(parked, 1200)
            print(f"backlog parked after {time.monotonic() - began:.0f} s")
            figures: dict[str, list[tuple[float, float]]] = {"clean": [], "backlog": []}
            n = 0
            for r in range(args.rounds):
                for label, inst in (("clean", clean), ("backlog", backlog)):
                    values = await latencies(inst, sink, n, args.fresh)
                    n += args.fresh
                    figures[label].append((pct(values, 0.5), pct(values, 0.99)))
                    print(
                        f"round {r + 1} {label:<8} p50 {figures[label][-1][0] * 1000:7.1f} ms"
                        f"  p99 {figures[label][-1][1] * 1000:7.1f} ms"
                    )
            med = {
                k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                for k, v in figures.items()
            }
            print()
            print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            print(f"dead-site connections in all (failures before it was down): {trap.connections}")
            for k, (p50, p99) in med.items():
                print(
                    f"median of {args.rounds} rounds, {k:<8}: "
                    f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
                )
            print(
                f"backlog / clean: p50 {med['backlog'][0] / med['clean'][0]:.2f}, "
                f"p99 {med['backlog'][1] / med['clean'][1]:.2f}"
            )
        finally:
            for inst in (clean, backlog):
                await inst.worker.kill()
                await inst.smtp.stop(timeout_s=2)
                await inst.stores.close()
            await trap.stop()
            await sink.stop()
            server.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--fresh", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
