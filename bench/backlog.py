"""Cost as the deferred backlog grows: for each size (default 10 000, 100 000, 1 000 000),
a fresh jsqueue (``jsqueue nats``, ``smtp``, ``worker``, default settings) gets that many
deferred entries and work items (due in an hour) written straight to JetStream, as
``compare.py``'s deferred scenario does; once the worker holds them all (each a NAK-delayed,
ack-pending item of the one consumer) it measures:

- nats-server, worker and front-end RSS (all three in the JSON) and CPU at rest
  (``--rest-s`` seconds, no mail: the reconciler's passes and the exporter's depth scan
  are what runs then);
- latency of fresh mail through the same consumer (``--fresh`` messages, one at a time:
  the client's 250 to the sink's count);
- a nats-server restart (SIGTERM, start on the same store and port): seconds until it is
  ready, and until a fresh message sent then is delivered (the consumer delivers again).

A size at or past ``nats.max_ack_pending`` (1 000 000 by default) saturates the consumer:
fresh mail then waits for a deferred item to come due, which ``jsqueue_ack_pending_saturated``
and a log line report (jsqueue.saturation); the fresh-mail figure says what it costs.

    .venv/bin/python bench/backlog.py --sizes 10000,100000

``--baseline DIR`` runs the jsqueue package of another checkout (a ``git worktree``) for an
A/B; run it from outside the repository (the current directory comes first on the path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import smtplib
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import (  # noqa: E402  (bench/ is put on the path just above)
    RESULTS,
    SENDER,
    SINK_ADDRESSES,
    JsqueueProcess,
    JsqueueSystem,
    _consumer_state,
    _populate,
)
from postfix import Sink, cpu_seconds, rss_kib  # noqa: E402

from support.dns import DnsServer  # noqa: E402  (tests/ is put on the path by postfix.py)
from support.postfix import free_port, make_workdir  # noqa: E402

DOMAIN = "bench1.example.test"


def _send_one(host: str, port: int, i: int) -> None:
    body = f"Subject: fresh {i}\r\n\r\n" + ("x" * 78 + "\r\n") * 50
    with smtplib.SMTP(host, port, timeout=60) as s:
        s.sendmail(SENDER, [f"sink@{DOMAIN}"], body)


def _latency(system: JsqueueSystem, sink: Sink, i: int, timeout_s: float = 600) -> float | None:
    """Seconds from the 250 of one fresh message until the sink counted it; None on timeout."""
    before = sink.count
    _send_one(system.host, system.port, i)
    t250 = time.monotonic()
    while sink.count <= before:
        if time.monotonic() - t250 > timeout_s:
            return None
        time.sleep(0.005)
    return time.monotonic() - t250


def _cpu_at_rest(pids: dict[str, int], seconds: float) -> dict[str, float]:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(seconds)
    return {k: (cpu_seconds(p) - before[k]) / seconds for k, p in pids.items()}


def measure(
    workdir: Path, dns: DnsServer, sink: Sink, size: int, args: argparse.Namespace
) -> dict[str, Any]:
    nats_port = free_port("127.0.0.1")
    env = {
        "JSQUEUE_NATS__PORT": str(nats_port),
        "JSQUEUE_NATS__MAX_ACK_PENDING": str(args.max_ack_pending),
    }
    if args.baseline is not None:  # the jsqueue package of another checkout (an A/B)
        env["PYTHONPATH"] = str(args.baseline.resolve())
    system = JsqueueSystem(workdir / f"b{size}", dns, sink.port, env, SINK_ADDRESSES[DOMAIN])
    print(f"{size} deferred entries ...", flush=True)
    system.start()
    out: dict[str, Any] = {"deferred": size}
    try:
        assert system.worker is not None and system.nats is not None
        out["populate_s"] = asyncio.run(_populate(system.nats_url, size, "deferred.example.test"))
        print(f"  populated in {out['populate_s']:.0f} s", flush=True)
        started = time.monotonic()
        while True:
            pending, ack_pending = asyncio.run(_consumer_state(system.nats_url))
            if pending == 0 or ack_pending >= args.max_ack_pending:
                break
            if time.monotonic() - started > args.take_timeout_s:
                break
            time.sleep(1.0)
        out["taken_s"] = time.monotonic() - started
        out["pending"], out["ack_pending"] = pending, ack_pending
        print(f"  worker holds {ack_pending} ({pending} waiting) after {out['taken_s']:.0f} s")
        assert system.smtp is not None
        pids = {
            "nats-server": system._nats_server_pid,
            "worker": system.worker.pid,
            "front end": system.smtp.pid,
        }
        out["cpu_at_rest"] = _cpu_at_rest(pids, args.rest_s)
        out["rss_mib"] = {k: rss_kib(p) / 1024 for k, p in pids.items()}
        lat = [_latency(system, sink, i, args.fresh_timeout_s) for i in range(args.fresh)]
        got = [x for x in lat if x is not None]
        out["fresh_latency_ms"] = {
            "p50": 1000 * statistics.median(got) if got else None,
            "max": 1000 * max(got) if got else None,
            "lost": len(lat) - len(got),
        }
        print(f"  at rest: {out['cpu_at_rest']}, RSS {out['rss_mib']}, fresh {lat}", flush=True)
        # Restart the nats-server: same store, same port; the front end and the worker
        # reconnect by themselves.
        t0 = time.monotonic()
        system.nats.stop()
        stopped = time.monotonic()
        system.nats = JsqueueProcess(["nats"], system.env, system.workdir / "nats2.log").start()
        system.nats.wait_for_log(r"nats-server ready on", timeout_s=1800)
        ready = time.monotonic()
        out["restart"] = {"stop_s": stopped - t0, "ready_s": ready - stopped}
        first = _latency(system, sink, 10**6, args.fresh_timeout_s)
        out["restart"]["first_delivery_s"] = None if first is None else time.monotonic() - ready
        print(f"  restart: {out['restart']}", flush=True)
    finally:
        system.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--fresh", type=int, default=10, help="fresh messages, one at a time")
    parser.add_argument("--rest-s", type=float, default=10.0)
    parser.add_argument("--take-timeout-s", type=float, default=1800.0)
    parser.add_argument("--fresh-timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--max-ack-pending",
        type=int,
        default=1_000_000,
        help="nats.max_ack_pending of the jsqueue measured (the default setting's value)",
    )
    parser.add_argument(
        "--baseline", type=Path, help="run the jsqueue package of this checkout instead"
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    workdir = make_workdir("jsqueue-backlog-")
    port = free_port(SINK_ADDRESSES[DOMAIN])
    rows = []
    zone = f"{DOMAIN}. MX 10 mx.{DOMAIN}.\nmx.{DOMAIN}. A {SINK_ADDRESSES[DOMAIN]}\n"
    sink = Sink(SINK_ADDRESSES[DOMAIN], port).start()
    try:
        with DnsServer(zone) as dns:
            for size in sizes:
                rows.append(measure(workdir, dns, sink, size, args))
    finally:
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    lines = [
        f"Backlog curve, {stamp} UTC, load average before {load}"
        + (f", jsqueue of {args.baseline}" if args.baseline else "")
        + ":",
        "",
        "| deferred | populate s | worker took s | nats-server RSS MiB | worker RSS MiB "
        "| nats CPU at rest % | worker CPU at rest % | front end CPU at rest % "
        "| fresh mail p50 / max ms "
        "| nats restart: ready s | first delivery after ready s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lat, rs = r["fresh_latency_ms"], r["restart"]

        def f(x: float | None, d: int = 0) -> str:
            return "—" if x is None else f"{x:,.{d}f}"

        lost = f" ({lat['lost']} lost)" if lat["lost"] else ""
        lines.append(
            f"| {r['deferred']:,} | {f(r['populate_s'])} | {f(r['taken_s'])} "
            f"| {f(r['rss_mib']['nats-server'])} | {f(r['rss_mib']['worker'])} "
            f"| {f(100 * r['cpu_at_rest']['nats-server'], 1)} "
            f"| {f(100 * r['cpu_at_rest']['worker'], 1)} "
            f"| {f(100 * r['cpu_at_rest']['front end'], 1)} "
            f"| {f(lat['p50'])} / {f(lat['max'])}{lost} "
            f"| {f(rs['ready_s'], 1)} | {f(rs['first_delivery_s'], 1)} |"
        )
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"backlog-{stamp}.md").write_text(text)
    (RESULTS / f"backlog-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print()
    print(text)


if __name__ == "__main__":
    main()
