"""Operator commands on a big queue: ``queue stats`` and the first page of ``queue ls``.

Starts an embedded nats-server in a temporary store directory, writes N queue entries
straight into the KV bucket (concurrent creates, no SMTP, no bodies: only the listing and
counting paths are measured), then times:

* ``Admin.page(limit=50)``, the first page of ``queue ls`` (in process);
* ``Admin.stats()``, ``queue stats`` (in process: one pass over every entry);
* the real command line as a child process, ``jsqueue queue ls --limit 50`` (time to the
  first entry line and to the end) and ``jsqueue queue stats --json``, which include the
  interpreter start and the NATS connection.

A benchmark, not a test: it prints figures and asserts nothing.

Usage::

    python bench/queue_ops.py [--entries 100000] [--page 50]

Everything stays on 127.0.0.1; every loop is bounded by ``--entries``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from jsqueue.admin import Admin
from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry, Recipient, RecipientState, utcnow
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.replies import Reply
from jsqueue.store.base import Stores
from jsqueue.store.jetstream import open_jetstream

PREFIX = "bench"
DOMAINS = [f"d{i}.example.test" for i in range(50)]
WINDOW = 500  # concurrent creates while populating


def _entry(rng: random.Random) -> Entry:
    age_s = rng.uniform(0, 5 * 86400)
    created = utcnow() - timedelta(seconds=age_s)
    roll = rng.random()
    state = RecipientState.DEFERRED if roll < 0.7 else RecipientState.PENDING
    domain = rng.choice(DOMAINS)
    rcpt = Recipient(address=f"user{rng.randrange(10**6)}@{domain}", domain=domain, state=state)
    if state is RecipientState.DEFERRED:
        rcpt.attempts = rng.randint(1, 12)
        rcpt.last_reply = Reply(code=451, enhanced="4.4.1", text="no answer", remote_host=None)
        rcpt.next_attempt_at = utcnow() + timedelta(seconds=rng.uniform(60, 4 * 3600))
    return Entry(
        id=new_queue_id(int(created.timestamp() * 1000)),
        reverse_path=f"sender{rng.randrange(100)}@example.test",
        recipients=[rcpt],
        created_at=created,
        size=rng.randint(2_000, 80_000),
        held=roll > 0.97,
    )


async def _populate(stores: Stores, n: int) -> float:
    rng = random.Random(1)
    started = time.perf_counter()
    done = 0
    while done < n:
        batch = [_entry(rng) for _ in range(min(WINDOW, n - done))]
        await asyncio.gather(*(stores.entries.create(e) for e in batch))
        done += len(batch)
        if done % 20_000 == 0 or done == n:
            print(f"  populated {done}/{n}", flush=True)
    return time.perf_counter() - started


async def _cli(args: list[str], env: dict[str, str]) -> tuple[float, float | None, int]:
    """(total seconds, seconds to the first entry line or None, exit code)."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    first: float | None = None
    lines = 0
    while await proc.stdout.readline():
        lines += 1
        if first is None and lines == 2:  # the header comes first, then the first entry
            first = time.perf_counter() - started
    code = await proc.wait()
    return time.perf_counter() - started, first, code


async def main(entries: int, page: int) -> None:
    with tempfile.TemporaryDirectory(prefix="jsq-bench-") as tmp:
        server = EmbeddedNats(Path(tmp) / "nats", port=0)
        await server.start()
        try:
            settings = NatsSettings(prefix=PREFIX, request_timeout_s=30.0)
            stores = await open_jetstream(settings, [server.url], names=Names(PREFIX))
            try:
                print(f"populating {entries} entries ...", flush=True)
                took = await _populate(stores, entries)
                print(f"populate: {entries / took:.0f} entries/s ({took:.1f} s)")
                admin = Admin(stores)

                t = time.perf_counter()
                first = await admin.page(limit=page)
                first_s = time.perf_counter() - t
                t = time.perf_counter()
                stats = await admin.stats()
                stats_s = time.perf_counter() - t
            finally:
                await stores.close()

            env = {k: v for k, v in os.environ.items() if not k.startswith("JSQUEUE_")}
            env.update(
                JSQUEUE_NATS__URLS=json.dumps([server.url]),
                JSQUEUE_NATS__PREFIX=PREFIX,
                JSQUEUE_NATS__REQUEST_TIMEOUT_S="30",
                JSQUEUE_LOG__LEVEL="WARNING",
            )
            ls_total, ls_first, ls_code = await _cli(["queue", "ls", "--limit", str(page)], env)
            st_total, _, st_code = await _cli(["queue", "stats", "--json"], env)
        finally:
            await server.stop()

    first_line = "-" if ls_first is None else f"{ls_first:.3f} s"
    rows = [
        ("queue entries", f"{entries}"),
        ("by state", str({k.value: v for k, v in stats.by_state.items()})),
        (f"Admin.page(limit={page})", f"{first_s:.3f} s ({len(first.entries)} entries)"),
        ("Admin.stats()", f"{stats_s:.3f} s ({entries / stats_s:.0f} entries/s)"),
        (
            f"CLI queue ls --limit {page}",
            f"first entry {first_line}, done {ls_total:.3f} s (exit {ls_code})",
        ),
        ("CLI queue stats --json", f"{st_total:.3f} s (exit {st_code})"),
    ]
    print()
    for name, value in rows:
        print(f"{name:<28} {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--page", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.entries, args.page))
