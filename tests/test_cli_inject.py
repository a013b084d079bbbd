"""``jsqueue inject`` (sendmail-like, sysexits.h statuses) and ``jsqueue token``, run as
real processes against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from jsqueue.errors import ConfigError
from jsqueue.http.auth import TokenFile, token_digest
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream import open_jetstream
from support.nats import make_settings, read_body

MESSAGE = (
    b"From: Cron <cron@example.org>\n"
    b"To: Bob <bob@example.net>\n"
    b"Cc: carol@example.net\n"
    b"Bcc: dave@example.com,\n"
    b"  erin@example.com\n"
    b"Subject: nightly\n"
    b"\n"
    b"all good\n"
)


def cli_env(**extra: str) -> dict[str, str]:
    """The current environment without any JSQUEUE_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSQUEUE_")}
    env["JSQUEUE_LOG__LEVEL"] = "WARNING"
    env.update(extra)
    return env


async def run(*args: str, env: dict[str, str], stdin: bytes = b"") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        *args,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def env_for(nats_server: EmbeddedNats, names: Names) -> dict[str, str]:
    return cli_env(
        JSQUEUE_NATS__URLS=json.dumps([nats_server.url]),
        JSQUEUE_NATS__PREFIX=names.prefix,
        JSQUEUE_SMTP__HOSTNAME="cron.example.org",
    )


async def test_inject_queues_durably_and_t_takes_recipients_without_bcc(
    nats_server: EmbeddedNats, names: Names
) -> None:
    env = env_for(nats_server, names)
    code, out, err = await run(
        "inject", "-v", "-f", "cron@example.org", "bob@example.net", env=env, stdin=MESSAGE
    )
    assert code == 0, err
    first = out.strip()
    code, out, err = await run("inject", "-t", "-v", "-oi", env=env, stdin=MESSAGE)
    assert code == 0, err
    second = out.strip()
    dotted = b"Subject: dot\n\nline\n.\nafter the dot\n"
    code, out, err = await run("inject", "-v", "bob@example.net", env=env, stdin=dotted)
    assert code == 0, err
    third = out.strip()
    code, out, err = await run("inject", "-v", "-i", "bob@example.net", env=env, stdin=dotted)
    assert code == 0, err
    fourth = out.strip()
    # name-addr and angle-addr forms on the command line, as sendmail takes them
    code, out, err = await run(
        "inject", "-v", "Bob <bob@example.net>", "<carol@example.net>", env=env, stdin=MESSAGE
    )
    assert code == 0, err
    fifth = out.strip()
    stores = await open_jetstream(make_settings(prefix=names.prefix), [nats_server.url])
    try:
        one = (await stores.entries.get(first)).entry
        assert one.reverse_path == "cron@example.org"
        assert [r.address for r in one.recipients] == ["bob@example.net"]
        body = await read_body(stores, first)
        assert body.endswith(MESSAGE.replace(b"\n", b"\r\n"))
        assert b"with local id " + first.encode() in body
        two = (await stores.entries.get(second)).entry
        # no -f: the user at smtp.hostname
        assert two.reverse_path.endswith("@cron.example.org")
        assert [r.address for r in two.recipients] == [
            "bob@example.net",
            "carol@example.net",
            "dave@example.com",
            "erin@example.com",
        ]
        body = await read_body(stores, second)
        assert b"Bcc" not in body and b"erin" not in body
        assert body.endswith(b"Cc: carol@example.net\r\nSubject: nightly\r\n\r\nall good\r\n")
        # sendmail: a lone "." ends the message, unless -i
        assert (await read_body(stores, third)).endswith(b"\r\nline\r\n")
        assert (await read_body(stores, fourth)).endswith(b"\r\nline\r\n.\r\nafter the dot\r\n")
        five = (await stores.entries.get(fifth)).entry
        assert [r.address for r in five.recipients] == ["bob@example.net", "carol@example.net"]
    finally:
        await stores.close()


async def test_inject_exit_statuses(nats_server: EmbeddedNats, names: Names) -> None:
    env = env_for(nats_server, names)
    assert (await run("inject", env=env, stdin=MESSAGE))[0] == 64  # no recipient
    assert (await run("inject", "--no-such-option", "a@b.example", env=env))[0] == 64
    assert (await run("inject", "-f", "not a mailbox", "a@b.example", env=env))[0] == 64
    assert (await run("inject", "not-an-address", env=env, stdin=MESSAGE))[0] == 67
    # RFC 3461 §4.1: NEVER stands alone; a bad -N is a usage error, not a bad recipient
    for notify in ("never,success", "sometimes", ","):
        code, _, err = await run("inject", "-N", notify, "a@b.example", env=env, stdin=MESSAGE)
        assert code == 64 and "-N" in err, (notify, err)
    # a bad To: with -t names the address and what is wrong, not a pydantic header line
    code, _, err = await run("inject", "-t", env=env, stdin=b"To: bad <<x>\nSubject: x\n\nx\n")
    assert code == 67, err
    assert "validation error" not in err and "recipient 'x'" in err, err
    # -t with a To: that is not UTF-8 (RFC 6532 §3.2): 65, no recipient guessed from it
    code, _, err = await run("inject", "-t", env=env, stdin=b"To: \xff@b.example\n\nx\n")
    assert code == 65 and "the To field is not UTF-8" in err, err
    # a message gone round too often (RFC 5321 §6.3): refused, 65, as SMTP refuses it
    looped = b"Received: from a by b\n" * 101 + b"Subject: x\n\nx\n"
    code, _, err = await run("inject", "a@b.example", env=env, stdin=looped)
    assert code == 65 and "mail loop" in err, err
    code, _, err = await run("inject", "a@b.example", env=env, stdin=b"Subject: x\r\rbad\n")
    assert code == 65 and "bare CR" in err
    code, _, err = await run("inject", "a@b.example", env=env, stdin=b"x" * 1200 + b"\n")
    assert code == 65
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = dict(env, JSQUEUE_NATS__URLS=json.dumps([f"nats://127.0.0.1:{port}"]))
    down["JSQUEUE_NATS__CONNECT_TIMEOUT_S"] = "1"
    code, _, err = await run("inject", "a@b.example", env=down, stdin=MESSAGE)
    assert code == 75, err
    bad = dict(env, JSQUEUE_SMTP__MAX_RECIPIENTS="zero")
    assert (await run("inject", "a@b.example", env=bad, stdin=MESSAGE))[0] == 78


async def test_token_add_ls_rm(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    env = cli_env(JSQUEUE_API__TOKENS_FILE=str(path))
    code, out, err = await run("token", "add", "ops", "--role", "admin", env=env)
    assert code == 0, err
    token = out.strip()
    assert token.startswith("jsq_") and token not in path.read_text()
    assert path.read_text() == f"ops:admin:sha256:{token_digest(token)}\n"
    assert path.stat().st_mode & 0o077 == 0
    found = TokenFile(path).authenticate(token)
    assert found is not None and found.name == "ops" and found.role == "admin"
    assert (await run("token", "add", "ops", "--role", "read", env=env))[0] == 1  # taken
    assert (await run("token", "add", "app", "--role", "inject", env=env))[0] == 0
    code, out, _ = await run("token", "ls", env=env)
    assert code == 0 and out.splitlines() == ["app\tinject", "ops\tadmin"]
    assert (await run("token", "rm", "ops", env=env))[0] == 0
    assert TokenFile(path).authenticate(token) is None
    assert (await run("token", "rm", "ops", env=env))[0] == 1


async def test_token_commands_on_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    """A tokens file that is not UTF-8: one line naming the file and where, exit 1, for
    each token command; the API refuses to start on it, naming api.tokens_file."""
    path = tmp_path / "tokens"
    path.write_bytes(b"# ops\n\xe9quipe:read:sha256:" + b"0" * 64 + b"\n")
    env = cli_env(JSQUEUE_API__TOKENS_FILE=str(path))
    for args in (("add", "ops", "--role", "read"), ("ls",), ("rm", "ops")):
        code, out, err = await run("token", *args, env=env)
        assert code == 1 and out == "", (args, code, err)
        assert err.strip() == f"jsqueue: {path}: not UTF-8 at line 2, column 1 (byte 0xe9)"
    with pytest.raises(ConfigError, match=r"^api\.tokens_file: .*: not UTF-8 at line 2"):
        TokenFile(path)
