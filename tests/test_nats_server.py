"""The embedded nats-server, connecting, and provisioning of streams, buckets and consumer."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js import api

from jsqueue import nats_server
from jsqueue.config import NatsSettings
from jsqueue.errors import ConfigError, JsqueueError, ProvisioningError, StoreUnavailable
from jsqueue.names import Names
from jsqueue.nats_server import DEFAULT_CONFIG, EmbeddedNats, default_config_file, find_nats_server
from jsqueue.store.jetstream import close_nats, connect_nats, open_jetstream
from support.nats import make_settings, unique_names

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def connect(url: str) -> NATS:
    nc = NATS()
    await nc.connect(url, allow_reconnect=False, connect_timeout=1)
    return nc


async def can_connect(url: str) -> bool:
    nc = await connect(url)
    await nc.close()
    return True


# --------------------------------------------------------------------------- server


async def test_start_stop_restart_on_port_zero(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats", port=0)
    with pytest.raises(JsqueueError):
        _ = server.url  # no port yet
    await server.start()
    try:
        assert server.running and server.port > 0
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert await can_connect(server.url)
        assert "Server is ready" in server.log_file.read_text()
        await server.start()  # already running: no-op
        port = server.port
        await server.restart()
        assert server.port == port and await can_connect(server.url)
        server.kill()
        assert not server.running
        await server.start()
        assert server.port == port and await can_connect(server.url)
    finally:
        await server.stop()
    assert not server.running
    await server.stop()  # idempotent
    server.kill()  # idempotent


_FORKED: dict[str, Path] = {}  # while set: where a forked child of this process writes


def _mark_forked_child() -> None:
    if "marker" in _FORKED:  # in the child: unarmed, nothing
        os.close(os.open(_FORKED["marker"], os.O_CREAT | os.O_WRONLY, 0o600))


os.register_at_fork(after_in_child=_mark_forked_child)


async def test_no_python_runs_in_the_forked_child_before_the_exec(tmp_path: Path) -> None:
    """Starting the server runs no Python code of this (multi-threaded) process between
    fork and exec, where a lock another thread held at the fork deadlocks the child and
    leaves ``Popen`` blocking the event loop unbounded (CPython's subprocess docs on
    ``preexec_fn``). A ``preexec_fn`` makes the child run this process's at-fork hooks: the
    hook here stands for any such code. The server still dies with its parent
    (``test_up.py``: kill -9 of ``jsqueue up``)."""
    marker = tmp_path / "forked"
    _FORKED["marker"] = marker
    try:
        async with EmbeddedNats(tmp_path / "nats", port=0) as server:
            assert await can_connect(server.url)
    finally:
        _FORKED.clear()
    assert not marker.exists(), "Python code ran in the child before the exec"


async def test_context_manager_and_fixed_port(tmp_path: Path) -> None:
    port = free_port()
    async with EmbeddedNats(tmp_path, port=port) as server:
        assert server.url == f"nats://127.0.0.1:{port}"
        assert await can_connect(server.url)
    assert not server.running


async def test_port_taken_is_a_clear_error(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    other = EmbeddedNats(tmp_path / "other", port=nats_server.port)
    with pytest.raises(JsqueueError, match="already in use"):
        await other.start()
    assert not other.running


async def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path, port=0, binary=tmp_path / "no-such-nats-server")
    with pytest.raises(JsqueueError, match="cannot start nats-server"):
        await server.start()


def test_binary_found_without_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert find_nats_server().is_file()


def test_config_copy_matches_repo_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo_conf = REPO / "nats" / "jsqueue.conf"
    assert repo_conf.read_text() == DEFAULT_CONFIG
    assert "sync_interval: always" in DEFAULT_CONFIG
    assert default_config_file(tmp_path) == repo_conf
    # Installed without the repository: the packaged copy is written to the store dir.
    monkeypatch.setattr(nats_server, "__file__", str(tmp_path / "site" / "jsqueue" / "x.py"))
    written = default_config_file(tmp_path)
    assert written == tmp_path / "jsqueue.conf"
    assert written.read_text() == DEFAULT_CONFIG


async def test_data_survives_graceful_restart(tmp_path: Path) -> None:
    async with EmbeddedNats(tmp_path, port=0) as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.a", b"1")
        await nc.close()
        await server.restart()
        nc = await connect(server.url)
        info = await nc.jetstream().stream_info("KEEP")
        assert info.state.messages == 1
        await nc.close()


# --------------------------------------------------------------------------- connecting


async def test_unreachable_nats_fails_fast() -> None:
    settings = make_settings(connect_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        await open_jetstream(settings, [f"nats://127.0.0.1:{free_port()}"])
    assert loop.time() - start < 2.0


async def test_no_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        await open_jetstream(NatsSettings())


# --------------------------------------------------------------------------- provisioning


async def consumer_config(url: str, names: Names) -> api.ConsumerConfig:
    nc = await connect(url)
    try:
        info = await nc.jetstream().consumer_info(names.work_stream, names.work_consumer)
        return info.config
    finally:
        await nc.close()


async def test_provisioning_creates_everything_with_design_settings(
    nats_server: EmbeddedNats, names: Names
) -> None:
    settings = make_settings(ack_wait_s=7, max_ack_pending=50_000)
    stores = await open_jetstream(settings, [nats_server.url], names=names)
    await stores.close()
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    try:
        kv = (await js.stream_info(f"KV_{names.entries_bucket}")).config
        assert kv.allow_direct and kv.max_msgs_per_subject == 1 and kv.num_replicas == 1
        obj = (await js.stream_info(f"OBJ_{names.bodies_bucket}")).config
        assert obj.allow_direct and obj.allow_rollup_hdrs
        work = (await js.stream_info(names.work_stream)).config
        assert work.retention == "workqueue"
        assert work.subjects == [names.work_subjects]
        assert work.duplicate_window == 120
        events = (await js.stream_info(names.events_stream)).config
        assert events.retention == "limits" and events.subjects == [f"{names.prefix}.events.>"]
        assert events.max_bytes == settings.events_max_bytes and events.discard == "old"
        # Best-effort events: one replica writes them without an fsync each (ADR-56).
        assert events.persist_mode == "async"
        assert kv.persist_mode in (None, "default") and obj.persist_mode in (None, "default")
        # Work items are triggers (KV is the truth): no fsync per item or ack on one replica.
        assert work.persist_mode == "async"
        cc = (await js.consumer_info(names.work_stream, names.work_consumer)).config
        assert cc.durable_name == names.work_consumer
        assert cc.ack_policy == "explicit"
        assert cc.ack_wait == 7
        assert cc.max_deliver == -1
        assert cc.max_ack_pending == 50_000
        assert not cc.backoff
    finally:
        await nc.close()


async def test_provisioning_is_idempotent_and_concurrent(
    nats_server: EmbeddedNats, names: Names
) -> None:
    settings = make_settings()
    opened = await asyncio.gather(
        *(open_jetstream(settings, [nats_server.url], names=names) for _ in range(4))
    )
    for stores in opened:
        await stores.close()
    again = await open_jetstream(settings, [nats_server.url], names=names)
    await again.close()


async def test_changed_consumer_settings_are_applied(
    nats_server: EmbeddedNats, names: Names
) -> None:
    first = await open_jetstream(make_settings(ack_wait_s=2), [nats_server.url], names=names)
    await first.close()
    changed = make_settings(ack_wait_s=9, max_ack_pending=123_456)
    second = await open_jetstream(changed, [nats_server.url], names=names)
    await second.close()
    cc = await consumer_config(nats_server.url, names)
    assert cc.ack_wait == 9 and cc.max_ack_pending == 123_456


async def test_tools_create_what_is_missing_but_change_nothing(
    nats_server: EmbeddedNats, names: Names, tmp_path: Path
) -> None:
    """A tool opened with other settings (``update=False``: ``jsqueue queue``, ``dest``,
    ``inject``, a benchmark's loader, here with the defaults) leaves the work consumer and
    the streams as the queue's processes made them: a ``jsqueue queue ls`` run without the
    cluster's configuration must not set ``max_ack_pending`` back to the default (measured:
    the backlog benchmark's loader did, and fresh mail stalled at the default limit). On a
    server without the objects it creates them. The CLI goes this way: ``queue ls`` with
    the defaults against a queue provisioned with other settings changes nothing."""
    queue = make_settings(ack_wait_s=9, max_ack_pending=123_456, events_max_bytes=2**20)
    first = await open_jetstream(queue, [nats_server.url], names=names)
    await first.close()
    tool = await open_jetstream(make_settings(), [nats_server.url], names=names, update=False)
    await tool.close()
    cc = await consumer_config(nats_server.url, names)
    assert cc.ack_wait == 9 and cc.max_ack_pending == 123_456
    nc = await connect(nats_server.url)
    try:
        events = await nc.jetstream().stream_info(names.events_stream)
        assert events.config.max_bytes == 2**20
    finally:
        await nc.close()

    fresh = Names("fresh" + names.prefix)
    created = await open_jetstream(make_settings(), [nats_server.url], names=fresh, update=False)
    await created.close()
    assert (await consumer_config(nats_server.url, fresh)).max_ack_pending > 0

    config = tmp_path / "jsqueue.toml"
    config.write_text(f'[nats]\nurls = ["{nats_server.url}"]\nprefix = "{names.prefix}"\n')
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jsqueue", "--config", str(config), "queue", "ls"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    cc = await consumer_config(nats_server.url, names)
    assert cc.ack_wait == 9 and cc.max_ack_pending == 123_456


async def test_consumer_backoff_and_max_deliver_are_removed(
    nats_server: EmbeddedNats, names: Names
) -> None:
    first = await open_jetstream(make_settings(), [nats_server.url], names=names)
    await first.close()
    nc = await connect(nats_server.url)
    cc = await consumer_config(nats_server.url, names)
    await nc.jetstream().add_consumer(
        names.work_stream,
        cc.evolve(backoff=[1.0, 5.0], max_deliver=5, ack_wait=1.0, description="hand-made"),
    )
    await nc.close()
    stores = await open_jetstream(make_settings(), [nats_server.url], names=names)
    await stores.close()
    cc = await consumer_config(nats_server.url, names)
    assert not cc.backoff and cc.max_deliver == -1


async def test_unapplicable_settings_raise_provisioning_error(
    nats_server: EmbeddedNats, names: Names
) -> None:
    # Three replicas cannot be had from a single node: the error names stream and setting.
    with pytest.raises(ProvisioningError, match=r"stream OBJ_.*replicas > 1"):
        await open_jetstream(make_settings(replicas=3), [nats_server.url], names=names)
    other = unique_names()
    stores = await open_jetstream(make_settings(), [nats_server.url], names=other)
    await stores.close()
    with pytest.raises(ProvisioningError, match="num_replicas is 1, want 3"):
        await open_jetstream(make_settings(replicas=3), [nats_server.url], names=other)


async def test_existing_stream_with_wrong_retention(
    nats_server: EmbeddedNats, names: Names
) -> None:
    nc = await connect(nats_server.url)
    await nc.jetstream().add_stream(name=names.work_stream, subjects=[names.work_subjects])
    await nc.close()
    with pytest.raises(ProvisioningError, match=f"stream {names.work_stream}: retention"):
        await open_jetstream(make_settings(), [nats_server.url], names=names)


async def test_events_fsync_setting_keeps_every_event_synced(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """``nats.events_fsync``: the events stream is created in the default persist mode (an
    fsync per event under ``sync_interval: always``), like the queue's own streams."""
    stores = await open_jetstream(make_settings(events_fsync=True), [nats_server.url], names=names)
    await stores.close()
    nc = await connect(nats_server.url)
    try:
        events = (await nc.jetstream().stream_info(names.events_stream)).config
        assert events.persist_mode in (None, "default")
    finally:
        await nc.close()


async def test_work_fsync_setting_keeps_every_work_item_synced(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """``nats.work_fsync``: the work stream is created in the default persist mode (an fsync
    per work item and ack under ``sync_interval: always``)."""
    stores = await open_jetstream(make_settings(work_fsync=True), [nats_server.url], names=names)
    await stores.close()
    nc = await connect(nats_server.url)
    try:
        work = (await nc.jetstream().stream_info(names.work_stream)).config
        assert work.persist_mode in (None, "default")
    finally:
        await nc.close()


async def test_changed_stream_settings_are_applied(
    nats_server: EmbeddedNats, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """An events stream from an earlier version gets the new limits; its persist mode, which
    the server fixes at creation, is kept with a warning instead of failing the start."""
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name=names.events_stream, subjects=[names.event_subject(">")], max_age=3600)
    try:
        settings = make_settings(events_max_bytes=5 << 20)
        stores = await open_jetstream(settings, [nats_server.url], names=names)
        await stores.close()
        events = (await js.stream_info(names.events_stream)).config
        assert events.max_age == 7 * 86400
        assert events.duplicate_window == 120
        assert events.max_bytes == 5 << 20
        assert events.persist_mode in (None, "default")
        assert f"stream {names.events_stream} keeps persist_mode 'default'" in caplog.text
        stores = await open_jetstream(settings, [nats_server.url], names=names)  # idempotent
        await stores.close()
    finally:
        await nc.close()


async def test_file_backed_ingest_log_is_recreated_in_memory(
    nats_server: EmbeddedNats, names: Names
) -> None:
    """The ingest log (resend hints, jsqueue.store.jetstream.JetStreamIngestLog) is kept in
    memory; one left on disk by an earlier version cannot be updated (the server refuses a
    storage change) and is recreated instead of failing the start. Queue streams never are:
    see test_existing_stream_with_wrong_retention."""
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    stream = f"KV_{names.ingest_bucket}"
    await js.add_stream(name=stream, subjects=[f"$KV.{names.ingest_bucket}.>"])
    await js.publish(f"$KV.{names.ingest_bucket}.old", b"{}")
    try:
        stores = await open_jetstream(make_settings(), [nats_server.url], names=names)
        await stores.close()
        info = await js.stream_info(stream)
        assert info.config.storage == "memory"
        assert info.config.max_bytes == 64 * 1024 * 1024
        assert info.state.messages == 0
        stores = await open_jetstream(make_settings(), [nats_server.url], names=names)
        await stores.close()  # and once recreated, the next start leaves it alone
    finally:
        await nc.close()


async def test_close_ends_reconnecting_connections(nats_server: EmbeddedNats, names: Names) -> None:
    """Closing stores whose server is gone leaves no reconnect task running (close_nats):
    one left behind keeps the event loop from closing, so a process stopping with NATS
    down would hang on SIGTERM. nats-py can lose the cancellation of that task when it
    lands on a refused connect, which the timers here (a 1 s request, as the health probe
    makes, then the 2 s final flush) make likely."""
    opened = [
        await open_jetstream(make_settings(), [nats_server.url], names=names) for _ in range(8)
    ]
    conns = [stores.bodies._nc for stores in opened]  # type: ignore[attr-defined]
    nats_server.kill()
    try:
        for result in await asyncio.gather(
            *(nc.request("jsq.probe", b"", timeout=1) for nc in conns), return_exceptions=True
        ):
            assert isinstance(result, Exception), "answered with the server gone"
        await asyncio.gather(*(stores.close() for stores in opened))
        for nc in conns:
            assert nc.is_closed
            task = nc._reconnection_task
            assert task is None or task.done(), "a reconnect task outlived close"
    finally:
        await nats_server.start()


async def test_close_repeats_a_lost_cancellation_of_the_reconnect_task(
    nats_server: EmbeddedNats,
) -> None:
    """The mechanism behind close_nats' guarantee, made deterministic: a reconnect task
    that loses the first cancellation (as nats-py's does when the cancel lands on a refused
    connect) is cancelled again until it has ended."""
    nc = await connect_nats(make_settings(), [nats_server.url])
    lost = 0

    async def loses_one_cancellation() -> None:
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                lost += 1
                if lost > 1:
                    raise

    task = asyncio.create_task(loses_one_cancellation())
    await asyncio.sleep(0)  # running, inside its sleep
    nc._reconnection_task = task
    await close_nats(nc)
    assert nc.is_closed and task.done() and lost == 2


async def test_port_taken_names_the_process_holding_it(tmp_path: Path) -> None:
    """A port held by something else: the error says what holds it (pid and command)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        server = EmbeddedNats(tmp_path, port=port)
        with pytest.raises(JsqueueError, match=rf"already in use by pid {os.getpid()} \("):
            await server.start()
        assert not server.running


async def test_an_orphaned_server_on_the_same_store_is_stopped_at_start(tmp_path: Path) -> None:
    """A nats-server left on this store dir and port by a killed jsqueue (its parent is not
    a jsqueue) is stopped by the next start, which then serves on that port."""
    port = free_port()
    store = tmp_path / "nats"
    store.mkdir()
    cmd = [str(find_nats_server()), "-c", str(default_config_file(store)), "-a", "127.0.0.1"]
    cmd += ["-p", str(port), "-js", "-sd", str(store)]
    orphan = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        for _ in range(200):
            if await can_connect(f"nats://127.0.0.1:{port}"):
                break
            await asyncio.sleep(0.05)
        async with EmbeddedNats(store, port=port) as server:
            assert await asyncio.wait_for(orphan.wait(), 15) is not None, "orphan stopped"
            assert server.pid != orphan.pid and await can_connect(server.url)
    finally:
        if orphan.returncode is None:
            orphan.kill()
            await orphan.wait()


async def test_a_server_on_another_store_is_left_alone(tmp_path: Path) -> None:
    """Only an orphan of the same store dir is stopped; another store's server is named."""
    port = free_port()
    async with EmbeddedNats(tmp_path / "a", port=port) as first:
        other = EmbeddedNats(tmp_path / "b", port=port)
        with pytest.raises(JsqueueError, match=rf"already in use by pid {first.pid} \("):
            await other.start()
        assert first.running
