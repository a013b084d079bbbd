"""A randomized fault soak ("nemesis") of the replicated queue, with a checker.

Real processes, all on loopback, in a work directory of their own: a three-node NATS
cluster (:class:`~jsqueue.nats_cluster.EmbeddedCluster`: every bucket and stream R3,
``sync_interval: always``), two front ends (``jsqueue smtp``), three workers (``jsqueue
worker``, each with its own lease owner and EHLO name), a DNS server and a counting sink MX
(``tests/support``). A steady load (``--rate`` messages per second, half through each
front end, each message to its own recipient) is sent by clients that retry a 4xx or a lost
connection like a real client (:func:`~support.cluster.send_load`, paced).

For ``--duration`` seconds, two tracks of faults at random intervals (``--seed``, printed):

* NATS: SIGKILL of a node (a random one, or the leader of the work, entries or bodies
  stream or of the workers' consumer), or SIGSTOP of a node for 6-12 s then SIGCONT; the
  node comes back, and the next fault waits until every replica is current again: never
  two nodes down or paused at once, so a quorum always stands;
* processes: SIGKILL or SIGTERM of a worker, SIGKILL of a front end; restarted a few
  seconds later.

Then a quiet period until the sink has every acknowledged message (``--drain-timeout``),
and the checker (``bench/nemesis_report.py``): acknowledged but never delivered (must be
0), duplicates at the sink and what explains each, refusals and the longest time a client
saw them, deferrals for the queue's own store trouble, 250 -> delivered latency, processes
that died by themselves (must be 0). One line per figure; ``--json`` writes the summary.

Exit status 1 when a message was lost, a process died by itself or a duplicate is
unexplained; with ``--strict`` also on any refusal or store-trouble deferral (targets of
fixes under way). Every loop is bounded in time and count; every process is killed at the
end, on Ctrl-C and on an error.

Usage::

    python bench/nemesis.py [--duration 180] [--seed N] [--rate 24] [--strict]
                            [--json summary.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
for path in (HERE, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from nemesis_report import (  # noqa: E402  (bench/ is put on the path just above)
    Death,
    Fault,
    Summary,
    check_clients,
    check_faults,
    check_sink,
    check_worker_logs,
    count_refusals_with_quorum,
    explain_duplicates,
    read_log,
    resent_messages,
)

from jsqueue.config import (  # noqa: E402
    HttpSettings,
    NatsSettings,
    ReconcilerSettings,
    RetrySettings,
    Settings,
    SmtpSettings,
    WorkerSettings,
)
from jsqueue.errors import JsqueueError  # noqa: E402
from jsqueue.names import Names  # noqa: E402
from jsqueue.nats_cluster import SERVER_NAME_PREFIX, EmbeddedCluster, server_name  # noqa: E402
from support.cluster import (  # noqa: E402  (tests/ is put on the path just above)
    CountingMx,
    JsqueueProc,
    Load,
    free_port,
    jsqueue_env,
    send_load,
)
from support.dns import DnsServer  # noqa: E402
from support.mx import shared_port  # noqa: E402

DOMAIN = "sink.nemesis.example.test"
SINK_IP = "127.0.2.210"
ZONE = f"{DOMAIN}. 300 IN MX 10 mx.{DOMAIN}.\nmx.{DOMAIN}. 300 IN A {SINK_IP}\n"
FRONTENDS = 2
WORKERS = 3
#: Front end n sends messages n * INDEX_STRIDE + 0, 1, 2 ...
INDEX_STRIDE = 1_000_000

#: Settings shorter than the product's defaults, and why: a fault must not leave mail
#: waiting longer than the quiet period of a short soak.
SHORTENED = {
    "worker.lease_s=30 (600)": "a lease the presence check cannot clear runs out in 30 s",
    "worker.drain_timeout_s=10 (20)": "a SIGTERMed worker stops within 10 s",
    "retry.base_s=5, factor 1.5, max_delay_s=30 (300, 2, 4 h)": "a deferral for the "
    "queue's own trouble (body not found, store unavailable) is retried within seconds",
    "reconciler.interval_s=10, lost_trigger_after_s=30 (60, 300)": "an entry whose work "
    "item was lost is queued again within the soak",
}


def soak_settings(urls: list[str], dns: DnsServer, mx_port: int) -> Settings:
    """The settings every process shares (see :data:`SHORTENED`)."""
    return Settings(
        nats=NatsSettings(urls=urls, replicas=3),
        smtp=SmtpSettings(port=free_port(), max_sessions=1000),
        worker=WorkerSettings(
            mx_port=mx_port,
            nameservers=dns.nameservers,
            nameserver_port=dns.port,
            lease_s=30.0,
            drain_timeout_s=10.0,
            connect_timeout_s=5.0,
        ),
        retry=RetrySettings(base_s=5.0, factor=1.5, max_delay_s=30.0, jitter=0.1),
        reconciler=ReconcilerSettings(interval_s=10.0, lost_trigger_after_s=30.0),
        http=HttpSettings(enabled=False),
    )


def recipient(index: int) -> str:
    """The address of message ``index`` (as :func:`~support.cluster.load_message`)."""
    return f"m{index}@{DOMAIN}"


# --------------------------------------------------------------------------- the fleet


@dataclass
class Service:
    """A jsqueue process the nemesis may stop, and whether it should be running."""

    name: str
    proc: JsqueueProc
    ready: str
    up: bool = False

    async def start(self) -> None:
        """Start and wait for the ready line.

        Raises:
            JsqueueError: it exited or never got ready.
        """
        try:
            await self.proc.start(self.ready, timeout_s=60.0)
        except pytest.fail.Exception as e:  # JsqueueProc reports as a test would
            raise JsqueueError(f"{self.name} did not start: {e}") from None
        self.up = True


@dataclass
class Fleet:
    """Every process of the soak: the cluster's nodes, the front ends, the workers."""

    cluster: EmbeddedCluster
    frontends: list[Service]
    workers: list[Service]
    smtp_ports: list[int]
    prefix: str
    nodes_up: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def build(cls, cluster: EmbeddedCluster, settings: Settings, base: Path) -> Fleet:
        env = {**jsqueue_env(settings), "JSQUEUE_LOG__JSON_FORMAT": "true"}
        ports = [free_port() for _ in range(FRONTENDS)]
        frontends = []
        for n, port in enumerate(ports, 1):
            fe_env = {**env, "JSQUEUE_SMTP__PORT": str(port)}
            proc = JsqueueProc(["smtp"], fe_env, base / f"frontend-{n}.log")
            frontends.append(Service(f"frontend-{n}", proc, r"listening on [\d.]+:\d+"))
        workers = []
        for n in range(1, WORKERS + 1):
            proc = JsqueueProc(["worker"], worker_env(env, base, n), base / f"worker-{n}.log")
            workers.append(Service(f"worker-{n}", proc, r"worker running"))
        nodes = {server_name(n): True for n in range(1, cluster.size + 1)}
        return cls(cluster, frontends, workers, ports, settings.nats.prefix, nodes)

    @property
    def services(self) -> list[Service]:
        return [*self.frontends, *self.workers]

    async def start(self) -> None:
        """The first worker (it provisions the streams and buckets), then the others."""
        await self.workers[0].start()
        await asyncio.gather(*(s.start() for s in self.services[:FRONTENDS] + self.workers[1:]))

    async def kill_all(self) -> None:
        """SIGKILL everything (paused nodes included). Idempotent."""
        for s in self.services:
            s.up = False
            await s.proc.kill()
        self.cluster.kill()


def worker_env(env: dict[str, str], base: Path, n: int) -> dict[str, str]:
    """Worker ``n``'s own lease owner (a pod name), EHLO name and body cache."""
    return {
        **env,
        "JSQUEUE_WORKER__LEASE_OWNER": f"worker-{n}",
        "JSQUEUE_WORKER__EHLO_NAME": ehlo_name(n),
        "JSQUEUE_WORKER__BODY_CACHE_DIR": str(base / f"cache-{n}"),
    }


def ehlo_name(worker: int) -> str:
    return f"worker-{worker}.nemesis.example.test"


# --------------------------------------------------------------------------- the nemesis


class Nemesis:
    """Two tracks of faults (NATS nodes; jsqueue processes) from ``t0`` until ``until``
    (monotonic), a journal of what was done, and a watch for processes that die by
    themselves."""

    def __init__(self, fleet: Fleet, names: Names, seed: int, t0: float, until: float) -> None:
        self.fleet = fleet
        self.names = names
        self.t0 = t0
        self.until = until
        self.nats_rng = random.Random(f"{seed}-nats")
        self.proc_rng = random.Random(f"{seed}-processes")
        self.faults: list[Fault] = []
        self.deaths: list[Death] = []

    # ------------------------------------------------------------------ tracks

    async def nats_track(self) -> None:
        """NATS faults one at a time, each once every replica is current again."""
        rng = self.nats_rng
        while await self._pause_until_next(rng.uniform(8.0, 20.0)):
            try:
                await self.fleet.cluster.wait_for_replicas(max(1.0, self.until - time.monotonic()))
            except JsqueueError as e:
                print(f"  no NATS fault: {e}", flush=True)
                continue
            kind = rng.choices(["nats-kill", "nats-kill-leader", "nats-pause"], [2, 2, 3])[0]
            if kind == "nats-pause":
                await self._pause_node(rng.randint(1, 3), rng.uniform(6.0, 12.0))
            elif kind == "nats-kill":
                await self._kill_node(kind, rng.randint(1, 3), rng.uniform(3.0, 12.0))
            else:
                node, led = await self._leader(rng)
                await self._kill_node(kind, node, rng.uniform(3.0, 12.0), f"leader of {led}")

    async def process_track(self) -> None:
        """Worker and front end faults, one at a time."""
        rng = self.proc_rng
        while await self._pause_until_next(rng.uniform(6.0, 15.0)):
            kind = rng.choices(["worker-kill", "worker-term", "frontend-kill"], [3, 2, 2])[0]
            pool = self.fleet.frontends if kind == "frontend-kill" else self.fleet.workers
            await self._stop_service(kind, rng.choice(pool), rng.uniform(2.0, 10.0))

    async def _pause_until_next(self, gap_s: float) -> bool:
        """Wait ``gap_s`` (not past the end); whether there is time for another fault."""
        await asyncio.sleep(max(0.0, min(gap_s, self.until - time.monotonic())))
        return time.monotonic() < self.until

    # ------------------------------------------------------------------ NATS faults

    async def _leader(self, rng: random.Random) -> tuple[int, str]:
        """The node leading a random one of the queue's streams or the workers' consumer,
        and which; a random node when no leader is known."""
        cluster, names = self.fleet.cluster, self.names
        stream = rng.choice([names.work_stream, names.entries_stream, names.bodies_stream, ""])
        try:
            if stream:
                leader = await cluster.stream_leader(stream, 5.0)
            else:
                stream = f"{names.work_stream}/{names.work_consumer}"
                leader = await cluster.consumer_leader(names.work_stream, names.work_consumer, 5.0)
        except JsqueueError:
            return rng.randint(1, 3), f"{stream} (unknown: a random node)"
        return int(leader.removeprefix(SERVER_NAME_PREFIX)), stream

    async def _kill_node(self, kind: str, node: int, down_s: float, detail: str = "") -> None:
        name = server_name(node)
        fault = self._note(kind, name, detail)
        self.fleet.nodes_up[name] = False
        self.fleet.cluster.node(node).kill()
        await asyncio.sleep(down_s)
        try:
            await self.fleet.cluster.node(node).start()
        except JsqueueError as e:
            self._died(name, None, str(e))
            return
        self.fleet.nodes_up[name] = True
        fault.back_at = time.monotonic()

    async def _pause_node(self, node: int, paused_s: float) -> None:
        name = server_name(node)
        pid = self.fleet.cluster.node(node).pid
        if pid is None:
            return
        fault = self._note("nats-pause", name, f"{paused_s:.1f} s")
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(paused_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        fault.back_at = time.monotonic()

    # ------------------------------------------------------------------ process faults

    async def _stop_service(self, kind: str, service: Service, down_s: float) -> None:
        if not service.up:
            return
        fault = self._note(kind, service.name)
        service.up = False
        if kind == "worker-term":
            fault.detail = f"exit status {await service.proc.stop(timeout_s=30.0)}"
        else:
            await service.proc.kill()
        await asyncio.sleep(down_s)
        try:
            await service.start()
        except JsqueueError as e:
            self._died(service.name, service.proc.proc and service.proc.proc.returncode, str(e))
            return
        fault.back_at = time.monotonic()

    # ------------------------------------------------------------------ journal, watch

    def _note(self, kind: str, target: str, detail: str = "") -> Fault:
        fault = Fault(kind, target, time.monotonic(), time.time(), detail=detail)
        self.faults.append(fault)
        print(f"  {fault.at - self.t0:6.1f} s  {kind} {target} {detail}".rstrip(), flush=True)
        return fault

    def _died(self, name: str, returncode: int | None, tail: str) -> None:
        self.deaths.append(Death(name, time.monotonic(), returncode, tail[-2000:]))
        print(f"  DIED BY ITSELF: {name} (status {returncode})", flush=True)

    async def watch(self, stop: asyncio.Event) -> None:
        """Every 0.25 s until ``stop``: a process that should run and does not has died
        by itself (it is recorded once and left down)."""
        while not stop.is_set():
            for s in self.fleet.services:
                if s.up and not s.proc.running:
                    s.up = False
                    code = s.proc.proc.returncode if s.proc.proc else None
                    self._died(s.name, code, s.proc.log())
            for name, up in self.fleet.nodes_up.items():
                if up and not self.fleet.cluster.node(name).running:
                    self.fleet.nodes_up[name] = False
                    self._died(name, None, "nats-server exited")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


# --------------------------------------------------------------------------- the run


@contextlib.contextmanager
def work_directory(given: Path | None) -> Iterator[Path]:
    """``given`` (created, kept), or a temporary directory removed afterwards."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="jsq-nemesis-") as tmp:
        yield Path(tmp)


async def run(args: argparse.Namespace) -> Summary:
    """Set up, load and hit the fleet, drain, check; everything is killed on the way out
    (also on SIGTERM, which cancels the run as Ctrl-C does)."""
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    with work_directory(args.workdir) as base, DnsServer(ZONE) as dns:
        cluster = EmbeddedCluster(base / "cluster", 3, client_port=0)
        fleet: Fleet | None = None
        try:
            await cluster.start()
            port = shared_port([SINK_IP])
            async with CountingMx(SINK_IP, port) as mx:
                fleet = Fleet.build(cluster, soak_settings(cluster.urls, dns, port), base)
                await fleet.start()
                return await soak(args, fleet, mx, base)
        finally:
            if fleet is not None:
                await fleet.kill_all()
            cluster.kill()


async def soak(args: argparse.Namespace, fleet: Fleet, mx: CountingMx, base: Path) -> Summary:
    """The load and the faults for ``args.duration`` s, the drain, the figures."""
    t0 = time.monotonic()
    nemesis = Nemesis(fleet, Names(fleet.prefix), args.seed, t0, until=t0 + args.duration)
    loads = {s.name: Load() for s in fleet.frontends}
    stop_watch = asyncio.Event()
    watching = asyncio.create_task(nemesis.watch(stop_watch))
    try:
        sending = [send(fleet, n, loads, args) for n in range(FRONTENDS)]
        tracks = [nemesis.nats_track(), nemesis.process_track()]
        await bounded(asyncio.gather(*sending, *tracks), args.duration + 300, "load and faults")
        quiet = time.monotonic()
        wanted = {recipient(i) for load in loads.values() for i in load.accepted()}
        arrived = await drain(mx, wanted, args.drain_timeout)
        drain_s = time.monotonic() - quiet if arrived else None
    finally:
        stop_watch.set()
        await watching
    return report(args, nemesis, loads, mx, base, t0, drain_s)


async def send(fleet: Fleet, n: int, loads: dict[str, Load], args: argparse.Namespace) -> None:
    """Front end ``n``'s half of the load, paced, until ``args.duration``."""
    rate = args.rate / FRONTENDS
    fe = fleet.frontends[n]
    await send_load(
        "127.0.0.1",
        fleet.smtp_ports[n],
        round(rate * args.duration),
        DOMAIN,
        first=n * INDEX_STRIDE,
        clients=8,
        retry_pause_s=0.5,
        max_tries=240,
        timeout_s=30.0,
        rate_per_s=rate,
        load=loads[fe.name],
    )


async def bounded(work: Awaitable[object], timeout_s: float, what: str) -> None:
    try:
        await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        print(f"  {what}: still running after {timeout_s:g} s; cut short", flush=True)


async def drain(mx: CountingMx, wanted: set[str], timeout_s: float) -> bool:
    """Wait until the sink has every recipient of ``wanted``; whether it did in time."""
    seen: set[str] = set()
    seen_upto = 0

    def everything() -> bool:
        nonlocal seen_upto
        seen.update(r for _, r in mx.arrivals[seen_upto:])
        seen_upto = len(mx.arrivals)
        return wanted <= seen

    try:
        await mx.wait_for(everything, timeout_s)
    except TimeoutError:
        return False
    return True


def report(
    args: argparse.Namespace,
    nemesis: Nemesis,
    loads: dict[str, Load],
    mx: CountingMx,
    base: Path,
    t0: float,
    drain_s: float | None,
) -> Summary:
    summary = Summary(args.seed, args.duration, args.rate, SHORTENED, drain_s=drain_s)
    logs = [
        line
        for n in range(1, WORKERS + 1)
        for line in read_log(f"worker-{n}", base / f"worker-{n}.log")
    ]
    check_faults(summary, nemesis.faults, nemesis.deaths, t0)
    check_clients(summary, loads, t0)
    count_refusals_with_quorum(summary, loads, nemesis.faults, nemesis.deaths)
    copies = check_sink(summary, loads, mx, recipient)
    worker_of = {ehlo_name(n): f"worker-{n}" for n in range(1, WORKERS + 1)}
    resent = resent_messages(loads, recipient)
    wall_offset_s = time.time() - time.monotonic()
    explain_duplicates(summary, copies, nemesis.faults, logs, worker_of, resent, wall_offset_s)
    check_worker_logs(summary, logs)
    return summary


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of faults")
    parser.add_argument("--seed", type=int, default=None, help="random when not given")
    parser.add_argument("--rate", type=float, default=24.0, help="messages per second")
    parser.add_argument(
        "--drain-timeout", type=float, default=180.0, help="longest quiet period, seconds"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="refusals and store-trouble deferrals fail the run too",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and stores here")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"nemesis: seed {args.seed}, {args.duration:g} s of faults, {args.rate:g} msg/s", flush=True
    )
    try:
        summary = asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped before the end; every process was killed")
        return 130
    for line in summary.lines():
        print(line)
    if args.json is not None:
        args.json.write_text(summary.to_json())
    failures = summary.failures(args.strict)
    for why in failures:
        print(f"FAIL: {why}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
