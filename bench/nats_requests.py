"""The client-side CPU of one NATS request from Python (nats-py), the unit every message of
jsqueue pays about 13 times (bench/README.md, "Requests per message"): a nats-server of its
own on loopback with a memory stream, then ``--requests`` JetStream publishes (700 octets,
the size of a queue entry) and as many core requests to a subject nobody answers (the
no-responders reply: a round trip with no stream behind it), one at a time and from 20
tasks at once, each on uvloop and on asyncio's own loop. Prints this process's CPU per
request (user + system) and the rate.

    .venv/bin/python bench/nats_requests.py [--requests 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.errors
import uvloop

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from jsqueue.nats_server import find_nats_server  # noqa: E402
from support.postfix import free_port  # noqa: E402  (tests/ is put on the path just above)

PAYLOAD = b"x" * 700


async def measure(url: str, requests: int, loop_name: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_stream("BENCH")
    await js.add_stream(name="BENCH", subjects=["bench.>"], storage="memory")

    async def publish(task: int, n: int) -> None:
        for _ in range(n):
            await js.publish(f"bench.{task}", PAYLOAD)

    async def request(task: int, n: int) -> None:
        for _ in range(n):
            with contextlib.suppress(nats.errors.NoRespondersError):
                await nc.request(f"nobody.{task}", PAYLOAD, timeout=5)

    async def no_reply(task: int, n: int) -> None:
        for _ in range(n):
            await nc.publish(f"bench.{task}", PAYLOAD)
        await nc.flush()

    runs: list[tuple[str, Callable[[int, int], Awaitable[None]]]] = [
        ("JetStream publish", publish),
        ("core request", request),
        ("publish, no reply", no_reply),
    ]
    for what, fn in runs:
        for tasks in (1, 20):
            cpu0, t0 = time.process_time(), time.monotonic()
            await asyncio.gather(*(fn(t, requests // tasks) for t in range(tasks)))
            cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
            print(
                f"{loop_name:8} {what:18} {tasks:2} task(s): "
                f"{1e6 * cpu / requests:4.0f} µs CPU per request, {requests / wall:6.0f} req/s",
                flush=True,
            )
    await nc.close()


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    """Until the server accepts connections on ``port`` (SystemExit after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nats-server not listening on port {port}") from None
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="jsqueue-bench-nats-"))
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [str(find_nats_server()), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    try:
        _wait_listening(port)
        uvloop.run(measure(url, args.requests, "uvloop"))
        asyncio.run(measure(url, args.requests, "asyncio"))
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
