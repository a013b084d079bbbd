"""Recovery after the faults an operator meets: a NATS restart under running processes, and
processes killed with ``kill -9`` (real processes, a real nats-server)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.aio.client import Client as NATS

from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from support.frontend import Wire, dot_stuff, queued_id
from support.mx import shared_port

MESSAGE = b"From: alice@example.test\r\nTo: bob@dest.example.test\r\nSubject: r\r\n\r\nbody\r\n"


def process_env(nats_server: EmbeddedNats, names: Names, **extra: str) -> dict[str, str]:
    """Environment for a ``jsqueue`` process on ``nats_server`` with this test's names."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("JSQUEUE_")}
    env.update(
        JSQUEUE_NATS__URLS=json.dumps([nats_server.url]),
        JSQUEUE_NATS__PREFIX=names.prefix,
        JSQUEUE_HTTP__ENABLED="false",
        JSQUEUE_LOG__LEVEL="INFO",
        **extra,
    )
    return env


@asynccontextmanager
async def jsqueue_process(
    *args: str, env: dict[str, str]
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m jsqueue ARGS`` running for the block; terminated (then killed) after."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def send(port: int) -> tuple[int, float]:
    """One transaction on a new connection: (reply code, seconds until the reply)."""
    w = await Wire.connect(port)
    try:
        started = time.monotonic()
        r = await w.transaction("alice@example.test", ["bob@dest.example.test"], dot_stuff(MESSAGE))
        took = time.monotonic() - started
        await w.expect("QUIT", 221)
    finally:
        await w.close()
    if r.code == 250:
        queued_id(r)
    return r.code, took


async def wait_accepting(port: int, timeout_s: float = 30.0) -> None:
    """Until the front end on ``port`` answers a transaction with 250."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                if (await send(port))[0] == 250:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)


async def stream_exists(url: str, stream: str) -> bool:
    nc = NATS()
    await nc.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        try:
            await js.stream_info(stream)
        except Exception as e:
            if "not found" in str(e).lower():
                return False
            raise
        return True
    finally:
        await nc.close()


async def test_front_end_recovers_its_ingest_log_after_a_nats_kill_9(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """``kill -9`` of the nats-server under a running ``jsqueue smtp``, then a restart: the
    memory-backed ingest log is gone with the server; the front end provisions it again
    (once) and answers each of the next 20 messages promptly, not after ~15 s of claim
    retries, with the resend protection back in place."""
    port = shared_port(["127.0.0.1"])
    env = process_env(
        nats_server, names, JSQUEUE_SMTP__PORT=str(port), JSQUEUE_SMTP__DEDUPE_WINDOW_S="60"
    )
    ingest_stream = f"KV_{names.ingest_bucket}"
    async with jsqueue_process("smtp", env=env):
        await wait_accepting(port)
        assert await stream_exists(nats_server.url, ingest_stream)
        nats_server.kill()
        await nats_server.start()
        await wait_accepting(port)
        took = []
        for _ in range(20):
            code, seconds = await send(port)
            assert code == 250
            took.append(seconds)
        assert await stream_exists(nats_server.url, ingest_stream), "ingest log provisioned again"
    took.sort()
    # Each answer well under the ~15 s of claim time-outs the lost stream cost.
    assert took[-1] < 5.0, took
