"""``jsqueue up`` as a real process: the whole queue on an embedded nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
import smtplib
import sys
from pathlib import Path

from support.mx import shared_port


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


async def test_up_accepts_mail_and_stops_when_its_nats_server_dies(tmp_path: Path) -> None:
    """``jsqueue up`` serves SMTP on its embedded nats-server (250 = stored); if that
    server dies, jsqueue does not limp on answering 451 forever: it shuts down with one
    line on stderr and exit code 1, so a supervisor restarts it."""
    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(shared_port(["127.0.0.1"]))
    smtp_port, nats_port, http_port = sorted(ports)
    env = {
        **os.environ,
        "JSQUEUE_NATS__STORE_DIR": str(tmp_path / "nats"),
        "JSQUEUE_NATS__PORT": str(nats_port),
        "JSQUEUE_SMTP__PORT": str(smtp_port),
        "JSQUEUE_HTTP__PORT": str(http_port),
        "JSQUEUE_WORKER__SMARTHOST__HOST": "127.0.0.1",
        "JSQUEUE_WORKER__SMARTHOST__PORT": "9",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jsqueue", "up", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
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
