"""Provisioning: the wanted config of every stream (object store, KV buckets, work, events)
and of the shared durable pull consumer, in the JetStream wire format, and :func:`provision`,
which creates or updates them idempotently from any number of processes at once
(docs/architecture.md, "Storage on JetStream", for the layout).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from jsqueue.config import NatsSettings
from jsqueue.errors import ProvisioningError, StoreUnavailable
from jsqueue.names import Names, kv_subjects, object_chunk_subjects, object_meta_subjects
from jsqueue.store.jetstream.api import (
    CONSUMER_EXISTS,
    NO_PLACEMENT,
    NS,
    RETRY_PAUSE_MAX_S,
    ApiError,
    ErrCode,
    api_request,
)

log = logging.getLogger("jsqueue.store.jetstream")

#: Dedupe window of every stream, seconds: a work item published twice within it is stored once.
DUPLICATE_WINDOW_S = 120.0
#: How long the events stream keeps records, seconds.
EVENTS_MAX_AGE_S = 7 * 86400.0
#: How long the ingest log remembers a message, seconds (caps ``smtp.dedupe_window_s``).
INGEST_MAX_AGE_S = 3600.0
#: Memory the ingest log may use on each NATS server, octets; the oldest records go first
#: (~150 octets each: about 450 000 records, 7.5 minutes at 1 000 messages a second).
INGEST_MAX_BYTES = 64 * 1024 * 1024
#: How long creating a stream or consumer waits out a cluster that cannot place it yet
#: (peers not yet known online after a start or restart; a stream leader election), seconds.
PLACEMENT_WAIT_S = 20.0
#: Stream settings the server fixes when it creates a stream and refuses to update: an
#: existing stream keeps its own (with a warning) instead of failing the start.
_FIXED_AT_CREATION = frozenset({"persist_mode"})


def _stream_configs(settings: NatsSettings, names: Names) -> list[dict[str, Any]]:
    """Wanted stream configs in the JetStream wire format (durations in nanoseconds)."""
    common = {
        "retention": "limits",
        "storage": "file",
        "num_replicas": settings.replicas,
        "duplicate_window": int(DUPLICATE_WINDOW_S * NS),
    }
    obj = names.bodies_bucket
    return [
        {
            **common,
            "name": names.bodies_stream,
            "subjects": [object_chunk_subjects(obj), object_meta_subjects(obj)],
            "discard": "new",
            "max_age": 0,
            "allow_rollup_hdrs": True,
            "allow_direct": True,
        },
        {
            **common,
            "name": names.entries_stream,
            "subjects": [kv_subjects(names.entries_bucket)],
            "discard": "new",
            "max_age": 0,
            "max_msgs_per_subject": 1,
            "allow_rollup_hdrs": True,
            "deny_delete": True,
            "allow_direct": True,
            "allow_msg_ttl": True,
        },
        {
            # A resend hint, not queue state: kept in memory (no fsync per message; a full
            # NATS restart forgets it, and a resend then is queued anew), bounded in size.
            **common,
            "name": names.ingest_stream,
            "subjects": [kv_subjects(names.ingest_bucket)],
            "storage": "memory",
            "discard": "old",
            "max_bytes": INGEST_MAX_BYTES,
            "max_age": int(INGEST_MAX_AGE_S * NS),
            "max_msgs_per_subject": 1,
            "allow_rollup_hdrs": True,
            "deny_delete": True,
            "allow_direct": True,
        },
        {
            # Triggers, not queue state (DESIGN.md §2.2): on one replica written without an
            # fsync per item or ack unless nats.work_fsync; what a crash costs (the last
            # items published) the reconciler's recovery pass puts back from KV.
            **common,
            "name": names.work_stream,
            "subjects": [names.work_subjects],
            "retention": "workqueue",
            "discard": "old",
            "max_age": 0,
            **(
                {"persist_mode": "async"}
                if settings.replicas == 1 and not settings.work_fsync
                else {}
            ),
        },
        {
            # Best-effort observations, not queue state (jsqueue.events): one replica buffers
            # them and writes them without an fsync each, unless nats.events_fsync; a kill
            # of the nats-server or a power loss can cost the last ones (measured: 27 of 300
            # published just before a SIGKILL). Three replicas cannot: the server refuses.
            **common,
            "name": names.events_stream,
            "subjects": [names.event_subject(">")],
            "discard": "old",
            "max_age": int(EVENTS_MAX_AGE_S * NS),
            "max_bytes": settings.events_max_bytes,
            **(
                {"persist_mode": "async"}
                if settings.replicas == 1 and not settings.events_fsync
                else {}
            ),
        },
    ]


def memory_storage_needed(settings: NatsSettings, names: Names) -> int:
    """JetStream memory storage each NATS server must allow for what :func:`provision`
    creates in memory, octets: the sum of the memory streams' ``max_bytes`` (every replica
    of a stream holds all of it). A server configured with less (``max_memory_store``;
    the NATS Helm chart's ``config.jetstream.memoryStore.maxSize``, 0 when the memory
    store is off) refuses to create them with "insufficient storage", and the front ends
    never become ready.

    Raises:
        ValueError: a memory stream without a byte limit (it could take any amount).
    """
    total = 0
    for config in _stream_configs(settings, names):
        if config["storage"] != "memory":
            continue
        if config.get("max_bytes", -1) <= 0:
            raise ValueError(f"memory stream {config['name']} has no max_bytes")
        total += int(config["max_bytes"])
    return total


def _consumer_config(settings: NatsSettings, names: Names) -> dict[str, Any]:
    """The shared durable pull consumer (DESIGN.md §2.6): no backoff, unlimited deliveries."""
    return {
        "name": names.work_consumer,
        "durable_name": names.work_consumer,
        "ack_policy": "explicit",
        "ack_wait": int(settings.ack_wait_s * NS),
        "max_deliver": -1,
        "max_ack_pending": settings.max_ack_pending,
        "deliver_policy": "all",
        "replay_policy": "instant",
    }


def _differences(existing: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    diff: dict[str, tuple[Any, Any]] = {}
    for key, want in wanted.items():
        have = existing.get(key)
        if isinstance(want, list):
            same = sorted(have or []) == sorted(want)
        elif isinstance(want, bool):
            same = bool(have) == want
        else:
            same = have == want
        if not same:
            diff[key] = (have, want)
    return diff


def _diff_text(kind: str, name: str, diff: dict[str, tuple[Any, Any]]) -> str:
    parts = ", ".join(f"{k} is {have!r}, want {want!r}" for k, (have, want) in diff.items())
    return f"{kind} {name}: {parts}"


async def _api_waiting(
    nc: NATS, subject: str, body: dict[str, Any] | None, timeout_s: float
) -> Any:
    """A provisioning request (STREAM/CONSUMER INFO, CREATE or UPDATE; an UPDATE to the
    same config is idempotent), repeated for up to :data:`PLACEMENT_WAIT_S` seconds while
    the cluster is not ready for it: a timeout or a 503 (leaders still being elected after
    a start or restart), or no placement for an R3 object yet (peers not yet seen online).
    A CREATE repeated after a timeout that was stored after all is refused as "already in
    use", which the callers handle.

    Raises:
        ApiError: any other refusal (404 included), or the last one when the wait ran out.
        StoreUnavailable: no answer within the wait, or JetStream not enabled.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PLACEMENT_WAIT_S
    while True:
        try:
            return await api_request(nc, subject, body, timeout_s)
        except ApiError as e:
            transient = e.err_code in NO_PLACEMENT or e.code == 503
            if not transient or loop.time() >= deadline:
                raise
            reason: object = e
        except StoreUnavailable as e:
            timed_out = isinstance(e.__cause__, nats.errors.TimeoutError | asyncio.TimeoutError)
            if not timed_out or loop.time() >= deadline:
                raise
            reason = e
        log.info("%s: %s; waiting for the cluster", subject, reason)
        await asyncio.sleep(RETRY_PAUSE_MAX_S)


async def _ensure_stream(
    nc: NATS,
    wanted: dict[str, Any],
    timeout_s: float,
    *,
    disposable: bool = False,
    update: bool = True,
) -> None:
    """Create the stream, or update it to ``wanted``; a ``disposable`` stream (contents
    that may be lost) whose update the server refuses is deleted and created anew. Without
    ``update`` an existing stream is left as it is (:func:`provision`).

    Raises:
        ProvisioningError: the server refused to report, create, update or (disposable)
            delete the stream, an update left settings unapplied, or the stream kept
            changing for three rounds.
        StoreUnavailable: no answer within the wait, or JetStream not enabled.
    """
    name = wanted["name"]
    for _ in range(3):
        try:
            info = await _api_waiting(nc, f"STREAM.INFO.{name}", None, timeout_s)
        except ApiError as e:
            if e.code != 404:
                raise ProvisioningError(f"stream {name}: {e}") from e
            try:
                await _api_waiting(nc, f"STREAM.CREATE.{name}", wanted, timeout_s)
                log.info("created stream %s", name)
                return
            except ApiError as ce:
                if ce.err_code == ErrCode.STREAM_NAME_IN_USE:
                    continue  # created concurrently by another process: compare it
                hint = ""
                if wanted["storage"] == "memory":
                    hint = (
                        f"; it is a memory stream of {wanted['max_bytes']} octets: each NATS "
                        "server must allow that much JetStream memory storage "
                        "(max_memory_store; the Helm chart's memoryStore.maxSize)"
                    )
                raise ProvisioningError(f"stream {name}: cannot create: {ce}{hint}") from ce
        diff = _differences(info["config"], wanted)
        if diff and not update:
            _left_alone("stream", name, diff)
            return
        for field in _FIXED_AT_CREATION & diff.keys():
            log.warning(
                "stream %s keeps %s %r (set when it was created; only a new stream can have %r)",
                name,
                field,
                info["config"].get(field, "default"),
                wanted.get(field, "default"),
            )
            del diff[field]
            wanted = {k: v for k, v in wanted.items() if k != field}
        if not diff:
            return
        try:
            resp = await _api_waiting(
                nc, f"STREAM.UPDATE.{name}", {**info["config"], **wanted}, timeout_s
            )
        except ApiError as e:
            if disposable:
                log.warning("%s; recreating it", _diff_text("stream", name, diff))
                try:
                    await api_request(nc, f"STREAM.DELETE.{name}", None, timeout_s)
                except ApiError as de:
                    if de.code != 404:
                        raise ProvisioningError(f"stream {name}: cannot delete: {de}") from de
                continue
            hint = ""
            if info["config"].get("persist_mode") == "async" and "num_replicas" in diff:
                # persist_mode is fixed at creation and a replicated stream cannot be async
                hint = (
                    "; an async stream (no fsync per write) cannot be replicated: delete it "
                    "to have it created again with the new replica count (work items are "
                    "put back by the reconciler, events are lost)"
                )
            raise ProvisioningError(
                f"{_diff_text('stream', name, diff)}; the server refused the update: {e}{hint}"
            ) from e
        left = _differences(resp["config"], wanted)
        if left:
            raise ProvisioningError(_diff_text("stream", name, left) + " (update not applied)")
        log.warning("updated %s", _diff_text("stream", name, diff))
        return
    raise ProvisioningError(f"stream {name}: keeps changing while being provisioned")


async def _ensure_consumer(
    nc: NATS, stream: str, wanted: dict[str, Any], timeout_s: float, *, update: bool = True
) -> None:
    name = wanted["name"]
    for _ in range(3):
        try:
            info = await _api_waiting(nc, f"CONSUMER.INFO.{stream}.{name}", None, timeout_s)
        except ApiError as e:
            if e.code != 404:
                raise ProvisioningError(f"consumer {stream}/{name}: {e}") from e
            req = {"stream_name": stream, "config": wanted, "action": "create"}
            try:
                await _api_waiting(nc, f"CONSUMER.CREATE.{stream}.{name}", req, timeout_s)
                log.info("created consumer %s/%s", stream, name)
                return
            except ApiError as ce:
                if ce.err_code in CONSUMER_EXISTS:
                    continue
                raise ProvisioningError(f"consumer {stream}/{name}: cannot create: {ce}") from ce
        config = info["config"]
        diff = _differences(config, wanted)
        if config.get("backoff"):
            diff["backoff"] = (config["backoff"], None)
        if not diff:
            return
        if not update:
            _left_alone("consumer", f"{stream}/{name}", diff)
            return
        new = {**config, **wanted}
        new.pop("backoff", None)
        req = {"stream_name": stream, "config": new, "action": "update"}
        try:
            resp = await api_request(nc, f"CONSUMER.CREATE.{stream}.{name}", req, timeout_s)
        except ApiError as e:
            raise ProvisioningError(
                f"{_diff_text('consumer', f'{stream}/{name}', diff)}; "
                f"the server refused the update: {e}"
            ) from e
        left = _differences(resp["config"], wanted)
        if resp["config"].get("backoff"):
            left["backoff"] = (resp["config"]["backoff"], None)
        if left:
            raise ProvisioningError(
                _diff_text("consumer", f"{stream}/{name}", left) + " (update not applied)"
            )
        log.warning("updated %s", _diff_text("consumer", f"{stream}/{name}", diff))
        return
    raise ProvisioningError(f"consumer {stream}/{name}: keeps changing while being provisioned")


def _left_alone(kind: str, name: str, diff: dict[str, tuple[Any, Any]]) -> None:
    """Say (at debug level) that an object differing from this configuration is kept."""
    log.debug(
        "%s; left as it is (the front ends and workers bring it in line)",
        _diff_text(kind, name, diff),
    )


async def provision(nc: NATS, settings: NatsSettings, names: Names, *, update: bool = True) -> None:
    """Create or update every stream, bucket and consumer jsqueue needs.

    Idempotent and safe to run from many processes at once. An existing object whose
    settings differ is updated; if the server refuses (e.g. a retention or storage change,
    or 3 replicas on a single node) nothing is silently kept: ProvisioningError names the
    object and the setting. Settings fixed at creation (``persist_mode``) are kept with a
    warning; the ingest log's stream, whose contents may be lost, is recreated instead.
    Requests wait out a cluster that cannot place an object yet for up to
    :data:`PLACEMENT_WAIT_S` seconds.

    Args:
        nc: a connected client.
        settings: replicas, consumer limits, events retention and request timeout.
        names: object names.
        update: bring existing objects in line with ``settings``. Only the processes that
            run the queue (front ends, workers) do: a tool (``jsqueue queue``, ``dest``,
            ``inject``, a benchmark's loader) run with another configuration, the defaults
            say, must not set the cluster's work consumer back to its own ``ack_wait_s`` or
            ``max_ack_pending``. Without it, missing objects are still created.

    Raises:
        ProvisioningError: an object exists with settings that cannot be brought in line.
        StoreUnavailable: NATS or JetStream is not reachable.
    """
    timeout_s = settings.request_timeout_s
    for wanted in _stream_configs(settings, names):
        disposable = wanted["name"] == names.ingest_stream
        await _ensure_stream(nc, wanted, timeout_s, disposable=disposable, update=update)
    consumer = _consumer_config(settings, names)
    await _ensure_consumer(nc, names.work_stream, consumer, timeout_s, update=update)


async def ensure_ttl_bucket(
    nc: NATS,
    bucket: str,
    stream: str,
    *,
    replicas: int,
    timeout_s: float,
    max_age_s: float | None = None,
) -> None:
    """Create the KV bucket ``bucket`` (stream ``stream``) whose keys live by a TTL per
    write (``Nats-TTL``, ``allow_msg_ttl``): locks, presence, MTA-STS policies and
    destinations. An existing one is brought in line (replica count, TTLs allowed,
    ``max_age``). Idempotent and safe from many processes at once.

    Args:
        nc: a connected client.
        bucket: the KV bucket name.
        stream: its stream (``KV_<bucket>``).
        replicas: replica count.
        timeout_s: per-request timeout, seconds.
        max_age_s: longest life of any key, seconds; unbounded when None.

    Raises:
        ProvisioningError: the server refused to create or update it.
        StoreUnavailable: NATS is not reachable, or the stream had no leader for
            :data:`PLACEMENT_WAIT_S` seconds.
    """
    wanted: dict[str, Any] = {
        "name": stream,
        "subjects": [kv_subjects(bucket)],
        "retention": "limits",
        "storage": "file",
        "num_replicas": replicas,
        "discard": "new",
        "max_msgs_per_subject": 1,
        "allow_rollup_hdrs": True,
        "deny_delete": True,
        "allow_direct": True,
        "allow_msg_ttl": True,
    }
    if max_age_s is not None:
        wanted["max_age"] = int(max_age_s * 1_000_000_000)
    # Every request waits out a cluster electing the stream's leader (a node lost while a
    # worker starts) as provision() does: a worker that stopped on it was a crash loop.
    try:
        info = await _api_waiting(nc, f"STREAM.INFO.{stream}", None, timeout_s)
    except ApiError as e:
        if e.code != 404:
            raise ProvisioningError(f"stream {stream}: {e}") from e
        try:
            await _api_waiting(nc, f"STREAM.CREATE.{stream}", wanted, timeout_s)
            return
        except ApiError as ce:
            if ce.err_code == ErrCode.STREAM_NAME_IN_USE:  # created concurrently
                return
            raise ProvisioningError(f"stream {stream}: cannot create: {ce}") from ce
    config = info["config"]
    if any(config.get(k) != wanted[k] for k in ("num_replicas", "allow_msg_ttl")) or (
        "max_age" in wanted and config.get("max_age") != wanted["max_age"]
    ):
        try:
            await _api_waiting(nc, f"STREAM.UPDATE.{stream}", {**config, **wanted}, timeout_s)
        except ApiError as e:
            raise ProvisioningError(f"stream {stream}: cannot update: {e}") from e


class TtlBucket:
    """A KV bucket whose keys live by a TTL per write (:func:`ensure_ttl_bucket`),
    provisioned on first use: the common part of the presence, MTA-STS policy and
    destinations adapters.

    Attributes:
        max_age_s: longest life of any key, seconds (the bucket's ``max_age``); unbounded
            when None. Set by each subclass.

    Args:
        nc: a connected client.
        bucket: the KV bucket name.
        stream: its stream (``KV_<bucket>``).
        replicas: replica count of the bucket.
        timeout_s: per-request timeout, seconds.
    """

    max_age_s: float | None = None

    def __init__(
        self, nc: NATS, bucket: str, stream: str, *, replicas: int = 1, timeout_s: float = 5.0
    ) -> None:
        self._nc = nc
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = bucket
        self.stream = stream
        self.replicas = replicas
        self._timeout_s = timeout_s
        self._provisioned = False

    async def provision(self) -> None:
        """Create the bucket if missing (replica count, TTLs and ``max_age`` brought in
        line). Idempotent.

        Raises:
            ProvisioningError: the server refused to create or update it.
            StoreUnavailable: NATS is not reachable.
        """
        await ensure_ttl_bucket(
            self._nc,
            self.bucket,
            self.stream,
            replicas=self.replicas,
            timeout_s=self._timeout_s,
            max_age_s=self.max_age_s,
        )
        self._provisioned = True
