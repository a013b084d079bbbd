"""Outbound PIPELINING (RFC 2920) off against on, in the 10-recipients / 2-domains scenario
of ``compare.py`` (4 KB, 5 + 5 recipients, 20 sessions; jsqueue only, fresh processes per
run, the worker delivering to ``smtp-sink``, which offers PIPELINING).

Runs ``compare.py --systems jsqueue --scenarios multi`` ``--repeat`` times with
``JSQUEUE_WORKER__PIPELINING=false`` and as often with ``true``, alternating (off, on, off,
on ...), and prints the medians of each mode: delivered end to end (msg/s), CPU per message
of every jsqueue process, the worker's CPU per message, and the on/off ratio of each pair of
neighbouring runs (median). The load average before and after is printed with them: the
machine is shared, so only figures of the same invocation compare.

    .venv/bin/python bench/pipelining.py --repeat 5 --messages 1000

``--client`` measures the delivery client alone instead, in this process: ``deliver()`` of
``--messages`` messages (4 KB, 5 recipients: one domain's half of the scenario) with 20 in
flight and a connection cache, to one ``smtp-sink``; CPU seconds of this process
(``time.process_time``) and wall time per mode, alternating, medians and pair ratios. No
queue, no NATS: the part pipelining changes, without the fsync-bound rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAVED = re.compile(r"^saved (\S+)\.md$", re.M)
sys.path.insert(0, str(HERE))

from postfix import Sink  # noqa: E402  (bench/ is put on the path just above)

from jsqueue.config import WorkerSettings  # noqa: E402
from jsqueue.delivery import (  # noqa: E402
    BodySource,
    ConnectionCache,
    DeliveryEnvelope,
    MxTarget,
    deliver,
)
from jsqueue.envelope import Recipient  # noqa: E402
from support.mx import shared_port  # noqa: E402  (tests/ is put on the path by postfix.py)

SINK_HOST = "127.0.3.9"


async def client_run(port: int, sink: Sink, messages: int, pipelining: bool) -> dict[str, float]:
    """``messages`` deliveries of 4 KB to 5 recipients, 20 in flight, one connection cache."""
    settings = WorkerSettings(mx_port=port, ehlo_name="bench.example.test", pipelining=pipelining)
    targets = [MxTarget(host="sink.bench.test", address=SINK_HOST)]
    body = BodySource.from_bytes(b"Subject: bench\r\n\r\n" + b"x" * 76 + b"\r\n" * 52)
    rcpts = tuple(Recipient.from_address(f"r{i}@a.bench.test") for i in range(5))
    env = DeliveryEnvelope(domain="a.bench.test", reverse_path="s@bench.test", recipients=rcpts)
    cache = ConnectionCache()
    left = messages
    failed = 0

    async def sender() -> None:
        nonlocal left, failed
        while left > 0:
            left -= 1
            result = await deliver(targets, env, body, settings, cache)
            failed += len(result.replies) - len(result.delivered)

    base = sink.count
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(20)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await cache.close()
    if failed or sink.count - base < messages:
        await asyncio.sleep(0.5)  # the sink's counter is read from a pipe
    if failed or sink.count - base != messages:
        raise RuntimeError(f"{failed} recipients not delivered, sink got {sink.count - base}")
    return {
        "delivered_per_s": messages / wall,
        "cpu_ms_per_msg": 1000 * cpu / messages,
        "worker_cpu_ms_per_msg": 1000 * cpu / messages,
    }


def client_runs(repeat: int, messages: int) -> dict[bool, list[dict[str, float]]]:
    """Alternating :func:`client_run` s against one ``smtp-sink``."""
    port = shared_port([SINK_HOST])
    sink = Sink(SINK_HOST, port).start()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for i in range(repeat):
            for mode in (False, True):
                r = asyncio.run(client_run(port, sink, messages, mode))
                runs[mode].append(r)
                state = "on " if mode else "off"
                print(
                    f"run {i + 1} pipelining {state}: {r['delivered_per_s']:.0f} msg/s, "
                    f"client CPU {r['cpu_ms_per_msg']:.3f} ms/msg",
                    flush=True,
                )
    finally:
        sink.stop()
    return runs


def one_run(messages: int, pipelining: bool, extra: list[str]) -> dict[str, float]:
    """One ``compare.py`` run; returns delivered/s, CPU ms/msg, worker CPU ms/msg."""
    cmd = [
        sys.executable,
        str(HERE / "compare.py"),
        "--systems",
        "jsqueue",
        "--scenarios",
        "multi",
        "--multi-messages",
        str(messages),
        "--deferred",
        "0",
        "--env",
        f"JSQUEUE_WORKER__PIPELINING={'true' if pipelining else 'false'}",
        *extra,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = SAVED.search(out)
    if m is None:
        raise RuntimeError(f"compare.py printed no result file:\n{out}")
    result = json.loads(Path(m.group(1) + ".json").read_text())["results"][0]
    if not result["complete"]:
        raise RuntimeError(f"incomplete run: {result}")
    n = result["messages"]
    return {
        "delivered_per_s": n / result["delivered_s"],
        "cpu_ms_per_msg": 1000 * result["cpu_s"] / n,
        "worker_cpu_ms_per_msg": 1000 * result["cpu_by_process"]["worker"] / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per mode (alternating)")
    parser.add_argument("--messages", type=int, default=1000, help="messages per run")
    parser.add_argument("--compare-arg", action="append", default=[], help="more compare.py args")
    parser.add_argument("--client", action="store_true", help="the delivery client alone")
    args = parser.parse_args()
    before = os.getloadavg()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    if args.client:
        runs = client_runs(args.repeat, args.messages)
    for i in range(0 if args.client else args.repeat):
        for mode in (False, True):
            r = one_run(args.messages, mode, args.compare_arg)
            runs[mode].append(r)
            state = "on " if mode else "off"
            print(
                f"run {i + 1} pipelining {state}: {r['delivered_per_s']:.1f} msg/s, "
                f"CPU {r['cpu_ms_per_msg']:.2f} ms/msg, worker {r['worker_cpu_ms_per_msg']:.2f}",
                flush=True,
            )
    after = os.getloadavg()
    print()
    print(
        f"load average before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}; "
        f"after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}"
    )
    what = "5 recipients, delivery client alone" if args.client else "10 recipients, whole queue"
    print(f"{args.repeat} runs per mode, {args.messages} messages x {what}\n")
    print("| measure | pipelining off | on | on / off (median of pairs) |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("delivered_per_s", "delivered end to end, msg/s"),
        ("cpu_ms_per_msg", "CPU ms per message, all jsqueue processes"),
        ("worker_cpu_ms_per_msg", "worker CPU ms per message"),
    ):
        if args.client and key == "worker_cpu_ms_per_msg":
            continue
        if args.client and key == "cpu_ms_per_msg":
            label = "CPU ms per message, the delivering process"
        off = statistics.median(r[key] for r in runs[False])
        on = statistics.median(r[key] for r in runs[True])
        ratio = statistics.median(
            b[key] / a[key] for a, b in zip(runs[False], runs[True], strict=True)
        )
        print(f"| {label} | {off:.2f} | {on:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
