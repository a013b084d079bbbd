"""Delivery at real distances: every reply of the receiving MTA arrives ``--delay-ms``
(default 50) after the command it answers (``slow_sink.py``), so delivery is bound by round
trips and concurrency, not CPU. Measures jsqueue's delivered msg/s with 1, 2 and 4 worker
processes (scale by replica count: the ratio 4 workers / 1 worker) and Postfix's on the same
scenario, alternating, with round trips per message as the sink counts them (a client write
that had to wait for a reply; pipelined commands, RFC 2920, count once).

Both systems get the load as in ``compare.py`` (smtp-source, 20 sessions); the figure is
delivered end to end, from the first connection until the sink has counted every message
(with 50 ms per round trip, delivery is the slower half).

    .venv/bin/python bench/remote.py --messages 2000 --repeat 3
    .venv/bin/python bench/remote.py --workers 1,4 --env JSQUEUE_WORKER__CONCURRENCY=40
"""

from __future__ import annotations

import argparse
import json
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
    JsqueueSystem,
    PostfixSystem,
    Result,
    Scenario,
    run_scenario,
)
from postfix import Sink  # noqa: E402

from support.dns import DnsServer  # noqa: E402  (tests/ is put on the path by postfix.py)
from support.postfix import free_port, make_workdir  # noqa: E402

DOMAIN = "remote.example.test"
ADDRESS = "127.0.3.9"


class SlowSink(Sink):
    """:class:`postfix.Sink`'s interface on ``slow_sink.py``; :attr:`round_trips` too."""

    def __init__(self, host: str, port: int, delay_ms: float) -> None:
        super().__init__(host, port)
        self.delay_ms = delay_ms
        self._rt = 0

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

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._rt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--workers", default="1,2,4", help="jsqueue worker process counts")
    parser.add_argument("--no-postfix", action="store_true")
    parser.add_argument("--env", action="append", default=[], help="extra JSQUEUE_X=Y")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    extra_env = dict(e.split("=", 1) for e in args.env)
    sc = Scenario(
        "remote",
        f"4 KB, 1 rcpt, {args.delay_ms:g} ms per round trip",
        args.messages,
        4096,
        [f"sink@{DOMAIN}"],
        args.sessions,
    )
    workdir = make_workdir("jsqueue-remote-")
    port = free_port(ADDRESS)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows: list[tuple[str, Result, float]] = []
    sink = SlowSink(ADDRESS, port, args.delay_ms).start()
    zone = f"{DOMAIN}. MX 10 mx.{DOMAIN}.\nmx.{DOMAIN}. A {ADDRESS}\n"
    try:
        with DnsServer(zone) as dns:
            for rep in range(args.repeat):
                systems: list[tuple[str, object]] = []
                for n in counts:
                    systems.append(
                        (
                            f"jsqueue x{n}",
                            JsqueueSystem(
                                workdir / f"jsq{n}-{rep}",
                                dns,
                                port,
                                extra_env,
                                ADDRESS,
                                n,
                                name=f"jsqueue x{n}",
                            ),
                        )
                    )
                if not args.no_postfix:
                    routes = {DOMAIN: f"[{ADDRESS}]:{port}"}
                    systems.append(("Postfix", PostfixSystem(workdir / f"pf-{rep}", routes)))
                for label, system in systems:
                    rt0 = sink.round_trips
                    r = run_scenario(system, sc, {DOMAIN: sink}, f"r{rep}", None)  # type: ignore[arg-type]
                    rt = (sink.round_trips - rt0) / max(1, r.delivered)
                    rows.append((label, r, rt))
                    print(
                        f"    {label}: delivered {r.delivered_rate:.0f}/s"
                        f"{'' if r.complete else ' INCOMPLETE'}, {rt:.2f} round trips/msg, "
                        f"CPU {r.cpu_ms_per_msg:.2f} ms/msg",
                        flush=True,
                    )
    finally:
        sink.stop()
    med: dict[str, tuple[float, float, int]] = {}
    for label in dict.fromkeys(lbl for lbl, _, _ in rows):
        mine = [(r, rt) for lbl, r, rt in rows if lbl == label]
        med[label] = (
            statistics.median(r.delivered_rate for r, _ in mine),
            statistics.median(rt for _, rt in mine),
            len(mine),
        )
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    lines = [
        f"Remote-latency scenario, {stamp} UTC: {sc.title}, {args.messages} messages, "
        f"{args.sessions} sessions; load average before {load}; medians of "
        f"{args.repeat} alternating run(s).",
        "",
        "| system | delivered msg/s | round trips per message |",
        "|---|---:|---:|",
    ]
    for label, (rate, rt, _) in med.items():
        lines.append(f"| {label} | {rate:.0f} | {rt:.2f} |")
    one = med.get("jsqueue x1")
    if one:
        for n in counts[1:]:
            m = med.get(f"jsqueue x{n}")
            if m:
                lines.append(f"\nratio {n} workers / 1 worker: {m[0] / one[0]:.2f}x")
    if one and "Postfix" in med:
        lines.append(f"jsqueue x1 / Postfix: {one[0] / med['Postfix'][0]:.2f}x")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"remote-{stamp}.md").write_text(text)
    (RESULTS / f"remote-{stamp}.json").write_text(
        json.dumps(
            [
                {
                    "system": lbl,
                    "delivered_rate": r.delivered_rate,
                    "round_trips": rt,
                    "cpu_ms": r.cpu_ms_per_msg,
                }
                for lbl, r, rt in rows
            ],
            indent=1,
        )
    )
    print()
    print(text)


if __name__ == "__main__":
    main()
