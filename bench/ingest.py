"""Ingest benchmark: N concurrent SMTP sessions x 4 KB messages into the front end.

Starts an embedded nats-server (``sync_interval: always``, DESIGN.md §7) in a temporary
store directory, the front end in a child process (``--serve``) on JetStream stores, and
drives it with aiosmtplib clients on loopback. Prints accepted messages per second and the
front-end process's peak RSS (VmHWM). A benchmark, not a test: nothing is asserted.

Usage::

    python bench/ingest.py [--sessions 20] [--messages 4000] [--size 4096]

All traffic stays on 127.0.0.1; every loop is bounded by ``--messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiosmtplib

from jsqueue.config import NatsSettings, SmtpSettings
from jsqueue.frontend.server import serve_smtp
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream import open_jetstream


def _message(size: int, n: int) -> bytes:
    head = (
        f"From: bench@example.test\r\nTo: sink@dest.example.test\r\n"
        f"Subject: bench {n}\r\nMessage-ID: <bench.{n}.{os.getpid()}@example.test>\r\n\r\n"
    ).encode()
    line = b"x" * 74 + b"\r\n"
    body = line * max(0, (size - len(head)) // len(line))
    return head + body


async def _serve(nats_url: str, prefix: str) -> None:
    """Child: the front end on JetStream stores until stdin closes."""
    stores = await open_jetstream(NatsSettings(), [nats_url], names=Names(prefix))
    settings = SmtpSettings(host="127.0.0.1", port=0, max_sessions=1000, dedupe_window_s=120)
    server = await serve_smtp(settings, stores)
    print(f"READY {server.port}", flush=True)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sys.stdin.fileno(), lambda: done.done() or done.set_result(None))
    await done
    await server.stop(timeout_s=5)
    await stores.close()


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


async def _session(port: int, count: int, size: int, first: int, rejected: list[str]) -> int:
    ok = 0
    async with aiosmtplib.SMTP(
        hostname="127.0.0.1", port=port, start_tls=False, timeout=60
    ) as smtp:
        for n in range(first, first + count):
            try:
                await smtp.sendmail(
                    "bench@example.test", ["sink@dest.example.test"], _message(size, n)
                )
                ok += 1
            except aiosmtplib.SMTPResponseException as e:
                rejected.append(f"{e.code} {e.message}")
    return ok


async def _run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="jsqueue-bench-") as tmp:
        async with EmbeddedNats(Path(tmp) / "nats", port=0) as nats:
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--serve",
                "--nats-url",
                nats.url,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            assert child.stdout is not None and child.stdin is not None
            line = await asyncio.wait_for(child.stdout.readline(), 60)
            if not line.startswith(b"READY "):
                raise SystemExit(f"front end did not start: {line!r}")
            port = int(line.split()[1])
            # Warm up: connections, buckets, JIT-less Python caches.
            await _session(port, 20, args.size, -20, [])
            per = [args.messages // args.sessions] * args.sessions
            per[0] += args.messages - sum(per)
            rejected: list[str] = []
            start = time.perf_counter()
            accepted = await asyncio.gather(
                *(
                    _session(port, per[i], args.size, sum(per[:i]), rejected)
                    for i in range(args.sessions)
                )
            )
            elapsed = time.perf_counter() - start
            rss = _peak_rss_kib(child.pid)
            child.stdin.close()
            await asyncio.wait_for(child.wait(), 30)
    total = sum(accepted)
    result = {
        "sessions": args.sessions,
        "messages": args.messages,
        "size_octets": args.size,
        "accepted": total,
        "rejected": len(rejected),
        "seconds": round(elapsed, 2),
        "accepted_msgs_per_s": round(total / elapsed, 1),
        "frontend_peak_rss_mib": round(rss / 1024, 1),
    }
    print(
        f"{total} accepted in {elapsed:.2f} s = {total / elapsed:.1f} msgs/s "
        f"({args.sessions} sessions x {args.size} B); front-end peak RSS {rss / 1024:.1f} MiB"
    )
    if rejected:
        print(f"rejected: {len(rejected)} (first: {rejected[0]})")
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20, help="concurrent SMTP sessions")
    parser.add_argument("--messages", type=int, default=4000, help="messages in total")
    parser.add_argument("--size", type=int, default=4096, help="message size, octets")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.nats_url, args.prefix))
    else:
        asyncio.run(_run(args))


if __name__ == "__main__":
    main()
