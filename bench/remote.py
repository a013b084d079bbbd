"""Delivery at real distances: every reply of the receiving MTA arrives ``--delay-ms``
(default 50) after the command it answers (``slow_sink.py``), so delivery is bound by round
trips and concurrency, not CPU. Measures jsqueue's delivered msg/s with 1, 2 and 4 worker
processes (scale by replica count: the ratio 4 workers / 1 worker) and Postfix's on the same
scenario, alternating, with round trips per message as the sink counts them (a client write
that had to wait for a reply; pipelined commands, RFC 2920, count once).

Delivery is measured on its own: the messages are queued first (smtp-source, 20 sessions)
with delivery held back (jsqueue: no worker runs yet; Postfix: every message put on hold
by ``smtpd_data_restrictions``), then released at once (jsqueue: the worker processes
start; Postfix: ``postsuper -H ALL`` and ``postqueue -f``). Delivered msg/s is counted at
the sink from its first arrival to its last, so start-up is not in it; CPU is that of
the whole system from the moment every process runs, per message delivered since.

With ``--domains N`` the messages are split over N domains, each with an MX (and a sink) of
its own, so N sites: scaling out then meets each site's session limit
(``destinations.sessions``) separately, as a queue with many destinations does. One
domain is sent through the sink as the worker's smarthost, several through their MX
records. Each sink reports the most sessions it had open at once: the ``peak sessions per
site`` column is the largest of them, what a receiver's limit per client would see.

    .venv/bin/python bench/remote.py --messages 2000 --repeat 3
    .venv/bin/python bench/remote.py --workers 1,4 --env JSQUEUE_WORKER__CONCURRENCY=40
    .venv/bin/python bench/remote.py --domains 4 --messages 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import (  # noqa: E402  (bench/ is put on the path just above)
    RESULTS,
    SENDER,
    JsqueueProcess,
    JsqueueSystem,
)
from postfix import CpuMeter, Sink, postfix_master_pid, smtp_source  # noqa: E402

from support.dns import DnsServer  # noqa: E402  (tests/ is put on the path by postfix.py)
from support.postfix import free_port, make_workdir  # noqa: E402

DOMAIN = "remote.example.test"
ADDRESS = "127.0.3.9"


def sites(n: int) -> list[tuple[str, str]]:
    """``n`` (domain, MX address) pairs: one domain is ``DOMAIN`` on ``ADDRESS``."""
    if n == 1:
        return [(DOMAIN, ADDRESS)]
    return [(f"d{i}.{DOMAIN}", f"127.0.3.{9 + i}") for i in range(n)]


class SlowSink(Sink):
    """:class:`postfix.Sink`'s interface on ``slow_sink.py``; :attr:`round_trips` too."""

    def __init__(self, host: str, port: int, delay_ms: float) -> None:
        super().__init__(host, port)
        self.delay_ms = delay_ms
        self._rt = 0
        self._peak = 0

    def start(self) -> SlowSink:
        cmd = [
            sys.executable,
            str(HERE / "slow_sink.py"),
            self.host,
            str(self.port),
            "--delay-ms",
            str(self.delay_ms),
        ]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=2) as s:
                    s.recv(100)
                    s.sendall(b"QUIT\r\n")
                    return self
            except OSError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    raise
                time.sleep(0.02)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        buf = b""
        while chunk := self._proc.stdout.read1(65536):
            now = time.time()
            buf += chunk
            *records, buf = buf.split(b"\r")
            for record in records:
                fields = dict(f.split(b"=", 1) for f in record.split() if b"=" in f)
                if b"mesg" not in fields:
                    continue
                count = int(fields[b"mesg"])
                with self._lock:
                    self.arrivals.extend([now] * (count - self._count))
                    self._count = max(self._count, count)
                    self._rt = int(fields.get(b"rt", b"0"))
                    self._peak = int(fields.get(b"peak", b"0"))

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._rt

    @property
    def peak(self) -> int:
        """The most sessions open at once so far."""
        with self._lock:
            return self._peak


def send(host: str, port: int, args: argparse.Namespace) -> None:
    """Queue ``args.messages`` 4 KB messages, split evenly over the ``args.domains``
    domains (one smtp-source run per domain, one after another)."""
    pairs = sites(args.domains)
    for i, (domain, _) in enumerate(pairs):
        share = args.messages // len(pairs) + (i < args.messages % len(pairs))
        smtp_source(
            host,
            port,
            messages=share,
            sessions=args.sessions,
            size=4096,
            sender=SENDER,
            recipient=f"sink@{domain}",
        )


def _rate(arrivals: list[float]) -> float:
    return (len(arrivals) - 1) / max(1e-9, arrivals[-1] - arrivals[0])


def run_jsqueue(
    workdir: Path, dns: DnsServer, sinks: list[SlowSink], n_workers: int, args: argparse.Namespace
) -> dict[str, float]:
    env = dict(e.split("=", 1) for e in args.env)
    smarthost = ADDRESS if len(sinks) == 1 else None  # several sites: through their MXes
    system = JsqueueSystem(workdir, dns, sinks[0].port, env, smarthost, n_workers)
    system.workdir.mkdir(parents=True, exist_ok=True)
    system.nats = JsqueueProcess(["nats"], system.env, workdir / "nats.log").start()
    system.nats_url = system.nats.wait_for_log(r"nats-server ready on (nats://\S+)").group(1)
    wenv = {**system.env, "JSQUEUE_NATS__URLS": json.dumps([system.nats_url])}
    system.smtp = JsqueueProcess(["smtp"], wenv, workdir / "smtp.log").start()
    workers: list[JsqueueProcess] = []
    try:
        port = int(system.smtp.wait_for_log(r"listening on [\d.]+:(\d+)").group(1))
        send("127.0.0.1", port, args)
        # A name of its own per worker process, as each pod has: namesakes on one host
        # would wait for each other's presence beat (worker.presence_grace_s / 3) first.
        workers = [
            JsqueueProcess(
                ["worker"], {**wenv, "JSQUEUE_WORKER__LEASE_OWNER": f"w{i}"}, workdir / f"w{i}.log"
            ).start()
            for i in range(n_workers)
        ]
        meter = CpuMeter([system.nats.pid, system.smtp.pid, *(w.pid for w in workers)])
        for w in workers:  # start-up (imports, connecting) is not delivery: not counted
            w.wait_for_log(r"jsqueue running")
        return _wait(sinks, args, meter, meter.total())
    finally:
        for w in workers:
            w.stop()
        system.smtp.stop()
        system.nats.stop()


def run_postfix(workdir: Path, sinks: list[SlowSink], args: argparse.Namespace) -> dict[str, float]:
    from support.postfix import Postfix, loopback_address

    routes = {d: f"[{a}]:{sinks[0].port}" for d, a in sites(args.domains)}
    hold = {"smtpd_data_restrictions": "check_client_access static:HOLD"}
    pf = Postfix.relay(workdir, routes, host=loopback_address(20), extra=hold)
    pf.start()
    try:
        send(pf.host, pf.port, args)
        meter = CpuMeter([postfix_master_pid(pf)])
        conf = str(pf.config_dir)
        subprocess.run(
            ["/usr/sbin/postsuper", "-c", conf, "-H", "ALL"], check=True, capture_output=True
        )
        subprocess.run(["/usr/sbin/postqueue", "-c", conf, "-f"], check=True, capture_output=True)
        return _wait(sinks, args, meter, meter.total())
    finally:
        pf.stop()


def _wait(
    sinks: list[SlowSink], args: argparse.Namespace, meter: CpuMeter, cpu0: float
) -> dict[str, float]:
    """Wait for every message at the sinks (fresh for each run). CPU is counted from
    ``cpu0`` (read once every process is running), per message delivered since: the
    start-up of a worker process (imports, connecting: 1 to 3 s of CPU on this machine) is
    not delivery, and with 4 workers it was most of the figure."""
    first = sum(k.count for k in sinks)
    deadline = time.monotonic() + max(300.0, args.messages / 5)
    while sum(k.count for k in sinks) < args.messages and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu = meter.total() - cpu0
    got = sum(k.count for k in sinks)
    arrivals: list[float] = []
    for k in sinks:
        with k._lock:
            arrivals += k.arrivals
    arrivals.sort()
    return {
        "delivered": got,
        "complete": float(got >= args.messages),
        "rate": _rate(arrivals) if got > 1 else 0.0,
        "round_trips": sum(k.round_trips for k in sinks) / max(1, got),
        "cpu_ms": 1000 * cpu / max(1, got - first),
        "peak_sessions": max(k.peak for k in sinks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--workers", default="1,2,4", help="jsqueue worker process counts")
    parser.add_argument("--no-postfix", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="extra JSQUEUE_X=Y")
    parser.add_argument("--domains", type=int, default=1, help="destination sites (MXes)")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    pairs = sites(args.domains)
    title = f"4 KB, 1 rcpt, {args.delay_ms:g} ms per round trip, {len(pairs)} site(s)"
    workdir = make_workdir("jsqueue-remote-")
    port = free_port(pairs[0][1], others=[a for _, a in pairs[1:]])
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows: list[tuple[str, dict[str, float]]] = []
    zone = "".join(f"{d}. MX 10 mx.{d}.\nmx.{d}. A {a}\n" for d, a in pairs)
    try:
        with DnsServer(zone) as dns:
            for rep in range(args.repeat):
                labels = [f"jsqueue x{n}" for n in counts]
                if not args.no_postfix:
                    labels.append("Postfix")
                for label in labels:
                    print(f"  {label}: {title} ...", flush=True)
                    sinks = [SlowSink(a, port, args.delay_ms).start() for _, a in pairs]
                    try:
                        asked = len(dns.queries)
                        if label == "Postfix":
                            r = run_postfix(workdir / f"pf-{rep}", sinks, args)
                        else:
                            n = int(label.rsplit("x", 1)[1])
                            r = run_jsqueue(workdir / f"jsq{n}-{rep}", dns, sinks, n, args)
                        r["dns_queries"] = (len(dns.queries) - asked) / max(1, r["delivered"])
                    finally:
                        for k in sinks:
                            k.stop()
                    rows.append((label, r))
                    print(
                        f"    delivered {r['rate']:.0f}/s"
                        f"{'' if r['complete'] else ' INCOMPLETE'}, "
                        f"{r['round_trips']:.2f} round trips/msg, CPU {r['cpu_ms']:.2f} ms/msg, "
                        f"peak {r['peak_sessions']:.0f} sessions per site, "
                        f"{r['dns_queries']:.2f} DNS queries/msg",
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med: dict[str, tuple[float, float, float, int]] = {}
    for label in dict.fromkeys(lbl for lbl, _ in rows):
        mine = [r for lbl, r in rows if lbl == label]
        med[label] = (
            statistics.median(r["rate"] for r in mine),
            statistics.median(r["round_trips"] for r in mine),
            statistics.median(r["cpu_ms"] for r in mine),
            int(max(r["peak_sessions"] for r in mine)),
        )
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    lines = [
        f"Remote-latency scenario, {stamp} UTC: {title}, {args.messages} messages queued "
        f"then released; load average before {load}; medians of {args.repeat} alternating "
        "run(s).",
        "",
        "| system | delivered msg/s | round trips per message | CPU ms per message "
        "| peak sessions per site (most of any run) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, (rate, rt, cpu, peak) in med.items():
        lines.append(f"| {label} | {rate:.0f} | {rt:.2f} | {cpu:.2f} | {peak} |")
    one = med.get("jsqueue x1")
    lines.append("")
    if one:
        for n in counts[1:]:
            m = med.get(f"jsqueue x{n}")
            if m:
                lines.append(f"- ratio {n} workers / 1 worker: {m[0] / one[0]:.2f}x")
    if one and "Postfix" in med:
        for n in counts:
            m = med.get(f"jsqueue x{n}")
            if m:
                lines.append(f"- jsqueue x{n} / Postfix: {m[0] / med['Postfix'][0]:.2f}x")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"remote-{stamp}.md").write_text(text)
    (RESULTS / f"remote-{stamp}.json").write_text(
        json.dumps([{"system": lbl, **r} for lbl, r in rows], indent=1)
    )
    print()
    print(text)


if __name__ == "__main__":
    main()
