"""The HTTP API in a real ``jsqueue smtp`` process (front end + HTTP endpoint) against a
real nats-server, for tests that drive it from synchronous code (schemathesis).

``api_process`` (module-scoped fixture) starts a nats-server on port 0, writes a tokens
file with one token per role, and runs ``python -m jsqueue smtp`` with the SMTP and HTTP
ports 0; the HTTP port is read from the process's log. Both are stopped at teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jsqueue.nats_server import EmbeddedNats
from support.api import make_tokens
from support.nats import unique_names

_HTTP_RE = re.compile(r"HTTP endpoint on (http://\S+)/metrics")


@dataclass
class ApiProcess:
    """A running ``jsqueue smtp`` with the API: base URL, tokens by role, NATS URL."""

    url: str
    tokens: dict[str, str]
    nats_url: str
    prefix: str
    log: Path

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}


def start_jsqueue(
    args: list[str], env: dict[str, str], log: Path, timeout_s: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m jsqueue ARGS`` with its log in ``log``; (process, HTTP base URL)."""
    out = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jsqueue", *args], env=env, stdout=out, stderr=out
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = _HTTP_RE.search(log.read_text(errors="replace"))
        if m:
            return proc, m[1]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"jsqueue did not start: {log.read_text(errors='replace')[-2000:]}")


def jsqueue_env(nats_url: str, prefix: str, tokens_file: Path, **extra: str) -> dict[str, str]:
    """Environment for a jsqueue process of a test: its NATS, ports 0, the tokens file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSQUEUE_")}
    env.update(
        JSQUEUE_NATS__URLS=json.dumps([nats_url]),
        JSQUEUE_NATS__PREFIX=prefix,
        JSQUEUE_NATS__REQUEST_TIMEOUT_S="2",
        JSQUEUE_SMTP__PORT="0",
        JSQUEUE_SMTP__STORE_TIMEOUT_S="5",
        JSQUEUE_HTTP__PORT="0",
        JSQUEUE_HTTP__QUEUE_DEPTH_INTERVAL_S="0",
        JSQUEUE_API__TOKENS_FILE=str(tokens_file),
        JSQUEUE_API__SSE_KEEPALIVE_S="1",
    )
    env.update(extra)
    return env


def seed(api: ApiProcess, count: int = 5) -> None:
    """Queue ``count`` messages over the API, so listings and actions meet real entries
    (no worker runs in ``jsqueue smtp``: they stay queued until an action removes them)."""
    import base64

    import requests

    raw = base64.b64encode(b"Subject: seed\r\n\r\nbody\r\n").decode()
    for i in range(count):
        r = requests.post(
            api.url + "/api/v1/inject",
            headers=api.auth("inject"),
            json={
                "reverse_path": "seed@example.test",
                "recipients": [{"address": f"r{i}@dest{i % 2}.example.test"}],
                "raw_base64": raw,
            },
            timeout=30,
        )
        assert r.status_code == 202, r.text


@pytest.fixture(scope="module")
def api_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """``jsqueue smtp`` with the API on a nats-server of its own."""
    tmp = tmp_path_factory.mktemp("api")
    nats = EmbeddedNats(tmp / "nats", port=0)
    asyncio.run(nats.start())
    try:
        tokens = make_tokens(tmp / "tokens")
        prefix = unique_names().prefix
        log = tmp / "jsqueue.log"
        proc, url = start_jsqueue(["smtp"], jsqueue_env(nats.url, prefix, tmp / "tokens"), log)
        try:
            api = ApiProcess(url, tokens, nats.url, prefix, log)
            seed(api)
            yield api
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        nats.kill()
