"""jsqueue side by side with Postfix: same load, same durability, same sink.

One command (``make bench`` or ``python bench/compare.py``) runs every scenario against

* **jsqueue** as real processes through its CLI: ``jsqueue nats`` (the embedded
  nats-server, ``sync_interval: always``: every write is fsynced before it is
  acknowledged), ``jsqueue smtp`` (front end) and ``jsqueue worker`` (``--workers``);
  the worker sends to the sink as its smarthost (``--routing static``, the default: no
  DNS, like Postfix's transport map) or resolves MX records through a DNS server on
  loopback (``--routing dns``, ``tests/support/dns.py``);
* **jsqueue, inline bodies**: the same with ``smtp.inline_body_max = 131072`` (bodies up to
  128 KiB kept in their KV entry instead of the object store; opt-in, see README.md), so
  both layouts are measured in the same run (``--systems`` picks a subset);
* **Postfix** (Debian's package) as a relay: its cleanup fsyncs each queue file before
  smtpd answers ``250`` (Postfix's default); ``transport_maps`` send each domain to its
  sink, no DNS.

Both deliver to the same ``smtp-sink`` processes (one per destination domain, on
127.0.3.x and one port). Load comes from ``smtp-source`` (20 sessions kept open), except
where smtp-source cannot express the envelope (10 recipients over 2 domains) or per-message
timing is needed (latency): there a small asyncio SMTP client (``--loadgen``, same one for
both systems, in its own process) sends. Each system is started fresh for each scenario.

Scenarios (``--messages`` scales the first; the others default to a quarter of it):

1. 4 KB, 1 recipient, 20 sessions: ingest rate (250s per second while smtp-source runs)
   and end-to-end delivered rate (messages per second from the first connection until
   the sink has them all);
2. 4 KB, 10 recipients over 2 domains (5 + 5), 20 sessions;
3. 100 KB, 1 recipient, 20 sessions;
4. latency from the ``250`` to arrival at the sink (when the sink counted it; dump files
   say which message it was), p50 / p99, at a light load (one session,
   ``--latency-rate`` messages per second);
5. jsqueue only: worker RSS with ``--deferred`` deferred entries (KV entries plus work
   items due in an hour, written straight to JetStream), then a delivery run on top.

For each: rates, the ratio jsqueue / Postfix, CPU seconds per message (every process of
the system; reaped children included), peak RSS of each jsqueue process. The table
(markdown) is printed and saved under ``bench/results/`` with the date and the machine;
``--repeat`` runs each scenario several times (jsqueue and Postfix alternating) and
reports medians.
``--profile`` also samples the front end and the worker with py-spy during the first scenario
run.

Nothing leaves 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from postfix import (  # noqa: E402  (bench/ is put on the path just above)
    CpuMeter,
    Postfix,
    Sink,
    peak_rss_kib,
    postfix_master_pid,
    process_tree,
    rss_kib,
    smtp_source,
)

from support.dns import DnsServer  # noqa: E402  (tests/ is put on the path by postfix.py)
from support.postfix import (  # noqa: E402
    JsqueueProcess,
    free_port,
    loopback_address,
    make_workdir,
)

RESULTS = HERE / "results"
SENDER = "bench@src.example.test"
#: The jsqueue configurations measured: name → label in the table.
VARIANTS = {
    "jsqueue": "jsqueue",
    "jsqueue-inline": "jsqueue, inline bodies",
    "jsqueue-synced-work": "jsqueue, work stream synced",
    "jsqueue-one-process": "jsqueue, front end and worker in one process",
    "jsqueue-baseline": "jsqueue, baseline (--baseline)",
}
#: The settings that make each configuration (environment variables).
VARIANT_ENV: dict[str, dict[str, str]] = {
    "jsqueue": {},
    "jsqueue-inline": {"JSQUEUE_SMTP__INLINE_BODY_MAX": str(128 * 1024)},
    # an fsync per work item and ack, as before 2026-12-02 (the A/B of that change)
    "jsqueue-synced-work": {"JSQUEUE_NATS__WORK_FSYNC": "true"},
    # `jsqueue up` (front end and worker in one interpreter) against the nats of `jsqueue nats`
    "jsqueue-one-process": {},
    # the code of another checkout (--baseline DIR, e.g. a `git worktree` of main): A/B
    "jsqueue-baseline": {},
}
SINK_ADDRESSES = {
    "bench1.example.test": "127.0.3.1",
    "bench2.example.test": "127.0.3.2",
    "lat.example.test": "127.0.3.3",
}


# --------------------------------------------------------------------------- load generator


def _payload(size: int) -> bytes:
    line = b"X" * 76 + b"\r\n"
    return line * max(1, size // len(line))


async def _reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    lines = []
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("server closed the connection")
        lines.append(line)
        if line[3:4] != b"-":
            return int(line[:3]), b"".join(lines)


async def _loadgen_session(
    host: str,
    port: int,
    next_index: Callable[[], int | None],
    args: argparse.Namespace,
    payload: bytes,
    t250: dict[str, float],
    failures: list[str],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)

    async def command(line: bytes, expect: int) -> None:
        writer.write(line)
        code, text = await _reply(reader)
        if code // 100 != expect // 100:
            raise RuntimeError(f"{line.strip()!r}: {text.decode(errors='replace').strip()}")

    try:
        code, text = await _reply(reader)
        if code != 220:
            raise RuntimeError(f"greeting: {text!r}")
        await command(b"EHLO client.example.test\r\n", 250)
        while (i := next_index()) is not None:
            token = f"{args.run}.{i}"
            head = (
                f"From: <{args.sender}>\r\nTo: <{args.rcpt[0]}>\r\n"
                f"Subject: bench {token}\r\nMessage-ID: <{token}@client.example.test>\r\n\r\n"
            ).encode()
            try:
                await command(f"MAIL FROM:<{args.sender}>\r\n".encode(), 250)
                for rcpt in args.rcpt:
                    await command(f"RCPT TO:<{rcpt}>\r\n".encode(), 250)
                await command(b"DATA\r\n", 354)
                writer.write(head + payload + b".\r\n")
                code, text = await _reply(reader)
                if code != 250:
                    raise RuntimeError(text.decode(errors="replace").strip())
                t250[token] = time.time()
            except RuntimeError as e:
                failures.append(str(e))
                await command(b"RSET\r\n", 250)
        await command(b"QUIT\r\n", 221)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _loadgen(args: argparse.Namespace) -> None:
    payload = _payload(args.size)
    t250: dict[str, float] = {}
    failures: list[str] = []
    started = time.monotonic()
    counter = iter(range(args.messages))

    def next_index() -> int | None:
        return next(counter, None)

    if args.rate > 0:
        plain = next_index
        # One global schedule: message i is sent no earlier than started + i / rate.

        def next_index() -> int | None:  # type: ignore[misc]  # rate-limited variant
            i = plain()
            if i is not None:
                delay = started + i / args.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # one session at light load: blocking is harmless
            return i

    await asyncio.gather(
        *(
            _loadgen_session(args.host, args.port, next_index, args, payload, t250, failures)
            for _ in range(args.sessions)
        )
    )
    elapsed = time.monotonic() - started
    json.dump({"elapsed_s": elapsed, "t250": t250, "failures": failures[:20]}, sys.stdout)


@dataclass
class LoadRun:
    """What one load-generator run (smtp-source or ours) reported."""

    elapsed_s: float
    t250: dict[str, float] = field(default_factory=dict)


def run_loadgen(
    host: str,
    port: int,
    *,
    messages: int,
    sessions: int,
    size: int,
    recipients: list[str],
    run: str,
    rate: float = 0.0,
) -> LoadRun:
    """Run the asyncio load generator in its own process.

    Raises:
        RuntimeError: a message was refused or the generator failed.
    """
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--loadgen",
        "--host",
        host,
        "--port",
        str(port),
        "--messages",
        str(messages),
        "--sessions",
        str(sessions),
        "--size",
        str(size),
        "--run",
        run,
        "--rate",
        str(rate),
        "--sender",
        SENDER,
    ]
    for r in recipients:
        cmd += ["--rcpt", r]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout)
    if out["failures"]:
        raise RuntimeError(f"messages refused: {out['failures'][:3]}")
    return LoadRun(out["elapsed_s"], out["t250"])


# --------------------------------------------------------------------------- systems


class System:
    """A system under test: where to submit, which processes to meter."""

    name = ""
    host = "127.0.0.1"
    port = 0

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def meter(self) -> CpuMeter:
        raise NotImplementedError

    def peaks(self) -> dict[str, int]:
        """Peak RSS per process, KiB."""
        return {}

    def processes(self) -> dict[str, int]:
        """Process ids by role (profiling)."""
        return {}


class JsqueueSystem(System):
    """``jsqueue nats`` + ``jsqueue smtp`` + ``jsqueue worker`` as child processes."""

    name = "jsqueue"

    def __init__(
        self,
        workdir: Path,
        dns: DnsServer,
        mx_port: int,
        env: dict[str, str],
        smarthost: str | None = None,
        workers: int = 1,
        name: str = "jsqueue",
    ) -> None:
        self.name = name
        self.workdir = workdir
        routing = (
            {"JSQUEUE_WORKER__SMARTHOST": json.dumps({"host": smarthost, "port": mx_port})}
            if smarthost
            else {}
        )
        self.env = {
            **routing,
            "JSQUEUE_NATS__STORE_DIR": str(workdir / "nats"),
            "JSQUEUE_NATS__PORT": "0",
            "JSQUEUE_SMTP__HOST": "127.0.0.1",
            "JSQUEUE_SMTP__PORT": "0",
            "JSQUEUE_SMTP__HOSTNAME": "jsqueue.bench.example.test",
            "JSQUEUE_WORKER__MX_PORT": str(mx_port),
            "JSQUEUE_WORKER__NAMESERVERS": f'["{dns.host}"]',
            "JSQUEUE_WORKER__NAMESERVER_PORT": str(dns.port),
            "JSQUEUE_WORKER__EHLO_NAME": "jsqueue.bench.example.test",
            "JSQUEUE_WORKER__BODY_CACHE_DIR": str(workdir / "cache"),
            "JSQUEUE_HTTP__PORT": "0",
            **env,
        }
        self.nats: JsqueueProcess | None = None
        self.smtp: JsqueueProcess | None = None
        self.worker: JsqueueProcess | None = None
        self.extra_workers: list[JsqueueProcess] = []
        self.workers = workers
        self.nats_url = ""
        self._nats_server_pid = 0

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nats = JsqueueProcess(["nats"], self.env, self.workdir / "nats.log").start()
        self.nats_url = self.nats.wait_for_log(r"nats-server ready on (nats://\S+)").group(1)
        self._nats_server_pid = next(p for p in process_tree(self.nats.pid) if p != self.nats.pid)
        env = {**self.env, "JSQUEUE_NATS__URLS": json.dumps([self.nats_url])}
        if self.name == "jsqueue-one-process":
            self.smtp = JsqueueProcess(["up"], env, self.workdir / "up.log").start()
            self.worker = self.smtp
        else:
            self.smtp = JsqueueProcess(["smtp"], env, self.workdir / "smtp.log").start()
            self.worker = JsqueueProcess(["worker"], env, self.workdir / "worker.log").start()
        # a name of its own per extra worker process, as each pod has (namesakes on one
        # host would wait for each other's presence beat first)
        self.extra_workers = [
            JsqueueProcess(
                ["worker"],
                {**env, "JSQUEUE_WORKER__LEASE_OWNER": f"worker{i}"},
                self.workdir / f"worker{i}.log",
            ).start()
            for i in range(2, self.workers + 1)
        ]
        self.port = int(self.smtp.wait_for_log(r"listening on [\d.]+:(\d+)").group(1))
        for w in (self.worker, *self.extra_workers):
            w.wait_for_log(r"jsqueue running")

    def stop(self) -> None:
        for proc in dict.fromkeys((self.smtp, self.worker, *self.extra_workers, self.nats)):
            if proc is not None:
                proc.stop()

    def meter(self) -> CpuMeter:
        assert self.nats and self.smtp and self.worker
        extra = [w.pid for w in self.extra_workers]
        pids = dict.fromkeys([self.nats.pid, self.smtp.pid, self.worker.pid, *extra])
        return CpuMeter(list(pids))

    def peaks(self) -> dict[str, int]:
        assert self.smtp and self.worker
        return {
            "jsqueue smtp": peak_rss_kib(self.smtp.pid),
            "jsqueue worker": peak_rss_kib(self.worker.pid),
            "nats-server": peak_rss_kib(self._nats_server_pid),
        }

    def processes(self) -> dict[str, int]:
        assert self.smtp and self.worker
        extra = {f"worker{i}": w.pid for i, w in enumerate(self.extra_workers, 2)}
        if self.smtp is self.worker:
            return {"up": self.smtp.pid, **extra}
        return {"smtp": self.smtp.pid, "worker": self.worker.pid, **extra}


class PostfixSystem(System):
    """Postfix as a relay from its own config dir."""

    name = "Postfix"

    def __init__(self, workdir: Path, routes: dict[str, str]) -> None:
        self.workdir = workdir
        self.routes = routes
        self.pf: Postfix | None = None

    def start(self) -> None:
        self.pf = Postfix.relay(self.workdir, self.routes, host=loopback_address(20))
        self.pf.start()
        self.host, self.port = self.pf.host, self.pf.port

    def stop(self) -> None:
        if self.pf is not None:
            self.pf.stop()

    def meter(self) -> CpuMeter:
        assert self.pf is not None
        return CpuMeter([postfix_master_pid(self.pf)])


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    """One load shape."""

    key: str
    title: str
    messages: int
    size: int
    recipients: list[str]
    sessions: int = 20
    tool: str = "smtp-source"
    rate: float = 0.0

    @property
    def domains(self) -> list[str]:
        return sorted({r.rsplit("@", 1)[1] for r in self.recipients})

    @property
    def transactions(self) -> int:
        """Transactions the sinks receive: one per message and destination domain."""
        return self.messages * len(self.domains)


@dataclass
class Result:
    """One scenario on one system."""

    system: str
    scenario: str
    messages: int
    ingest_s: float
    delivered_s: float
    delivered: int
    cpu_s: float
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    peak_rss_kib: dict[str, int] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)
    complete: bool = True
    harness_cpu_s: float = 0.0  # this process: DNS server threads, sink counters
    fsyncs: int | None = None  # fsync + fdatasync calls of the nats-server (--strace)

    @property
    def fsyncs_per_msg(self) -> float | None:
        return None if self.fsyncs is None else self.fsyncs / self.messages

    @property
    def ingest_rate(self) -> float:
        return self.messages / self.ingest_s

    @property
    def delivered_rate(self) -> float:
        return self.delivered / self.delivered_s

    @property
    def cpu_ms_per_msg(self) -> float:
        return 1000 * self.cpu_s / self.messages


def _wait_delivered(sinks: list[Sink], target: int, timeout_s: float) -> tuple[float, int, bool]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = sum(s.count for s in sinks)
        if got >= target:
            return time.monotonic(), got, True
        if time.monotonic() > deadline:
            return time.monotonic(), got, False
        time.sleep(0.01)


def _start_strace(system: System, out: Path) -> subprocess.Popen[bytes] | None:
    """``strace -c`` of the nats-server's fsyncs (jsqueue only), ended with SIGINT. Attached
    to a running process, strace stops it at every system call: the rates of such a run are
    far lower than without it, and the count is the point."""
    pid = getattr(system, "_nats_server_pid", 0)
    if not pid:
        return None
    cmd = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(out), "-p", str(pid)]
    tracer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached to every thread before the load starts
    return tracer


def _strace_calls(tracer: subprocess.Popen[bytes], out: Path) -> int:
    tracer.send_signal(2)
    tracer.wait(timeout=30)
    calls = 0
    for line in out.read_text().splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(parts) >= 5 and parts[-1] in ("fsync", "fdatasync"):
            calls += int(parts[3])
    return calls


def run_scenario(
    system: System,
    scenario: Scenario,
    sinks: dict[str, Sink],
    run: str,
    profile: Path | None,
    strace: Path | None = None,
) -> Result:
    """Start ``system`` fresh, send the load, wait until the sinks have everything."""
    print(f"  {system.name}: {scenario.title} ...", flush=True)
    system.start()
    spies: list[subprocess.Popen[bytes]] = []
    try:
        used = [sinks[d] for d in scenario.domains]
        base = sum(s.count for s in used)
        meter = system.meter()
        roots = meter.by_root()
        cpu0 = meter.total()
        own0 = _own_cpu()
        if profile is not None:
            spies = _start_profilers(system, profile / f"{run}-{system.name}")
        tracer = _start_strace(system, strace) if strace is not None else None
        started = time.monotonic()
        if scenario.tool == "smtp-source":
            src = smtp_source(
                system.host,
                system.port,
                messages=scenario.messages,
                sessions=scenario.sessions,
                size=scenario.size,
                sender=SENDER,
                recipient=scenario.recipients[0],
            )
            load = LoadRun(src.elapsed_s)
        else:
            load = run_loadgen(
                system.host,
                system.port,
                messages=scenario.messages,
                sessions=scenario.sessions,
                size=scenario.size,
                recipients=scenario.recipients,
                run=run,
                rate=scenario.rate,
            )
        timeout = max(120.0, scenario.transactions / 20)
        done_at, got, complete = _wait_delivered(used, base + scenario.transactions, timeout)
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
        cpu = meter.total() - cpu0
        fsyncs = _strace_calls(tracer, strace) if tracer is not None and strace else None
        harness_cpu = _own_cpu() - own0
        after = meter.by_root()
        names = {v: k for k, v in system.processes().items()}
        by_process: dict[str, float] = {}
        for pid in after:  # unnamed roots (jsqueue: `jsqueue nats` and its nats-server) as one
            role = names.get(pid, "other")
            by_process[role] = by_process.get(role, 0.0) + after[pid] - roots[pid]
        result = Result(
            system=system.name,
            scenario=scenario.key,
            messages=scenario.messages,
            ingest_s=load.elapsed_s,
            delivered_s=done_at - started,
            delivered=(got - base) // len(scenario.domains),
            cpu_s=cpu,
            cpu_by_process=by_process,
            peak_rss_kib=system.peaks(),
            complete=complete,
            harness_cpu_s=harness_cpu,
            fsyncs=fsyncs,
        )
        if load.t250:
            result.latency_ms = _latencies(load.t250, sinks["lat.example.test"], base)
        return result
    finally:
        for spy in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(timeout=60)
        system.stop()


def _own_cpu() -> float:
    """CPU seconds of this process (the DNS server's threads and the sink readers)."""
    t = os.times()
    return t.user + t.system


def _latencies(t250: dict[str, float], sink: Sink, first: int) -> list[float]:
    """250 → arrival per message, ms; the sink's dump files are removed.

    Arrival is when the sink counted the message (its ``-c`` counter, read from a pipe as
    it changes). Which message it was comes from the dump files, ordered by mtime (coarse,
    but the light load keeps messages tens of ms apart).
    """
    assert sink.dump_dir is not None
    found = []
    for path in sink.dump_dir.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        start = data.find(b"Message-ID: <")
        if start >= 0:
            token = data[start + 13 : data.index(b"@", start)].decode()
            if token in t250:
                found.append((path.stat().st_mtime_ns, t250[token]))
        path.unlink()
    found.sort()
    arrivals = sink.arrivals[first:]
    if len(arrivals) != len(found):
        raise RuntimeError(f"{len(found)} dump files but {len(arrivals)} arrivals counted")
    return [1000 * (arrived - sent) for arrived, (_, sent) in zip(arrivals, found, strict=True)]


def _start_profilers(system: System, base: Path) -> list[subprocess.Popen[bytes]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    procs = []
    for role, pid in system.processes().items():
        out = base.with_name(f"{base.name}-{role}.txt")
        procs.append(
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--format",
                    "raw",
                    "--rate",
                    "200",
                    "--gil",
                    "--output",
                    str(out),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


_LINE_NO = re.compile(r":\d+\)$")


def summarize_profile(path: Path, top: int = 20) -> str:
    """Top functions of a py-spy raw profile (collapsed stacks): share of samples spent
    in each (inclusive) and on top of the stack (self), line numbers folded."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_LINE_NO.sub(")", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return f"{path.name}: no samples\n"
    skip = ("asyncio/", "runpy", "typer/", "click/", "threading.py", "jsqueue/cli/", "__main__")
    rows = [(f, n) for f, n in inclusive.most_common() if not any(x in f for x in skip)]
    out = [f"{path.name}: {total} samples", "inclusive:"]
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in rows[:top]]
    out.append("self:")
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top // 2)]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- deferred backlog


async def _populate(nats_url: str, count: int, domain: str) -> float:
    """Write ``count`` deferred entries (KV) and their work items (due in an hour)."""
    from jsqueue.config import NatsSettings
    from jsqueue.envelope import Entry, Recipient, RecipientState, WorkItem, utcnow
    from jsqueue.names import new_queue_id
    from jsqueue.replies import Reply
    from jsqueue.store.jetstream import open_jetstream

    # the loader must not set the consumer back to the defaults (e.g. max_ack_pending)
    stores = await open_jetstream(NatsSettings(), [nats_url], update=False)
    started = time.monotonic()
    now = utcnow()
    later = now + timedelta(hours=1)
    reply = Reply(code=451, enhanced="4.7.1", text="try again later", remote_host="mx")
    numbers = iter(range(count))

    async def writer() -> None:
        for i in numbers:  # 512 writers share one iterator: no task per entry
            await one(i)

    async def one(i: int) -> None:
        qid = new_queue_id()
        rcpt = Recipient(
            address=f"deferred{i}@{domain}",
            domain=domain,
            state=RecipientState.DEFERRED,
            attempts=1,
            last_attempt_at=now,
            next_attempt_at=later,
            last_reply=reply,
        )
        entry = Entry(id=qid, reverse_path=SENDER, recipients=[rcpt], created_at=now, size=4096)
        await stores.entries.create(entry)
        await stores.scheduler.schedule(WorkItem(qid, domain), at=later)

    try:
        # 512 writes in flight; a task per entry (a million of them) would stall the loop
        # on its first pass long enough for the first requests to time out
        await asyncio.gather(*(writer() for _ in range(512)))
    finally:
        await stores.close()
    return time.monotonic() - started


async def _consumer_state(nats_url: str) -> tuple[int, int]:
    from jsqueue.config import NatsSettings
    from jsqueue.names import Names
    from jsqueue.store.jetstream import connect_nats

    names = Names(NatsSettings().prefix)
    nc = await connect_nats(NatsSettings(), [nats_url])
    try:
        info = await nc.jetstream().consumer_info(names.work_stream, names.work_consumer)
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)
    finally:
        await nc.close()


def run_deferred(
    system: JsqueueSystem, count: int, scenario: Scenario, sinks: dict[str, Sink], run: str
) -> dict[str, Any]:
    """Worker RSS with ``count`` deferred entries, then a delivery run on top of them."""
    print(f"  jsqueue: {count} deferred entries ...", flush=True)
    system.start()
    try:
        assert system.worker is not None
        rss_before = rss_kib(system.worker.pid)
        took = asyncio.run(_populate(system.nats_url, count, "deferred.example.test"))
        print(f"    populated in {took:.1f} s", flush=True)
        deadline = time.monotonic() + 600
        while True:
            pending, ack_pending = asyncio.run(_consumer_state(system.nats_url))
            if pending == 0 and ack_pending >= count:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker did not take the backlog: {pending} pending")
            time.sleep(0.5)
        rss_idle = rss_kib(system.worker.pid)
        used = [sinks[d] for d in scenario.domains]
        base = sum(s.count for s in used)
        started = time.monotonic()
        src = smtp_source(
            system.host,
            system.port,
            messages=scenario.messages,
            sessions=scenario.sessions,
            size=scenario.size,
            sender=SENDER,
            recipient=scenario.recipients[0],
        )
        done_at, got, complete = _wait_delivered(
            used, base + scenario.transactions, max(120.0, scenario.transactions / 20)
        )
        return {
            "deferred": count,
            "populate_s": took,
            "worker_rss_mib_before": rss_before / 1024,
            "worker_rss_mib_with_backlog": rss_idle / 1024,
            "worker_peak_rss_mib": peak_rss_kib(system.worker.pid) / 1024,
            "messages": scenario.messages,
            "ingest_rate": scenario.messages / src.elapsed_s,
            "delivered_rate": (got - base) / (done_at - started),
            "complete": complete,
        }
    finally:
        system.stop()


# --------------------------------------------------------------------------- report


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    pf = subprocess.run(
        ["/usr/sbin/postconf", "-d", "-h", "mail_version"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    from jsqueue.nats_server import find_nats_server

    nats = subprocess.run(
        [str(find_nats_server()), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return (
        f"{platform.node()}: {os.cpu_count()} × {cpu}, {mem_gib:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
        f"{nats}, Postfix {pf}"
    )


def _fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


@dataclass
class Summary:
    """The runs of one scenario on one system: medians, pooled latencies, RSS maxima."""

    runs: int
    ingest_rate: float
    delivered_rate: float
    cpu_ms_per_msg: float
    cpu_by_process: dict[str, float]
    peak_rss_kib: dict[str, int]
    latency_ms: list[float]
    complete: bool
    fsyncs_per_msg: float | None = None


def summarize(results: list[Result]) -> Summary:
    """Medians over repeated runs (latency samples pooled, peak RSS the largest)."""
    keys = {k for r in results for k in r.cpu_by_process}
    rss_keys = {k for r in results for k in r.peak_rss_kib}
    return Summary(
        runs=len(results),
        ingest_rate=statistics.median(r.ingest_rate for r in results),
        delivered_rate=statistics.median(r.delivered_rate for r in results),
        cpu_ms_per_msg=statistics.median(r.cpu_ms_per_msg for r in results),
        cpu_by_process={
            k: statistics.median(r.cpu_by_process.get(k, 0.0) for r in results) for k in keys
        },
        peak_rss_kib={k: max(r.peak_rss_kib.get(k, 0) for r in results) for k in rss_keys},
        latency_ms=[x for r in results for x in r.latency_ms],
        complete=all(r.complete for r in results),
        fsyncs_per_msg=statistics.median(f)
        if (f := [x for r in results if (x := r.fsyncs_per_msg) is not None])
        else None,
    )


def report(
    results: list[Result],
    deferred: dict[str, Any] | None,
    scenarios: list[Scenario],
    routing: str,
    load_before: str,
) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    variants = [v for v in VARIANTS if any(r.system == v for r in results)]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.system, r.scenario), []).append(r)
    by = {key: summarize(rs) for key, rs in groups.items()}
    runs = max((s.runs for s in by.values()), default=0)
    route = (
        "jsqueue's worker sends to the sink as its smarthost (an IP address: no DNS), "
        "as Postfix does with `transport_maps`"
        if routing == "static"
        else "jsqueue's worker looks up MX records in a DNS server on loopback for every "
        "delivery; Postfix uses `transport_maps` (no DNS)"
    )
    lines = [
        f"# jsqueue vs Postfix — {now}",
        "",
        f"Machine: {machine()}; load average before the run: {load_before}.",
        "",
        "Both fsync before answering 250 (jsqueue: embedded nats-server with "
        "`sync_interval: always`; Postfix: its default). Both deliver to the same "
        f"`smtp-sink`. Routing: {route}. jsqueue runs as `jsqueue nats`, `jsqueue smtp` and "
        "`jsqueue worker` with default settings otherwise (events, metrics endpoint and "
        "reconciler on). Rates in messages per second, medians of "
        f"{runs} run(s) each, the systems alternating. CPU is every process of the "
        "system (jsqueue: nats-server + front end + worker; Postfix: master and all its "
        "children), load generator and sink not included.",
        "",
        "| scenario | metric | "
        + " | ".join(VARIANTS[v] for v in variants)
        + " | Postfix | "
        + " | ".join(f"{VARIANTS[v]} / Postfix" for v in variants)
        + " |",
        "|---|---|" + "---:|" * (2 * len(variants) + 1),
    ]
    for sc in scenarios:
        js = [by.get((v, sc.key)) for v in variants]
        p = by.get(("Postfix", sc.key))
        if sc.key == "latency":
            for label, q in (("p50", 50), ("p99", 99)):
                jv = [_percentile(j.latency_ms, q) if j else None for j in js]
                pv = _percentile(p.latency_ms, q) if p else None
                lines.append(_row(sc.title, f"250 → delivered {label}, ms", jv, pv, 1))
            continue
        done = all(x.complete for x in (*js, p) if x is not None)
        flag = "" if done else " (INCOMPLETE)"
        for title, metric, attr, digits in (
            (sc.title + flag, "ingest, msg/s", "ingest_rate", 0),
            (sc.title, "delivered end to end, msg/s", "delivered_rate", 0),
            (sc.title, "CPU ms per message", "cpu_ms_per_msg", 2),
        ):
            values = [getattr(j, attr) if j else None for j in js]
            lines.append(_row(title, metric, values, getattr(p, attr) if p else None, digits))
        fsyncs = [j.fsyncs_per_msg if j else None for j in js]
        if any(f is not None for f in fsyncs):
            lines.append(_row(sc.title, "nats-server fsyncs per message (strace)", fsyncs, None, 2))
    lines += [
        "",
        "jsqueue processes: peak RSS (MiB) and CPU seconds per run (median):",
        "",
        "| scenario | smtp RSS | worker RSS | nats-server RSS | smtp CPU s | worker CPU s "
        "| nats CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sc in scenarios:
        for v in variants:
            j = by.get((v, sc.key))
            if not j:
                continue
            rss = j.peak_rss_kib
            cpu = j.cpu_by_process
            nats = cpu.get("other", 0.0)
            title = sc.title if v == "jsqueue" else f"{sc.title} ({VARIANTS[v]})"
            lines.append(
                f"| {title} | {rss.get('jsqueue smtp', 0) / 1024:.0f} | "
                f"{rss.get('jsqueue worker', 0) / 1024:.0f} | "
                f"{rss.get('nats-server', 0) / 1024:.0f} | {cpu.get('smtp', 0):.1f} | "
                f"{cpu.get('worker', 0):.1f} | {nats:.1f} |"
            )
    if deferred:
        lines += [
            "",
            f"Deferred backlog: {deferred['deferred']:,} deferred entries (KV entries and work "
            f"items due in an hour, populated in {deferred['populate_s']:.0f} s), all taken by "
            "the worker and held back (NAK with delay): worker RSS "
            f"{deferred['worker_rss_mib_with_backlog']:.0f} MiB (before: "
            f"{deferred['worker_rss_mib_before']:.0f} MiB); then {deferred['messages']:,} × "
            f"4 KB on top: ingest {deferred['ingest_rate']:.0f} msg/s, delivered "
            f"{deferred['delivered_rate']:.0f} msg/s"
            f"{'' if deferred['complete'] else ' (INCOMPLETE)'}; worker peak RSS "
            f"{deferred['worker_peak_rss_mib']:.0f} MiB.",
        ]
    lines += ["", f"Command: `python bench/compare.py {' '.join(sys.argv[1:])}`".rstrip()]
    return "\n".join(lines) + "\n"


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _row(title: str, metric: str, js: list[float | None], p: float | None, digits: int = 0) -> str:
    """One table row: each jsqueue variant's value, Postfix's, then each ratio."""
    cells = [_fmt(j, digits) if j is not None else "—" for j in js]
    cells.append(_fmt(p, digits) if p is not None else "—")
    cells += [f"{j / p:.2f}" if j is not None and p else "—" for j in js]
    return f"| {title} | {metric} | " + " | ".join(cells) + " |"


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def sinks_running(port: int, workdir: Path) -> Iterator[dict[str, Sink]]:
    sinks = {
        domain: Sink(addr, port, workdir / "dump" if domain.startswith("lat.") else None)
        for domain, addr in SINK_ADDRESSES.items()
    }
    try:
        for s in sinks.values():
            s.start()
        yield sinks
    finally:
        for s in sinks.values():
            s.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="scenario 1 messages")
    parser.add_argument("--multi-messages", type=int, help="scenario 2 messages (N/4)")
    parser.add_argument("--big-messages", type=int, help="scenario 3 messages (N/4)")
    parser.add_argument("--sessions", type=int, default=20, help="concurrent sessions")
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario and system")
    parser.add_argument("--workers", type=int, default=1, help="jsqueue worker processes")
    parser.add_argument("--latency-messages", type=int, default=300)
    parser.add_argument("--latency-rate", type=float, default=20.0, help="messages/s")
    parser.add_argument("--deferred", type=int, default=100_000, help="0 skips")
    parser.add_argument(
        "--scenarios",
        default="small,multi,big,latency",
        help="comma-separated subset of small,multi,big,latency",
    )
    parser.add_argument(
        "--systems",
        default="jsqueue,jsqueue-inline,postfix",
        help="comma-separated subset of " + ",".join([*VARIANTS, "postfix"]),
    )
    parser.add_argument(
        "--routing",
        choices=["static", "dns"],
        default="static",
        help="static: jsqueue sends to the sink as its smarthost (no DNS), as Postfix does "
        "with transport_maps; dns: jsqueue looks up MX records in the loopback DNS server",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the jsqueue processes")
    parser.add_argument(
        "--strace", action="store_true", help="count the nats-server's fsyncs (strace -c)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--env", action="append", default=[], help="extra JSQUEUE_X=Y")
    parser.add_argument(
        "--baseline", type=Path, help="checkout whose jsqueue package jsqueue-baseline runs"
    )
    # load-generator mode (internal)
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=4096, help=argparse.SUPPRESS)
    parser.add_argument("--run", default="x", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--sender", default=SENDER, help=argparse.SUPPRESS)
    parser.add_argument("--rcpt", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        asyncio.run(_loadgen(args))
        return

    n = args.messages
    quarter = max(1, n // 4)
    all_scenarios = {
        "small": Scenario(
            "small", "4 KB, 1 rcpt", n, 4096, ["sink@bench1.example.test"], args.sessions
        ),
        "multi": Scenario(
            "multi",
            "4 KB, 10 rcpts / 2 domains",
            args.multi_messages or quarter,
            4096,
            [f"r{i}@bench{1 + i % 2}.example.test" for i in range(10)],
            args.sessions,
            tool="loadgen",
        ),
        "big": Scenario(
            "big",
            "100 KB, 1 rcpt",
            args.big_messages or quarter,
            100 * 1024,
            ["sink@bench1.example.test"],
            args.sessions,
        ),
        "latency": Scenario(
            "latency",
            f"latency at {args.latency_rate:g} msg/s",
            args.latency_messages,
            4096,
            ["sink@lat.example.test"],
            1,
            tool="loadgen",
            rate=args.latency_rate,
        ),
    }
    scenarios = [all_scenarios[k] for k in args.scenarios.split(",") if k]
    systems = args.systems.split(",")
    extra_env = dict(e.split("=", 1) for e in args.env)
    if "jsqueue-baseline" in systems:
        if args.baseline is None:
            raise SystemExit("jsqueue-baseline needs --baseline DIR")
        VARIANT_ENV["jsqueue-baseline"] = {"PYTHONPATH": str(args.baseline.resolve())}

    workdir = make_workdir("jsqueue-bench-")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    profile_dir = RESULTS / f"profile-{stamp}" if args.profile else None
    if profile_dir:
        profile_dir.mkdir()
    sink_port = free_port(
        SINK_ADDRESSES["bench1.example.test"], others=list(SINK_ADDRESSES.values())[1:]
    )
    zone = (
        "".join(f"{d}. MX 10 mx.{d}.\nmx.{d}. A {a}\n" for d, a in SINK_ADDRESSES.items())
        + "deferred.example.test. MX 10 mx.bench1.example.test.\n"
    )
    routes = {d: f"[{a}]:{sink_port}" for d, a in SINK_ADDRESSES.items()}
    results: list[Result] = []
    deferred: dict[str, Any] | None = None
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])

    def make_system(name: str, sc: Scenario, rep: int) -> System:
        if name in VARIANTS:
            smarthost = SINK_ADDRESSES[sc.domains[0]] if args.routing == "static" else None
            return JsqueueSystem(
                workdir / f"{name}-{sc.key}-{rep}",
                dns,
                sink_port,
                {**VARIANT_ENV[name], **extra_env},
                smarthost,
                args.workers,
                name=name,
            )
        return PostfixSystem(workdir / f"pf-{sc.key}-{rep}", routes)

    try:
        with DnsServer(zone) as dns, sinks_running(sink_port, workdir) as sinks:
            for sc in scenarios:
                print(f"{sc.title}: {sc.messages} messages", flush=True)
                for rep in range(args.repeat):
                    # Every other round in the other order (A B, B A, ...): a run costs
                    # more right after another (the writes of the one before are still
                    # being flushed), and a fixed order gave that cost to one system.
                    for name in systems if rep % 2 == 0 else systems[::-1]:
                        system = make_system(name, sc, rep)
                        prof = profile_dir if sc is scenarios[0] and rep == 0 else None
                        run = f"{sc.key}{rep}x{random.randrange(10**6)}"
                        trace = workdir / f"strace-{run}.txt" if args.strace else None
                        r = run_scenario(system, sc, sinks, run, prof, trace)
                        results.append(r)
                        print(
                            f"    ingest {r.ingest_rate:.0f}/s, delivered "
                            f"{r.delivered_rate:.0f}/s{'' if r.complete else ' INCOMPLETE'}, "
                            f"CPU {r.cpu_ms_per_msg:.2f} ms/msg, harness CPU "
                            f"{r.harness_cpu_s:.1f} s"
                            + (
                                f", fsyncs {r.fsyncs_per_msg:.2f}/msg"
                                if r.fsyncs_per_msg is not None
                                else ""
                            )
                            + (
                                f", latency p50 {_percentile(r.latency_ms, 50):.1f} ms"
                                if r.latency_ms
                                else ""
                            ),
                            flush=True,
                        )
            jsqueues = [v for v in VARIANTS if v in systems]
            if args.deferred and jsqueues:
                small = Scenario(
                    "small",
                    "4 KB, 1 rcpt",
                    min(n, 5000),
                    4096,
                    ["sink@bench1.example.test"],
                    args.sessions,
                )
                smarthost = SINK_ADDRESSES[small.domains[0]] if args.routing == "static" else None
                env = {**VARIANT_ENV[jsqueues[0]], **extra_env}
                deferred = run_deferred(
                    JsqueueSystem(workdir / "jsq-deferred", dns, sink_port, env, smarthost),
                    args.deferred,
                    small,
                    sinks,
                    "deferred",
                )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, deferred, scenarios, args.routing, load_before)
    out = RESULTS / f"compare-{stamp}.md"
    out.write_text(text)
    (RESULTS / f"compare-{stamp}.json").write_text(
        json.dumps({"results": [asdict(r) for r in results], "deferred": deferred}, indent=1)
    )
    print()
    print(text)
    print(f"saved {out}")
    if profile_dir:
        for prof_file in sorted(profile_dir.glob("*.txt")):
            if prof_file.name.endswith(".summary.txt"):
                continue
            summary = summarize_profile(prof_file)
            prof_file.with_suffix(".summary.txt").write_text(summary)
            print(summary)


if __name__ == "__main__":
    main()
