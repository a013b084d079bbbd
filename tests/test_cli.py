"""The ``jsqueue`` command line, run as a real child process (``python -m jsqueue``)
against the test's nats-server and a real queue: listings, show, stats, every action,
events tail, check, and the exit codes (0 ok, 1 runtime failure, 2 usage)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import uvloop
from test_admin import DEST_ZONE, MESSAGE, RCPT

from jsqueue.envelope import EntryState, RecipientState
from jsqueue.events import Event, EventKind
from jsqueue.names import Names, new_queue_id
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream import open_jetstream
from jsqueue.views import BulkResult, EntryDetail, EntrySummary, Outcome, QueueStats
from support.mx import SmtpdMx
from support.nats import make_entry, make_settings, read_body
from support.queue import Harness, eventually

TIMEOUT_S = 60.0


@dataclass
class Run:
    code: int
    out: str
    err: str
    raw: bytes

    def json_lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


def cli_env(**extra: str) -> dict[str, str]:
    """The current environment without any JSQUEUE_ setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSQUEUE_")}
    env["JSQUEUE_LOG__LEVEL"] = "WARNING"
    env.update(extra)
    return env


async def jsqueue(*args: str, env: dict[str, str]) -> Run:
    """Run ``python -m jsqueue ARGS`` to completion (bounded)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jsqueue",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), out)


def queue_env(nats_server: EmbeddedNats, names: Names) -> dict[str, str]:
    return cli_env(
        JSQUEUE_NATS__URLS=json.dumps([nats_server.url]), JSQUEUE_NATS__PREFIX=names.prefix
    )


async def test_ls_show_stats(
    queue_harness: Harness, nats_server: EmbeddedNats, names: Names
) -> None:
    """``queue ls`` (mailq lines, JSON lines, --limit with a continuation hint), ``queue
    show`` (text, JSON, --body as stored), ``queue stats --json``."""
    h = queue_harness
    env = queue_env(nats_server, names)
    first = await h.submit(MESSAGE, [RCPT])
    second = await h.submit(MESSAGE, ["other@else.example.test"], sender="bob@example.test")

    ls = await jsqueue("queue", "ls", env=env)
    assert ls.code == 0, ls.err
    lines = ls.out.splitlines()
    assert lines[0].startswith("-Queue ID-")
    assert lines[1].startswith(first) and "alice@example.test" in lines[1]
    assert any(RCPT in line and "[pending]" in line for line in lines)
    assert any(line.startswith(second) for line in lines)
    assert lines[-1].endswith("in 2 Requests.")

    ls_json = await jsqueue("queue", "ls", "--json", "--sender", "bob@example.test", env=env)
    assert ls_json.code == 0, ls_json.err
    [only] = [EntrySummary.model_validate(x) for x in ls_json.json_lines()]
    assert only.id == second and only.state is EntryState.PENDING

    limited = await jsqueue("queue", "ls", "--json", "--limit", "1", env=env)
    assert [x["id"] for x in limited.json_lines()] == [first]
    assert f"--after {first}" in limited.err

    show = await jsqueue("queue", "show", first, env=env)
    assert show.code == 0, show.err
    assert f"id:           {first}" in show.out and f"<{RCPT}>  pending" in show.out
    show_json = await jsqueue("queue", "show", first, "--json", env=env)
    detail = EntryDetail.model_validate_json(show_json.out)
    assert detail.id == first and detail.recipients[0].address == RCPT
    body = await jsqueue("queue", "show", first, "--body", env=env)
    assert body.code == 0 and body.raw == await read_body(h.stores, first)

    stats = await jsqueue("queue", "stats", "--json", env=env)
    assert stats.code == 0, stats.err
    parsed = QueueStats.model_validate_json(stats.out)
    assert parsed.entries == 2 and parsed.by_state == {EntryState.PENDING: 2}
    assert set(parsed.by_domain) == {"dest.example.test", "else.example.test"}
    assert parsed.oldest_id == first


async def test_actions_and_events_tail(
    queue_harness: Harness, nats_server: EmbeddedNats, names: Names
) -> None:
    """hold / release / flush --domain / bounce / delete through the CLI on a real queue with
    a worker: a message deferred for hours is flushed and delivered; results as JSON; the
    events tail shows what happened; a missing id exits 1."""
    h = queue_harness
    h.configure(retry={"base_s": 3 * 3600.0, "max_age_s": 86400.0})
    h.dns.add(DEST_ZONE)
    env = queue_env(nats_server, names)
    async with SmtpdMx("127.0.2.20", h.mx_port, rcpt_replies={RCPT: "450 4.2.0 busy"}) as mx:
        qid = await h.submit(MESSAGE, [RCPT])
        async with h.running():

            async def deferred() -> bool:
                e = await h.entry(qid)
                return e is not None and e.recipients[0].state is RecipientState.DEFERRED

            await eventually(deferred, what="deferred")
            hold = await jsqueue("queue", "hold", qid, "--json", env=env)
            assert hold.code == 0, hold.err
            result = BulkResult.model_validate_json(hold.out)
            assert result.counts == {Outcome.DONE: 1}
            held = await jsqueue("queue", "ls", "--state", "held", "--json", env=env)
            assert [x["id"] for x in held.json_lines()] == [qid]
            release = await jsqueue("queue", "release", qid, env=env)
            assert release.code == 0 and f"{qid}: release done" in release.out
            mx.rcpt_replies.clear()
            flush = await jsqueue("queue", "flush", "--domain", "dest.example.test", env=env)
            assert flush.code == 0, flush.err
            assert "flush: 1 matched; 1 done" in flush.out
            await eventually(lambda: len(mx.delivered) == 1, what="delivered after flush")
    assert [t.rcpt_to for t in mx.delivered] == [[RCPT]]

    other = await h.submit(MESSAGE, ["x@nowhere.example.test"])
    bounce = await jsqueue("queue", "bounce", other, "--json", env=env)
    assert BulkResult.model_validate_json(bounce.out).counts == {Outcome.DONE: 1}
    delete = await jsqueue("queue", "delete", other, env=env)
    assert delete.code == 0 and f"{other}: delete done" in delete.out
    again = await jsqueue("queue", "delete", other, env=env)
    assert again.code == 1 and "not-found" in again.out
    third = await h.submit(MESSAGE, ["y@nowhere.example.test"])
    delete_all = await jsqueue("queue", "delete", "--all", "--json", env=env)
    assert delete_all.code == 0, delete_all.err
    result = BulkResult.model_validate_json(delete_all.out)
    assert result.counts == {Outcome.DONE: 1} and result.results[0].queue_id == third

    tail = await jsqueue(
        "events", "tail", "--from-start", "--count", "5", "--json",
        "--kind", "held", "--kind", "released", "--kind", "flushed", "--kind", "deleted",
        env=env,
    )  # fmt: skip
    assert tail.code == 0, tail.err
    events = [Event.model_validate(x) for x in tail.json_lines()]
    assert [(e.kind, e.queue_id) for e in events] == [
        (EventKind.HELD, qid),
        (EventKind.RELEASED, qid),
        (EventKind.FLUSHED, qid),
        (EventKind.DELETED, other),
        (EventKind.DELETED, third),
    ]
    assert all(e.source and e.source.startswith("admin:") for e in events)
    text = await jsqueue("events", "tail", "--from-start", "--count", "1", env=env)
    assert text.code == 0 and text.out.split()[2:4] == ["held", qid]
    assert "by admin:" in text.out

    # --id: one message's history; --until-end: exit once caught up, without --count
    history = await jsqueue(
        "events", "tail", "--from-start", "--until-end", "--id", other, "--json", env=env
    )
    assert history.code == 0, history.err
    kinds = [Event.model_validate(x).kind for x in history.json_lines()]
    assert kinds[-1] is EventKind.DELETED and EventKind.BOUNCED in kinds
    assert {Event.model_validate(x).queue_id for x in history.json_lines()} == {other}
    everything = await jsqueue("events", "tail", "--from-start", "--until-end", env=env)
    assert everything.code == 0 and len(everything.out.splitlines()) > len(kinds)


async def test_usage_errors_exit_2(nats_server: EmbeddedNats, names: Names) -> None:
    """Bad usage is one line on stderr and exit code 2, before anything is changed."""
    env = queue_env(nats_server, names)
    cases = [
        (["queue", "hold"], "give queue ids"),
        (["queue", "delete", new_queue_id(), "--all"], "not both"),
        (["queue", "show", "not-a-queue-id"], "invalid queue id"),
        (["queue", "ls", "--min-age", "2 hours"], "invalid duration"),
        (["queue", "flush", "--domain", "bad domain!"], "domain"),
        (["dest", "show", "*"], "invalid site '*'"),  # a wildcard names no site
    ]
    for args, message in cases:
        run = await jsqueue(*args, env=env)
        assert run.code == 2, (args, run.code, run.err)
        assert message in run.err, (args, run.err)
        assert "Traceback" not in run.err
    missing = await jsqueue("queue", "show", new_queue_id(), env=env)
    assert missing.code == 1 and "no such entry" in missing.err


async def test_check(nats_server: EmbeddedNats, names: Names) -> None:
    """``jsqueue check``: 1 while the queue is not set up (and it sets nothing up), 0 once it
    is, 1 (one line, no traceback) when NATS does not answer."""
    env = queue_env(nats_server, names)
    bare = await jsqueue("check", env=env)
    assert bare.code == 1 and "queue not set up" in bare.err, bare.err
    settings = make_settings(prefix=names.prefix)
    stores = await open_jetstream(settings, [nats_server.url], names=names)
    await stores.close()
    ok = await jsqueue("check", env=env)
    assert ok.code == 0 and ok.out.startswith("ok:"), ok.err
    down = await jsqueue(
        "check",
        env=cli_env(
            JSQUEUE_NATS__URLS='["nats://127.0.0.1:1"]', JSQUEUE_NATS__CONNECT_TIMEOUT_S="0.5"
        ),
    )
    assert down.code == 1
    assert "Traceback" not in down.err
    assert down.err.strip().splitlines()[-1].startswith("jsqueue: cannot connect to NATS")


def test_commands_run_on_uvloop() -> None:
    """Every command runs its coroutine through ``_run_until_signal``: on uvloop."""
    from jsqueue.cli import commands as cli

    seen: list[type] = []

    async def main(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()))
        assert not stop.is_set()

    cli._run_until_signal(main)
    assert seen == [uvloop.Loop]


async def test_in_process_tests_run_on_uvloop() -> None:
    """tests/conftest.py gives in-process tests the loop the processes use."""
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


async def test_ls_into_a_reader_that_goes_away_ends_quietly(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """``jsqueue queue ls | head -1``: the reader closes the pipe early; jsqueue ends with
    status 0 and no "Broken pipe" on stderr (more output than a pipe buffers)."""
    stores = await open_jetstream(make_settings(), [nats_server.url], names=names)
    try:
        for _ in range(700):
            await stores.entries.create(make_entry())
    finally:
        await stores.close()
    read_fd, write_fd = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jsqueue", "queue", "ls",
        env=queue_env(nats_server, names),
        stdin=asyncio.subprocess.DEVNULL, stdout=write_fd, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        assert reader.readline().startswith(b"-Queue ID-")
    assert proc.stderr is not None
    err = await asyncio.wait_for(proc.stderr.read(), TIMEOUT_S)
    assert await asyncio.wait_for(proc.wait(), TIMEOUT_S) == 0, err
    assert b"Broken pipe" not in err and b"Traceback" not in err


async def test_bulk_action_reads_ids_from_standard_input(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """``jsqueue queue hold -`` takes the ids from standard input (like ``postsuper -h -``),
    one per line, the first word of each line, ``queue ls`` marks (``*``, ``!``) allowed;
    a line that is no queue id is a usage error naming the line."""
    stores = await open_jetstream(make_settings(), [nats_server.url], names=names)
    try:
        ids = [make_entry().id for _ in range(3)]
        for qid in ids:
            await stores.entries.create(make_entry(qid))
        env = queue_env(nats_server, names)
        text = f"{ids[0]}\n\n{ids[1]}*  4096 Mon\n{ids[2]}!\n".encode()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jsqueue", "queue", "hold", "-", "--json",
            env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(text), TIMEOUT_S)
        assert proc.returncode == 0, err
        result = BulkResult.model_validate_json(out)
        assert result.counts == {Outcome.DONE: 3}
        assert sorted(r.queue_id for r in result.results) == sorted(ids)
        for qid in ids:
            assert (await stores.entries.get(qid)).entry.held

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jsqueue", "queue", "release", "-",
            env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(b"-Queue ID- Size\n"), TIMEOUT_S)
        assert proc.returncode == 2
        assert err.decode().strip() == ("jsqueue: standard input line 1: not a queue id: '-Queue'")
    finally:
        await stores.close()


def test_what_remote_parties_wrote_reaches_the_terminal_escaped() -> None:
    """The EHLO name, reply texts and event details come from remote clients and servers
    (an entry stored before names were cleaned at ingest may hold anything): ``queue show``,
    ``queue ls`` and ``events tail`` print their control characters escaped (no ESC, BEL,
    CR or C1 control reaches the terminal; a title, cursor or clipboard sequence is shown,
    not obeyed), and an undecodable octet does not make the print fail."""
    from jsqueue.cli.render import json_safe, render_detail, render_entry_lines, render_event
    from jsqueue.store.base import Versioned

    hostile = "\x1b]0;pwned\x07\x1b[2J\r\x9b\udcff"
    entry = make_entry(new_queue_id()).model_copy(
        update={"helo": f"evil{hostile}.example", "last_error": f"boom{hostile}"}
    )
    detail = EntryDetail.of_versioned(Versioned(entry, 1))
    event = Event(kind=EventKind.HELD, queue_id=entry.id, detail=f"why{hostile}")
    lines = [
        *render_detail(detail),
        *render_entry_lines(EntrySummary.of(entry)),
        render_event(event),
    ]
    text = "\n".join(lines)
    assert not any(c in text for c in "\x1b\x07\r\x9b\udcff")
    assert "helo evil\\x1b]0;pwned\\x07\\x1b[2J\\r\\x9b\\udcff.example" in text
    assert "why\\x1b]0;pwned" in render_event(event)
    text.encode("utf-8")  # printable as it is
    # --json: DEL and C1 controls, which JSON leaves raw, as \u escapes; the same JSON
    raw = event.model_copy(update={"detail": "a\x7fb\x9bc"}).to_json().decode()
    safe = json_safe(raw)
    assert "\x7f" not in safe and "\x9b" not in safe and "\\u009b" in safe
    assert json.loads(safe) == json.loads(raw)


async def test_version() -> None:
    run = await jsqueue("--version", env=cli_env())
    assert run.code == 0 and run.out.strip() == f"jsqueue {importlib.metadata.version('jsqueue')}"


async def test_config_show_is_toml_that_reads_back_unchanged(tmp_path: Path) -> None:
    """``config show`` prints valid TOML; given back with ``--config`` it yields the same
    settings (and the same output), for non-default values of every kind: lists, a table
    of TLS policies, a nested section, a list of tables with unset values in it, unset
    values; a secret is left out, named in a comment, never printed."""
    keys = [
        {"domain": "example.test", "selector": "s1", "key_file": "/keys/s1.key"},
        {"domain": "example.test", "selector": "s2", "key_file": "/keys/s2.key",
         "algorithm": "ed25519-sha256"},
    ]  # fmt: skip
    env = cli_env(
        JSQUEUE_WORKER__DKIM__KEYS=json.dumps(keys),
        JSQUEUE_SMTP__RELAY_NETWORKS="10.0.0.0/8,192.0.2.0/24",
        JSQUEUE_WORKER__TLS_POLICIES='{"secure.example.test": "required"}',
        JSQUEUE_WORKER__SMARTHOST__HOST="relay.example.test",
        JSQUEUE_WORKER__SMARTHOST__PORT="2587",
        JSQUEUE_WORKER__SMARTHOST__USERNAME="bot",
        JSQUEUE_WORKER__SMARTHOST__PASSWORD="s3cret",
        JSQUEUE_NATS__URLS='["nats://a.example.test:4222"]',
        JSQUEUE_RETRY__BASE_S="42.5",
    )
    first = await jsqueue("config", "show", env=env)
    assert first.code == 0, first.err
    assert "s3cret" not in first.out and "*****" not in first.out
    assert "# not shown (secrets): worker.smarthost.password" in first.out
    data = tomllib.loads(first.out)
    assert data["worker"]["smarthost"]["port"] == 2587
    assert data["smtp"]["relay_networks"] == ["10.0.0.0/8", "192.0.2.0/24"]
    assert data["worker"]["dkim"]["keys"] == keys  # [[worker.dkim.keys]], algorithm unset
    path = tmp_path / "shown.toml"
    path.write_text(first.out)
    again = await jsqueue("--config", str(path), "config", "show", env=cli_env())
    assert again.code == 0, again.err
    # the same settings, less the secret that was not printed (so not read back either)
    assert again.out == first.out.split("\n", 1)[1]
    as_json = await jsqueue("--config", str(path), "config", "show", "--json", env=cli_env())
    reread = json.loads(as_json.out)
    assert reread["worker"]["tls_policies"] == {"secure.example.test": "required"}
    assert reread["retry"]["base_s"] == 42.5
