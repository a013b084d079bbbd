"""``jsqueue up`` as a real process: the whole queue on an embedded nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import smtplib
import sys
from pathlib import Path

import pytest

from jsqueue.config import Settings, load_settings
from jsqueue.errors import JsqueueError, StoreUnavailable
from jsqueue.runtime import run_services
from jsqueue.worker import Worker
from support.nats import up_env


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _up_env(tmp_path: Path) -> tuple[dict[str, str], int]:
    """Environment for ``jsqueue up`` on free loopback ports (no smarthost answers: port
    9); and its SMTP port."""
    return up_env(tmp_path, os.environ, 9)


async def _send_when_up(smtp_port: int) -> None:
    """Send one message once the front end listens (250 expected)."""
    reply = None
    for _ in range(100):
        try:
            with smtplib.SMTP("127.0.0.1", smtp_port, timeout=5) as client:
                reply = client.sendmail(
                    "alice@example.test", ["bob@example.test"], b"Subject: t\r\n\r\nhi\r\n"
                )
            break
        except OSError:
            await asyncio.sleep(0.2)
    assert reply == {}, "the message was accepted"


async def test_up_accepts_mail_and_stops_when_its_nats_server_dies(tmp_path: Path) -> None:
    """``jsqueue up`` serves SMTP on its embedded nats-server (250 = stored); if that
    server dies, jsqueue does not limp on answering 451 forever: it shuts down with one
    line on stderr and exit code 1, so a supervisor restarts it."""
    env, smtp_port = _up_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jsqueue", "up", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        await _send_when_up(smtp_port)
        nats_pids = _children(proc.pid)
        assert len(nats_pids) == 1
        os.kill(nats_pids[0], signal.SIGKILL)
        code = await asyncio.wait_for(proc.wait(), 60)
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert code == 1
        assert "Traceback" not in err
        assert f"embedded nats-server (pid {nats_pids[0]}) exited unexpectedly" in err
        assert err.strip().splitlines()[-1].startswith("jsqueue: the embedded nats-server died")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _embedded_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    env, _ = _up_env(tmp_path)
    for name, value in env.items():
        if name.startswith("JSQUEUE_"):
            monkeypatch.setenv(name, value)
    return load_settings()


async def test_a_role_failing_at_start_stops_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A role task that ends by itself (here the worker, whose presence write fails at
    start) stops the whole process with that error, instead of leaving a front end that
    takes mail no worker of this process will deliver."""

    async def failing_start(self: Worker) -> None:
        raise StoreUnavailable(f"presence {self.owner}: write: nats: timeout")

    monkeypatch.setattr(Worker, "take_name", failing_start)
    settings = _embedded_settings(tmp_path, monkeypatch)
    stop = asyncio.Event()
    run = run_services(settings, stop, smtp=True, worker=True, embedded=True)
    with pytest.raises(StoreUnavailable, match=r"presence .*: write: nats: timeout"):
        await asyncio.wait_for(run, 60)
    assert stop.is_set()
    assert any("role stopped by itself" in r.getMessage() for r in caplog.records)


async def test_the_servers_death_is_named_whatever_a_role_raises_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the embedded nats-server dies, the error the process ends with says so, even
    when a role fails on its way out for want of that server (a presence write timing
    out): the root cause is the line an operator reads last."""

    async def run_then_fail(self: Worker, stop: asyncio.Event, **_: object) -> None:
        await stop.wait()
        raise StoreUnavailable(f"presence {self.owner}: write: nats: timeout")

    monkeypatch.setattr(Worker, "run", run_then_fail)
    settings = _embedded_settings(tmp_path, monkeypatch)
    stop = asyncio.Event()
    task = asyncio.create_task(run_services(settings, stop, smtp=True, worker=True, embedded=True))
    store = str(tmp_path / "nats")

    def embedded_pid() -> int | None:
        for pid in _children(os.getpid()):
            with contextlib.suppress(OSError):
                if store in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    return pid
        return None

    port = settings.smtp.port
    # smtplib blocks: in a thread of its own, beside the queue's event loop
    await asyncio.to_thread(asyncio.run, _send_when_up(port))
    pid = embedded_pid()
    assert pid is not None, task
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(JsqueueError, match="the embedded nats-server died") as raised:
        await asyncio.wait_for(task, 60)
    assert isinstance(raised.value.__cause__, StoreUnavailable)


async def test_ctrl_c_reaches_jsqueue_which_stops_its_nats_server_after_draining(
    tmp_path: Path,
) -> None:
    """Ctrl-C in the terminal of ``make run`` (SIGINT to the whole process group): the
    embedded nats-server, in a session of its own, does not get it, so the worker can
    record what it sent while draining; jsqueue then stops the server and exits cleanly."""
    env, smtp_port = _up_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        "up",
        env=env,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # a terminal's process group, led by jsqueue
    )
    nats_pid = 0
    try:
        await _send_when_up(smtp_port)
        [nats_pid] = _children(proc.pid)
        assert os.getpgid(nats_pid) != proc.pid, "the nats-server is outside the group"
        os.killpg(proc.pid, signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 60)
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert code == 0, err[-2000:]
        assert "Traceback" not in err and "exited unexpectedly" not in err
        assert not _running(nats_pid), "jsqueue stopped its nats-server"
        # the worker's lease owner name (worker.lease_owner) is logged, for `queue flush`,
        # once taken: a live namesake's makes it `<name>-<random>`
        assert "jsqueue running (smtp=True, worker=True)" in err
        assert re.search(r"worker running, lease owner=\S+", err)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if nats_pid and _running(nats_pid):  # a failed run must not leave it behind
            os.kill(nats_pid, signal.SIGKILL)


async def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while _running(pid) and loop.time() < deadline:  # noqa: ASYNC110 (polls another process)
        await asyncio.sleep(0.05)
    return not _running(pid)


async def test_kill_9_of_up_takes_its_nats_server_along_and_the_next_start_works(
    tmp_path: Path,
) -> None:
    """``kill -9`` of ``jsqueue up``: its nats-server does not stay behind holding the port
    (it gets SIGTERM from the kernel, PR_SET_PDEATHSIG), and ``jsqueue up`` starts again on
    the same ports and store."""
    env, smtp_port = _up_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jsqueue", "up", env=env, stderr=asyncio.subprocess.DEVNULL
    )
    nats_pid = 0
    again = None
    try:
        await _send_when_up(smtp_port)
        [nats_pid] = _children(proc.pid)
        proc.kill()
        await proc.wait()
        assert await _wait_gone(nats_pid), "the nats-server died with its parent"
        again = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jsqueue", "up", env=env, stderr=asyncio.subprocess.PIPE
        )
        await _send_when_up(smtp_port)
    finally:
        for p in (proc, again):
            if p is not None and p.returncode is None:
                p.terminate()
                await p.wait()
        if nats_pid and _running(nats_pid):
            os.kill(nats_pid, signal.SIGKILL)


async def test_nats_command_exits_non_zero_when_its_server_dies(tmp_path: Path) -> None:
    """``jsqueue nats``: when the nats-server it runs dies, it does not keep running with
    nothing listening; it exits 1 with one line saying so, for its supervisor."""
    env, _ = _up_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        "nats",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert ready.startswith(b"nats-server ready on nats://127.0.0.1:")
        [nats_pid] = _children(proc.pid)
        os.kill(nats_pid, signal.SIGKILL)
        code = await asyncio.wait_for(proc.wait(), 30)
        err = (await proc.stderr.read()).decode()
        assert code == 1, err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1] == (
            "jsqueue: the embedded nats-server died; stopped (start again to recover)"
        )
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("args", [["nats"], ["nats", "--cluster"]])
async def test_nats_command_refuses_to_start_a_server_when_nats_urls_are_set(
    tmp_path: Path, args: list[str]
) -> None:
    """With ``nats.urls`` set the queue uses those servers: ``jsqueue nats`` starts nothing,
    and says so in one line naming the setting (exit 2), instead of "ready" over nothing."""
    env, _ = _up_env(tmp_path)
    env["JSQUEUE_NATS__URLS"] = '["nats://jsqueue:secret@127.0.0.1:4999"]'
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert out == b""
    [line] = err.decode().splitlines()
    assert line.startswith("jsqueue: nats.urls is set (nats://jsqueue:**********@127.0.0.1:4999)")
    assert "secret" not in line
    assert not (tmp_path / "nats").exists()


@pytest.mark.parametrize(
    ("setting", "path"),
    [("JSQUEUE_NATS__STORE_DIR", "nats"), ("JSQUEUE_WORKER__BODY_CACHE_DIR", "cache")],
)
async def test_an_unusable_directory_is_one_line_naming_its_setting(
    tmp_path: Path, setting: str, path: str
) -> None:
    """A data directory that cannot be made (its parent is a file): exit 2 and one line
    naming the setting, as for any bad configuration; it was the bare OS error, exit 1."""
    env, _ = _up_env(tmp_path)
    (tmp_path / "afile").write_text("")
    env[setting] = str(tmp_path / "afile" / path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jsqueue", "up", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        code = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.stderr is not None
    last = (await proc.stderr.read()).decode().strip().splitlines()[-1]
    name = setting.removeprefix("JSQUEUE_").lower().replace("__", ".")
    assert code == 2
    assert last == f"jsqueue: invalid configuration: {name} {env[setting]}: Not a directory"
