"""The dashboard at 100 000 queued entries: how long the overview and the first page of the
list take over real HTTP.

Starts an embedded nats-server in a temporary store directory, writes N queue entries
straight into the KV bucket (as bench/queue_ops.py does: concurrent creates, no SMTP, no
bodies; 70 % deferred, 3 % held, 50 destination domains), starts the process's HTTP
endpoint with the API and the dashboard on 127.0.0.1 (as ``jsqueue up`` does), logs in
with an admin token, waits for the dashboard's first depth sample, then times, in
alternating rounds:

* ``GET /ui/`` - the overview (memory only: the depth samples and outcome counts);
* ``GET /ui/queue`` - the first page of the list (``Admin.page``, ``ui.page_size``);
* ``GET /ui/queue?state=deferred&domain=d7.example.test`` - a filtered first page;
* ``GET /ui/queue/<id>`` - one message page (entry read plus its events history).

It prints the median, minimum and maximum of each, the duration of one sampling pass
over the whole queue (what the background sampler pays every ten passes' time), and the
load average. A benchmark, not a test: it prints figures and asserts nothing.

Usage::

    python bench/ui_pages.py [--entries 100000] [--rounds 7]

Everything stays on 127.0.0.1; every loop is bounded by ``--entries`` and ``--rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from queue_ops import PREFIX, _populate

from jsqueue.config import Settings
from jsqueue.events import Observer
from jsqueue.health import telemetry
from jsqueue.http.app import ApiMount
from jsqueue.http.auth import Role, Token, add_token
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream import open_jetstream
from jsqueue.ui.app import DashboardMount


async def _timed(session: aiohttp.ClientSession, url: str) -> tuple[float, int, int]:
    """(seconds to the whole body, status, body octets) of one GET."""
    started = time.perf_counter()
    async with session.get(url, allow_redirects=False) as r:
        body = await r.read()
        return time.perf_counter() - started, r.status, len(body)


async def _round(
    session: aiohttp.ClientSession,
    targets: dict[str, Any],
    times: dict[str, list[float]],
    sizes: dict[str, int],
) -> None:
    """One GET of each target, in order (rounds alternate the pages)."""
    for name, target in targets.items():
        if callable(target):  # an in-process call, for the split of a page's cost
            started = time.perf_counter()
            await target()
            times[name].append(time.perf_counter() - started)
            sizes[name] = 0
            continue
        s, status, size = await _timed(session, target)
        assert status == 200, (name, status)
        times[name].append(s)
        sizes[name] = size


async def main(entries: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="jsq-bench-ui-") as tmp:
        server = EmbeddedNats(Path(tmp) / "nats", port=0)
        await server.start()
        try:
            await _run(Path(tmp), server.url, entries, rounds)
        finally:
            await server.stop()


async def _run(tmp: Path, url: str, entries: int, rounds: int) -> None:
    token = add_token(tmp / "tokens", "bench", Role.ADMIN)
    settings = Settings.model_validate(
        {
            "nats": {"urls": [url], "prefix": PREFIX, "request_timeout_s": 30.0},
            "http": {"host": "127.0.0.1", "port": 0},
            "api": {"tokens_file": tmp / "tokens"},
            "ui": {"sample_interval_s": 10.0},
        }
    )
    stores = await open_jetstream(settings.nats, [url], names=Names(PREFIX))
    try:
        print(f"populating {entries} entries ...", flush=True)
        took = await _populate(stores, entries)
        print(f"populate: {entries / took:.0f} entries/s ({took:.1f} s)", flush=True)
        mounts: list[DashboardMount] = []

        def api(observer: Observer) -> DashboardMount:
            mounts.append(DashboardMount(ApiMount(settings, stores, [url], observer)))
            return mounts[-1]

        async with (
            telemetry(settings, stores, [url], api=api) as tel,
            aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session,
        ):
            assert tel.http is not None
            base = tel.http.url
            async with session.post(base + "/ui/login", data={"token": token}) as r:
                assert r.status == 200, r.status
            history = mounts[0].dashboard.history
            t = time.perf_counter()
            await asyncio.wait_for(history.sampled.wait(), 300)
            first_sample = time.perf_counter() - t
            latest = history.latest
            assert latest is not None
            async with session.get(base + "/ui/queue") as r:
                html = await r.text()
            some_id = html.split('href="/ui/queue/', 2)[1].split('"', 1)[0]
            admin = mounts[0].dashboard.ctx.admin(Token("bench", Role.READ))
            kv: Any = stores.entries  # the JetStream store: keys() lists the bucket
            targets: dict[str, Any] = {
                "  in process: EntryStore.keys()": kv.keys,
                "  in process: Admin.page(limit=50)": lambda: admin.page(limit=50),
                "overview GET /ui/": base + "/ui/",
                "list, first page GET /ui/queue": base + "/ui/queue",
                "list, deferred at one domain": base
                + "/ui/queue?state=deferred&domain=d7.example.test",
                "message page GET /ui/queue/<id>": f"{base}/ui/queue/{some_id}",
            }
            times: dict[str, list[float]] = {name: [] for name in targets}
            busy: dict[str, list[float]] = {name: [] for name in targets}
            sizes: dict[str, int] = {}
            for _ in range(rounds):
                await _round(session, targets, times, sizes)
            # the same while a sampling pass runs (what a view meets a tenth of the time)
            passing = asyncio.create_task(history.sample())
            while not passing.done() and len(busy["overview GET /ui/"]) < rounds:
                await _round(session, targets, busy, sizes)
            await passing
    finally:
        await stores.close()

    load = os.getloadavg()
    print()
    print(
        f"queue entries                 {entries} ({latest.entries} queued, by state "
        f"{ {k.value: v for k, v in latest.by_state.items()} })"
    )
    print(
        f"sampling pass                 worked {latest.took_s:.2f} s, took {latest.wall_s:.2f} s "
        f"with its pauses; first sample ready after {first_sample:.2f} s"
    )
    print(f"rounds                        {rounds}, alternating")
    for title, table in (("idle", times), ("during a sampling pass", busy)):
        print(f"-- {title}")
        for name, values in table.items():
            if not values:
                continue
            print(
                f"{name:<34} median {statistics.median(values) * 1000:7.1f} ms  "
                f"min {min(values) * 1000:7.1f}  max {max(values) * 1000:7.1f}  "
                f"n={len(values)} ({sizes[name]} octets)"
            )
    print(
        f"load average                  {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"({os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.entries, args.rounds))
