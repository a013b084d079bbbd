"""The Postfix side of the benchmark, and the Postfix package's test tools.

* :func:`postfix_relay` - Postfix as the reference relay (``tests/support/postfix.py``):
  mail for the benchmark domains is queued (cleanup fsyncs the queue file before smtpd
  answers ``250``: Postfix's default, nothing to configure) and relayed to fixed
  ``[address]:port`` next hops (``transport_maps``). Everything else is Postfix's defaults.
* :class:`Sink` - ``smtp-sink`` on one 127.0.3.x address, counting delivered transactions
  (``-c``) and, for the latency runs, dumping each one to a file (``-d``).
* :func:`smtp_source` - ``smtp-source``, the load generator.
* :class:`CpuMeter` / :func:`process_tree` / :func:`peak_rss_kib` - CPU seconds and peak
  RSS from ``/proc``.

Everything binds and connects on 127.0.0.0/8 only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from support.postfix import (  # noqa: E402  (tests/ is put on the path just above)
    SMTP_SINK,
    SMTP_SOURCE,
    Postfix,
    PostfixError,
    require_tools,
)

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces: split after its closing parenthesis.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU of a process; with ``children``, also of its reaped children."""
    f = _stat_fields(pid)  # f[0] is field 3 (state)
    ticks = int(f[11]) + int(f[12])  # utime, stime
    if children:
        ticks += int(f[13]) + int(f[14])  # cutime, cstime
    return ticks * _TICK_S


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, ValueError):
            continue  # exited meanwhile
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def peak_rss_kib(pid: int) -> int:
    """Peak resident set size (``VmHWM``) of a live process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def rss_kib(pid: int) -> int:
    """Current resident set size (``VmRSS``), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class CpuMeter:
    """CPU seconds used by a set of processes (a process tree, reaped children included).

    Args:
        roots: process ids; each counts with its live descendants and its reaped children
            (Postfix's master reaps its smtpd/cleanup/smtp children).
    """

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)

    def total(self) -> float:
        """CPU seconds so far, summed over the trees."""
        total = 0.0
        for root in self.roots:
            for pid in process_tree(root):
                try:
                    total += cpu_seconds(pid, children=True)
                except (OSError, ValueError):
                    continue  # exited between listing and reading: counted in its parent
        return total

    def by_root(self) -> dict[int, float]:
        """CPU seconds so far per root process (its tree included)."""
        return {root: CpuMeter([root]).total() for root in self.roots}


# --------------------------------------------------------------------------- Postfix


def postfix_relay(directory: Path, routes: Mapping[str, str], host: str) -> Postfix:
    """Postfix relaying ``routes`` (domain → ``[address]:port``), smtpd on ``host``."""
    return Postfix.relay(directory, routes, host=host)


def postfix_master_pid(pf: Postfix) -> int:
    """The master process id of a running instance.

    Raises:
        PostfixError: not running.
    """
    pid_file = pf.directory / "queue" / "pid" / "master.pid"
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError) as e:
        raise PostfixError(f"no master pid in {pid_file}") from e


# --------------------------------------------------------------------------- sink


class Sink:
    """``smtp-sink`` on ``host:port`` counting received transactions.

    Args:
        host: 127.0.3.x address to listen on.
        port: TCP port.
        dump_dir: when set, each transaction is written to a file there (``-d``); the
            file's mtime is when the message arrived.
    """

    def __init__(self, host: str, port: int, dump_dir: Path | None = None) -> None:
        require_tools(SMTP_SINK)
        self.host = host
        self.port = port
        self.dump_dir = dump_dir
        self._count = 0
        #: Wall-clock time (``time.time()``) each received message was counted, in order.
        self.arrivals: list[float] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> Sink:
        """Start listening (backlog 1024, up to 1024 sessions)."""
        cmd = [SMTP_SINK, "-u", "nobody", "-c", "-m", "1024"]
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            os.chown(self.dump_dir, 65534, 65534)
            cmd += ["-d", f"{self.dump_dir}/%H%M%S."]
        cmd += [f"{self.host}:{self.port}", "1024"]
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
        """Follow ``-c`` output: ``sess=N quit=N mesg=N`` records separated by CR; note when
        each message was counted (the sink updates the counter when it receives ".")."""
        assert self._proc is not None and self._proc.stdout is not None
        buf = b""
        while chunk := self._proc.stdout.read1(65536):
            now = time.time()
            buf += chunk
            *records, buf = buf.split(b"\r")
            for record in records:
                for f in record.split():
                    if f.startswith(b"mesg="):
                        count = int(f[5:])
                        with self._lock:
                            self.arrivals.extend([now] * (count - self._count))
                            self._count = max(self._count, count)

    @property
    def count(self) -> int:
        """Transactions received so far (the probe connection of :meth:`start` is none)."""
        with self._lock:
            return self._count

    def stop(self) -> None:
        """Stop the sink."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)


# --------------------------------------------------------------------------- source


@dataclass
class SourceRun:
    """One smtp-source run."""

    elapsed_s: float
    output: str


def smtp_source(
    host: str,
    port: int,
    *,
    messages: int,
    sessions: int,
    size: int,
    sender: str,
    recipient: str,
    recipients: int = 1,
    timeout_s: float = 3600.0,
) -> SourceRun:
    """Send ``messages`` messages over ``sessions`` parallel sessions (kept open, ``-d``).

    Args:
        size: payload octets per message (``-l``; smtp-source adds ~150 octets of headers).
        recipients: recipients per message (``-r``; smtp-source numbers them).

    Raises:
        RuntimeError: smtp-source failed (a refused message aborts it).
    """
    require_tools(SMTP_SOURCE)
    cmd = [
        SMTP_SOURCE,
        "-d",
        "-s",
        str(sessions),
        "-m",
        str(messages),
        "-l",
        str(size),
        "-r",
        str(recipients),
        "-f",
        sender,
        "-t",
        recipient,
        "-M",
        "client.example.test",
        f"{host}:{port}",
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"smtp-source failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}"
        )
    return SourceRun(elapsed, proc.stdout + proc.stderr)
