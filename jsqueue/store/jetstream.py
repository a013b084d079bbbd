"""JetStream implementations of the body store, entry store and scheduler.

:func:`open_jetstream` connects to NATS (reconnecting forever across node loss), provisions
every bucket, stream and consumer idempotently (:func:`provision`), and returns the three
stores. Layout (DESIGN.md §3; names from :class:`~jsqueue.names.Names`):

================  ==============================  =========================================
object            JetStream                       notes
================  ==============================  =========================================
bodies            object store ``<p>-bodies``     nats object-store wire format, 512 KiB
                  (stream ``OBJ_<p>-bodies``)     chunks, read by direct get (no consumer)
entries           KV ``<p>-queue``                direct gets on, history 1, per-message
                  (stream ``KV_<p>-queue``)       TTL on (deleted keys expire)
work items        stream ``<P>_WORK``             work-queue retention, 2 min dedupe window
                  durable pull consumer           explicit ack, no backoff, unlimited
                  ``<p>-workers``                 max_deliver, ack_wait / max_ack_pending
                                                  from settings (DESIGN.md §2.6)
events            stream ``<P>_EVENTS``           limits retention, 7 days, at most
                                                  ``nats.events_max_bytes``; on one replica
                                                  written without an fsync per event
                                                  (``persist_mode: async``, nats-server
                                                  ≥ 2.12) unless ``nats.events_fsync``
================  ==============================  =========================================

Every nats error is translated at this boundary (``raise … from e``): timeouts, lost
connections and refused requests become :class:`~jsqueue.errors.StoreUnavailable`.

A StoreUnavailable from a *write* means the outcome is unknown, not "nothing happened": the
request may have been stored before the reply was lost, and nats-py sends what it buffered
during a disconnect once it reconnects. Every write is therefore safe to land late: work
items are deduplicated by ``Nats-Msg-Id`` and re-checked against KV on arrival; KV writes
keep their compare-and-set header, so a late one either applies atomically or is refused.
Re-read before deciding what a failed write did.

Publishes that time out or find no stream leader are retried with the same ``Nats-Msg-Id``
(at least ``PUBLISH_ATTEMPTS`` tries, and for up to ``PUBLISH_ATTEMPTS`` request timeouts in
all: a leader election answers "no responders" at once for ~4–9 s, measured): a work item
that was stored after all is not stored twice, and a KV compare-and-set whose retry is
refused checks, on the stream leader, whether the stored revision carries its own id (the
server checks the expected revision before dedupe, measured), so it is reported as the
success it was.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Awaitable,
    Callable,
    Iterator,
)
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.nuid import NUID
from pydantic import ValidationError

from jsqueue.config import NatsSettings
from jsqueue.envelope import Entry, EntryState, WorkItem
from jsqueue.errors import (
    BodyCorrupt,
    BodyNotFound,
    ConfigError,
    EntryDeleted,
    EntryExists,
    EntryNotFound,
    ProvisioningError,
    RevisionConflict,
    StoreError,
    StoreUnavailable,
)
from jsqueue.names import Names, check_domain, check_queue_id
from jsqueue.store.base import (
    BodyInfo,
    Due,
    Stores,
    Versioned,
    check_ingest_key,
    encode_entry,
)

log = logging.getLogger(__name__)

#: Object-store chunk size, octets (DESIGN.md §7: 256 KiB–1 MiB beat the 128 KiB default).
CHUNK_SIZE = 512 * 1024
#: Chunk publishes in flight per body put.
PUT_WINDOW = 4
#: Dedupe window of every stream, seconds: a work item published twice within it is stored once.
DUPLICATE_WINDOW_S = 120.0
#: How long the events stream keeps records, seconds.
EVENTS_MAX_AGE_S = 7 * 86400.0
#: How long the ingest log remembers a message, seconds (caps ``smtp.dedupe_window_s``).
INGEST_MAX_AGE_S = 3600.0
#: Memory the ingest log may use on each NATS server, octets; the oldest records go first
#: (~150 octets each: about 450 000 records, 7.5 minutes at 1 000 messages a second).
INGEST_MAX_BYTES = 64 * 1024 * 1024
#: Lifetime of a KV delete marker, seconds: afterwards the key is simply absent.
DELETE_MARKER_TTL_S = 900
#: Header of a work item: when it is due, Unix milliseconds.
NOT_BEFORE_HEADER = "Jsq-Not-Before"
#: Tries of a publish that timed out (same Nats-Msg-Id each time); the retries go on for
#: this many request timeouts in all (:func:`_publish`).
PUBLISH_ATTEMPTS = 3
#: Pause before the first retry of a publish, seconds; doubled per retry up to the max.
RETRY_PAUSE_S = 0.25
#: Longest pause between retries of a publish, seconds.
RETRY_PAUSE_MAX_S = 1.0
#: How long creating a stream or consumer waits out a cluster that cannot place it yet
#: (peers not yet known online after a start or restart; a stream leader election), seconds.
PLACEMENT_WAIT_S = 20.0
#: nats-py reconnect pause per server, seconds.
RECONNECT_WAIT_S = 0.5
#: Concurrent direct gets when scanning the KV bucket.
SCAN_BATCH = 64
#: Octets of a KV write's headers (message id, expected revision) left out of the value
#: size an entry may have.
KV_HEADER_ROOM = 1024
#: Bodies whose chunk-set nuid a body store remembers after opening them (for delete).
OPENED_MEMORY = 4096

_JS_API = "$JS.API"
_HDR_MSG_ID = "Nats-Msg-Id"
_HDR_EXPECTED_LAST_SUBJ_SEQ = "Nats-Expected-Last-Subject-Sequence"
_HDR_ROLLUP = "Nats-Rollup"
_HDR_TTL = "Nats-TTL"
_KV_OP = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"
_ERR_WRONG_LAST_SEQ = (10071, 10164)
_ERR_STREAM_NAME_IN_USE = 10058
_ERR_CONSUMER_EXISTS = (10013, 10148)
#: "insufficient resources" / "no suitable peers for placement": transient in a cluster
#: whose peers are still coming online.
_ERR_NO_PLACEMENT = (10005, 10023)
_NS = 1_000_000_000
#: Stream settings the server fixes when it creates a stream and refuses to update: an
#: existing stream keeps its own (with a warning) instead of failing the start.
_FIXED_AT_CREATION = frozenset({"persist_mode"})

_Retryable = (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, asyncio.TimeoutError)
_NatsFailure = (nats.errors.Error, asyncio.TimeoutError, OSError)


# --------------------------------------------------------------------------- errors


def _describe(e: BaseException) -> str:
    if isinstance(e, nats.js.errors.APIError):
        return f"{e.description} (status {e.code}, error {e.err_code})"
    return str(e) or type(e).__name__


def _unavailable(what: str, e: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"{what}: {_describe(e)}")


@contextlib.contextmanager
def _translate(what: str) -> Iterator[None]:
    """Turn nats, timeout and socket errors into StoreUnavailable naming ``what``."""
    try:
        yield
    except _NatsFailure as e:
        raise _unavailable(what, e) from e


def _is_wrong_last_seq(e: BaseException) -> bool:
    return isinstance(e, nats.js.errors.APIError) and e.err_code in _ERR_WRONG_LAST_SEQ


def _is_temporary(e: BaseException) -> bool:
    """A failure worth retrying with the same message id: timeout, no responder, 503."""
    if isinstance(e, _Retryable):
        return True
    return isinstance(e, nats.js.errors.APIError) and e.code == 503


async def _publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    headers: dict[str, str],
    *,
    what: str,
    attempts: int = PUBLISH_ATTEMPTS,
    budget_s: float = PUBLISH_ATTEMPTS * 5.0,
) -> api.PubAck:
    """Publish to a stream, retrying temporary failures with the same headers (so the same
    msg id): timeouts, no responders (no stream leader: an election, ~4–9 s, DESIGN.md §6)
    and 503s. Retries stop once ``attempts`` tries failed *and* ``budget_s`` seconds have
    passed, whichever comes later; pauses grow from :data:`RETRY_PAUSE_S` to
    :data:`RETRY_PAUSE_MAX_S`.

    Raises:
        nats.js.errors.APIError: the stream refused the message (not a temporary failure).
        StoreUnavailable: every attempt timed out or found no stream leader.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    pause = RETRY_PAUSE_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await js.publish(subject, payload, headers=dict(headers))
        except nats.js.errors.APIError as e:
            if not _is_temporary(e):
                raise
            last: BaseException = e
        except _Retryable as e:
            last = e
        except nats.errors.Error as e:
            raise _unavailable(what, e) from e
        if attempt >= attempts and loop.time() + pause >= deadline:
            break
        level = logging.WARNING if attempt == 1 else logging.DEBUG
        log.log(level, "%s: attempt %d failed (%s); retrying", what, attempt, _describe(last))
        await asyncio.sleep(pause)
        pause = min(2 * pause, RETRY_PAUSE_MAX_S)
    log.warning("%s: giving up after %d attempts: %s", what, attempt, _describe(last))
    raise _unavailable(what, last) from last


# --------------------------------------------------------------------------- provisioning


class _ApiError(Exception):
    def __init__(self, resp: dict[str, Any]) -> None:
        err = resp.get("error") or {}
        self.code = int(err.get("code", 0))
        self.err_code = int(err.get("err_code", 0))
        self.description = str(err.get("description", "unknown error"))
        super().__init__(f"{self.description} (status {self.code}, error {self.err_code})")


async def _api(nc: NATS, subject: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One JetStream API request; raw JSON in and out so unknown server fields survive."""
    data = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(f"{_JS_API}.{subject}", data, timeout=timeout_s)
    except nats.errors.NoRespondersError as e:
        raise StoreUnavailable("JetStream is not enabled or not available on this server") from e
    except _NatsFailure as e:
        raise _unavailable(f"JetStream API {subject}", e) from e
    resp = json.loads(msg.data)
    if "error" in resp:
        raise _ApiError(resp)
    return resp


def _stream_configs(settings: NatsSettings, names: Names) -> list[dict[str, Any]]:
    """Wanted stream configs in the JetStream wire format (durations in nanoseconds)."""
    common = {
        "retention": "limits",
        "storage": "file",
        "num_replicas": settings.replicas,
        "duplicate_window": int(DUPLICATE_WINDOW_S * _NS),
    }
    obj, kv = names.bodies_bucket, names.entries_bucket
    return [
        {
            **common,
            "name": f"OBJ_{obj}",
            "subjects": [f"$O.{obj}.C.>", f"$O.{obj}.M.>"],
            "discard": "new",
            "max_age": 0,
            "allow_rollup_hdrs": True,
            "allow_direct": True,
        },
        {
            **common,
            "name": f"KV_{kv}",
            "subjects": [f"$KV.{kv}.>"],
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
            "name": f"KV_{names.ingest_bucket}",
            "subjects": [f"$KV.{names.ingest_bucket}.>"],
            "storage": "memory",
            "discard": "old",
            "max_bytes": INGEST_MAX_BYTES,
            "max_age": int(INGEST_MAX_AGE_S * _NS),
            "max_msgs_per_subject": 1,
            "allow_rollup_hdrs": True,
            "deny_delete": True,
            "allow_direct": True,
        },
        {
            **common,
            "name": names.work_stream,
            "subjects": [names.work_subjects],
            "retention": "workqueue",
            "discard": "old",
            "max_age": 0,
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
            "max_age": int(EVENTS_MAX_AGE_S * _NS),
            "max_bytes": settings.events_max_bytes,
            **(
                {"persist_mode": "async"}
                if settings.replicas == 1 and not settings.events_fsync
                else {}
            ),
        },
    ]


def _consumer_config(settings: NatsSettings, names: Names) -> dict[str, Any]:
    """The shared durable pull consumer (DESIGN.md §2.6): no backoff, unlimited deliveries."""
    return {
        "name": names.work_consumer,
        "durable_name": names.work_consumer,
        "ack_policy": "explicit",
        "ack_wait": int(settings.ack_wait_s * _NS),
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
        _ApiError: any other refusal (404 included), or the last one when the wait ran out.
        StoreUnavailable: no answer within the wait, or JetStream not enabled.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PLACEMENT_WAIT_S
    while True:
        try:
            return await _api(nc, subject, body, timeout_s)
        except _ApiError as e:
            transient = e.err_code in _ERR_NO_PLACEMENT or e.code == 503
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
    nc: NATS, wanted: dict[str, Any], timeout_s: float, *, disposable: bool = False
) -> None:
    """Create the stream, or update it to ``wanted``; a ``disposable`` stream (contents
    that may be lost) whose update the server refuses is deleted and created anew."""
    name = wanted["name"]
    for _ in range(3):
        try:
            info = await _api_waiting(nc, f"STREAM.INFO.{name}", None, timeout_s)
        except _ApiError as e:
            if e.code != 404:
                raise ProvisioningError(f"stream {name}: {e}") from e
            try:
                await _api_waiting(nc, f"STREAM.CREATE.{name}", wanted, timeout_s)
                log.info("created stream %s", name)
                return
            except _ApiError as ce:
                if ce.err_code == _ERR_STREAM_NAME_IN_USE:
                    continue  # created concurrently by another process: compare it
                raise ProvisioningError(f"stream {name}: cannot create: {ce}") from ce
        diff = _differences(info["config"], wanted)
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
        except _ApiError as e:
            if disposable:
                log.warning("%s; recreating it", _diff_text("stream", name, diff))
                try:
                    await _api(nc, f"STREAM.DELETE.{name}", None, timeout_s)
                except _ApiError as de:
                    if de.code != 404:
                        raise ProvisioningError(f"stream {name}: cannot delete: {de}") from de
                continue
            raise ProvisioningError(
                f"{_diff_text('stream', name, diff)}; the server refused the update: {e}"
            ) from e
        left = _differences(resp["config"], wanted)
        if left:
            raise ProvisioningError(_diff_text("stream", name, left) + " (update not applied)")
        log.warning("updated %s", _diff_text("stream", name, diff))
        return
    raise ProvisioningError(f"stream {name}: keeps changing while being provisioned")


async def _ensure_consumer(nc: NATS, stream: str, wanted: dict[str, Any], timeout_s: float) -> None:
    name = wanted["name"]
    for _ in range(3):
        try:
            info = await _api_waiting(nc, f"CONSUMER.INFO.{stream}.{name}", None, timeout_s)
        except _ApiError as e:
            if e.code != 404:
                raise ProvisioningError(f"consumer {stream}/{name}: {e}") from e
            req = {"stream_name": stream, "config": wanted, "action": "create"}
            try:
                await _api_waiting(nc, f"CONSUMER.CREATE.{stream}.{name}", req, timeout_s)
                log.info("created consumer %s/%s", stream, name)
                return
            except _ApiError as ce:
                if ce.err_code in _ERR_CONSUMER_EXISTS:
                    continue
                raise ProvisioningError(f"consumer {stream}/{name}: cannot create: {ce}") from ce
        config = info["config"]
        diff = _differences(config, wanted)
        if config.get("backoff"):
            diff["backoff"] = (config["backoff"], None)
        if not diff:
            return
        new = {**config, **wanted}
        new.pop("backoff", None)
        req = {"stream_name": stream, "config": new, "action": "update"}
        try:
            resp = await _api(nc, f"CONSUMER.CREATE.{stream}.{name}", req, timeout_s)
        except _ApiError as e:
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


async def provision(nc: NATS, settings: NatsSettings, names: Names) -> None:
    """Create or update every stream, bucket and consumer jsqueue needs.

    Idempotent and safe to run from many processes at once. An existing object whose
    settings differ is updated; if the server refuses (e.g. a retention or storage change,
    or 3 replicas on a single node) nothing is silently kept: ProvisioningError names the
    object and the setting.

    Raises:
        ProvisioningError: an object exists with settings that cannot be brought in line.
        StoreUnavailable: NATS or JetStream is not reachable.
    """
    timeout_s = settings.request_timeout_s
    for wanted in _stream_configs(settings, names):
        disposable = wanted["name"] == f"KV_{names.ingest_bucket}"
        await _ensure_stream(nc, wanted, timeout_s, disposable=disposable)
    await _ensure_consumer(nc, names.work_stream, _consumer_config(settings, names), timeout_s)


# --------------------------------------------------------------------------- connection


async def connect_nats(settings: NatsSettings, urls: list[str]) -> NATS:
    """Connect to NATS; the connection then reconnects forever (node loss, restarts).

    Args:
        settings: credentials and timeouts.
        urls: server URLs (several for a cluster).

    Raises:
        StoreUnavailable: no server accepted a connection within ``connect_timeout_s``
            seconds per URL.
    """
    nc = NATS()
    errors: list[BaseException] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)
        log.warning("nats: %s", _describe(e))

    async def on_disconnected() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected")

    async def on_reconnected() -> None:
        log.warning("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")

    options: dict[str, Any] = {
        "servers": urls,
        "name": "jsqueue",
        "connect_timeout": settings.connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if settings.user:
        options["user"] = settings.user
    if settings.password:
        options["password"] = settings.password.get_secret_value()
    if settings.creds_file:
        options["user_credentials"] = str(settings.creds_file)
    budget_s = settings.connect_timeout_s * max(1, len(urls))
    try:
        await asyncio.wait_for(nc.connect(**options), timeout=budget_s)
    except (TimeoutError, *_NatsFailure) as e:
        await close_nats(nc)
        cause = _describe(errors[-1]) if errors else _describe(e)
        raise StoreUnavailable(
            f"cannot connect to NATS at {', '.join(urls)} within {budget_s:g} s: {cause}"
        ) from e
    return nc


async def open_jetstream(
    settings: NatsSettings, urls: list[str] | None = None, *, names: Names | None = None
) -> Stores:
    """Connect, provision and return the JetStream body store, entry store and scheduler.

    Args:
        settings: the ``nats`` settings section.
        urls: server URLs; ``settings.urls`` when None (e.g. the embedded server's URL).
        names: object names; ``Names(settings.prefix)`` when None.

    Returns:
        the stores; ``close()`` flushes buffered acks and closes the connection.

    Raises:
        ConfigError: no URL given.
        StoreUnavailable: NATS unreachable (within the connect timeout) or JetStream off.
        ProvisioningError: see :func:`provision`.
    """
    names = names or Names(settings.prefix)
    servers = list(urls or settings.urls)
    if not servers:
        raise ConfigError("nats.urls: no NATS server URL given")
    nc = await connect_nats(settings, servers)
    try:
        await provision(nc, settings, names)
    except BaseException:
        await _close(nc)
        raise
    timeout_s = settings.request_timeout_s
    bodies = JetStreamBodyStore(nc, names, timeout_s=timeout_s)
    entries = JetStreamEntryStore(nc, names, timeout_s=timeout_s)
    scheduler = JetStreamScheduler(nc, names, timeout_s=timeout_s)
    ingest = JetStreamIngestLog(nc, names, timeout_s=timeout_s)

    async def close() -> None:
        await _close(nc)

    return Stores(bodies, entries, scheduler, close, ingest)


async def queue_backlog(
    settings: NatsSettings, urls: list[str] | None = None, *, names: Names | None = None
) -> int:
    """The health probe: read the work consumer without creating or changing anything.

    Args:
        settings: the ``nats`` settings section.
        urls: server URLs; ``settings.urls`` when None.
        names: object names; ``Names(settings.prefix)`` when None.

    Returns:
        the work backlog (consumer num_pending + num_ack_pending).

    Raises:
        ConfigError: no URL given.
        StoreUnavailable: NATS unreachable or not answering.
        ProvisioningError: the work stream or its consumer does not exist (the queue was
            never set up on this NATS, or under another ``nats.prefix``).
    """
    names = names or Names(settings.prefix)
    servers = list(urls or settings.urls)
    if not servers:
        raise ConfigError("nats.urls: no NATS server URL given")
    nc = await connect_nats(settings, servers)
    try:
        js = nc.jetstream(timeout=settings.request_timeout_s)
        with _translate("work consumer: info"):
            try:
                info = await js.consumer_info(names.work_stream, names.work_consumer)
            except nats.js.errors.NotFoundError as e:
                raise ProvisioningError(
                    f"queue not set up on NATS: {names.work_stream}/{names.work_consumer} "
                    "does not exist (start a worker or front end first, or check nats.prefix)"
                ) from e
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    finally:
        await _close(nc)


async def _close(nc: NATS) -> None:
    """Flush what is buffered (acks, NAKs) with a server round trip, then close.

    Not ``drain()``: it waits for pull-subscription inboxes that nobody reads any more.
    """
    if nc.is_closed:
        return
    try:
        await nc.flush(timeout=2)
    except (TimeoutError, *_NatsFailure) as e:
        log.warning("nats: final flush failed (%s); closing anyway", _describe(e))
    await close_nats(nc)


async def close_nats(nc: NATS) -> None:
    """Close ``nc``, whatever state its connection is in. Never raises (cancellation aside).

    A connection whose server is gone fails in nats-py's close: a lost-connection error, or
    on uvloop a RuntimeError when it writes what is still buffered to the transport uvloop has
    closed (the standard loop drops such a write silently).

    It also makes sure nats-py's reconnect task has ended. ``close()`` cancels that task
    once, and nats-py (2.16) can lose the cancellation: landing while a connect to a server
    that is gone is refused, ``asyncio.wait_for`` (Python 3.11) returns the refusal instead,
    and the server loop retries for ever without looking at ``is_closed``. Timers of equal
    period (reconnect wait, flush and close timeouts) make that likely, uvloop more so. A
    task left running keeps the event loop from closing, so a process would hang on
    SIGTERM; it is cancelled until it has ended (nats-py has no public handle on it).
    """
    with contextlib.suppress(*_NatsFailure, RuntimeError):
        await nc.close()
    task: asyncio.Task[None] | None = getattr(nc, "_reconnection_task", None)
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECONNECT_WAIT_S / 5)


# --------------------------------------------------------------------------- bodies


class _SourceFailed(Exception):
    """The body's chunk stream (the caller's) raised; the cause is re-raised unchanged."""


def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def _hex_digest(object_digest: str) -> str:
    """``SHA-256=<base64url>`` (object-store meta) → lower-case hex."""
    raw = object_digest.split("=", 1)[1] if object_digest.upper().startswith("SHA-256=") else ""
    try:
        return base64.urlsafe_b64decode(raw).hex()
    except ValueError:
        return ""


class JetStreamBodyStore:
    """:class:`~jsqueue.store.base.BodyStore` on a JetStream object store.

    Bodies are written in the nats object-store format (chunks on ``$O.<bucket>.C.<nuid>``,
    one meta message on ``$O.<bucket>.M.<base64url(queue id)>``), so ``nats object`` tools
    can read them. Reads never create a consumer (DESIGN.md §7: every ``ObjectStore.get``
    leaves an ephemeral consumer behind): the meta by direct get-last, then each chunk by
    direct get-next-by-subject. Deleting removes chunks and meta without leaving a marker.

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
        chunk_size: chunk size, octets (capped at the server's max payload).
    """

    def __init__(
        self, nc: NATS, names: Names, *, timeout_s: float = 5.0, chunk_size: int = CHUNK_SIZE
    ) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = names.bodies_bucket
        self.stream = f"OBJ_{self.bucket}"
        self._nc = nc
        self._timeout_s = timeout_s
        self._chunk_size = chunk_size
        self._nuid = NUID()
        # Chunk-set nuid of bodies this process opened lately: delete() of a body just
        # delivered then needs no meta read (one round trip less per message).
        self._opened: OrderedDict[str, str] = OrderedDict()

    def meta_subject(self, queue_id: str) -> str:
        """Subject of a body's meta message."""
        return f"$O.{self.bucket}.M.{_b64(queue_id)}"

    def chunk_subject(self, nuid: str) -> str:
        """Subject of the chunks of one stored version of a body."""
        return f"$O.{self.bucket}.C.{nuid}"

    async def meta(self, queue_id: str) -> dict[str, Any] | None:
        """The stored meta record of a body (object-store JSON), None when absent/deleted.

        Raises:
            BodyCorrupt: the meta record cannot be parsed.
            StoreUnavailable.
        """
        with _translate(f"body {queue_id}: read meta"):
            try:
                msg = await self.js.get_msg(
                    self.stream, subject=self.meta_subject(queue_id), direct=True
                )
            except nats.js.errors.NotFoundError:
                return None
        try:
            meta = json.loads(msg.data or b"{}")
        except ValueError as e:
            raise BodyCorrupt(f"body {queue_id}: object meta is not JSON") from e
        if not isinstance(meta, dict):
            raise BodyCorrupt(f"body {queue_id}: object meta is not a JSON object")
        if meta.get("deleted"):
            return None
        if not (
            isinstance(meta.get("nuid"), str)
            and isinstance(meta.get("digest"), str)
            and isinstance(meta.get("size", 0), int)
            and isinstance(meta.get("chunks", 0), int)
        ):
            raise BodyCorrupt(f"body {queue_id}: object meta lacks nuid/digest/size/chunks")
        return meta

    async def put(
        self, queue_id: str, chunks: AsyncIterable[bytes], *, fresh: bool = False
    ) -> BodyInfo:
        """See :meth:`BodyStore.put`. Holds at most ``PUT_WINDOW`` chunks in memory.

        A ``fresh`` body's chunk set is named like its meta (``$O.<bucket>.C.<token>`` beside
        ``$O.<bucket>.M.<token>``), so :meth:`delete` purges both with one wildcard filter;
        any other gets a random chunk-set name, as the object store does.
        """
        check_queue_id(queue_id)
        self._opened.pop(queue_id, None)
        nuid = _b64(queue_id) if fresh else self._nuid.next().decode()
        subject = self.chunk_subject(nuid)
        size = max(1, min(self._chunk_size, self._nc.max_payload or self._chunk_size))
        digest = hashlib.sha256()
        total = count = 0
        buf = bytearray()
        pending: deque[asyncio.Future[api.PubAck]] = deque()
        what = f"body {queue_id}: store"
        source = aiter(chunks)
        try:
            while True:
                try:
                    piece = await anext(source)
                except StopAsyncIteration:
                    break
                except BaseException as e:
                    raise _SourceFailed() from e
                digest.update(piece)
                total += len(piece)
                buf += piece
                while len(buf) >= size:
                    await self._send(subject, bytes(buf[:size]), pending)
                    del buf[:size]
                    count += 1
            if buf:
                await self._send(subject, bytes(buf), pending)
                count += 1
            meta = {
                "name": queue_id,
                "bucket": self.bucket,
                "nuid": nuid,
                "size": total,
                "chunks": count,
                "digest": "SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
                "mtime": datetime.now(UTC).isoformat(),
                "options": {"max_chunk_size": size},
            }
            # The meta goes out right behind the last chunks, before their acks are in: one
            # connection, one stream, so it is stored after them (a round trip less per
            # body). Should a chunk fail after all, a stored meta is taken back.
            meta_put = asyncio.ensure_future(self._put_meta(queue_id, meta))
            try:
                while pending:
                    await asyncio.wait_for(pending.popleft(), self._timeout_s)
            except BaseException:
                await self._withdraw_meta(queue_id, meta_put)
                raise
            await meta_put
        except _SourceFailed as e:
            # The caller's stream failed (client gone, size limit ...): its error, not ours.
            await self._discard(subject, pending)
            assert e.__cause__ is not None
            raise e.__cause__ from None
        except _NatsFailure as e:
            await self._discard(subject, pending)
            raise _unavailable(what, e) from e
        except BaseException:
            await self._discard(subject, pending)
            raise
        return BodyInfo(size=total, digest=digest.hexdigest())

    async def _send(
        self, subject: str, data: bytes, pending: deque[asyncio.Future[api.PubAck]]
    ) -> None:
        # publish_async writes in call order, so the chunks are stored in order.
        pending.append(await self.js.publish_async(subject, data))
        if len(pending) >= PUT_WINDOW:
            await asyncio.wait_for(pending.popleft(), self._timeout_s)

    async def _put_meta(self, queue_id: str, meta: dict[str, Any]) -> None:
        subject = self.meta_subject(queue_id)
        data = json.dumps(meta).encode()
        try:
            # Fast path: no body under this id yet (queue ids are unique).
            await self.js.publish(
                subject, data, headers={_HDR_ROLLUP: "sub", _HDR_EXPECTED_LAST_SUBJ_SEQ: "0"}
            )
            return
        except nats.js.errors.APIError as e:
            if not _is_wrong_last_seq(e):
                raise
        except _Retryable:
            # Ambiguous: the meta may have been stored. Ours if it carries our nuid.
            current = await self.meta(queue_id)
            if current is not None and current.get("nuid") == meta["nuid"]:
                return
            raise
        old = await self.meta(queue_id)
        await self.js.publish(subject, data, headers={_HDR_ROLLUP: "sub"})
        if old is not None and old.get("nuid") != meta["nuid"]:
            await self.js.purge_stream(self.stream, subject=self.chunk_subject(old["nuid"]))

    async def _withdraw_meta(self, queue_id: str, meta_put: asyncio.Future[None]) -> None:
        """A chunk failed after the meta was sent: remove the meta if it was stored."""
        try:
            await meta_put
        except asyncio.CancelledError:
            raise
        except Exception:
            return  # the meta was not stored either: nothing to take back
        try:
            await self.js.purge_stream(self.stream, subject=self.meta_subject(queue_id))
        except _NatsFailure as e:
            log.warning("could not remove the meta of failed body %s: %s", queue_id, _describe(e))

    async def _discard(self, subject: str, pending: deque[asyncio.Future[api.PubAck]]) -> None:
        for fut in pending:
            fut.cancel()
        try:
            await self.js.purge_stream(self.stream, subject=subject)
        except _NatsFailure as e:
            log.warning("could not remove chunks %s of a failed put: %s", subject, _describe(e))

    async def open(
        self, queue_id: str, *, expect: BodyInfo | None = None
    ) -> AsyncGenerator[bytes, None]:
        """See :meth:`BodyStore.open`. Each chunk is one direct get; no consumer is made.

        With ``expect``, the chunks of a fresh body (:meth:`put`) are read without the
        meta record (one round trip less); when there are none under that name (a body
        stored otherwise, an empty one, or none at all) the meta is read as usual.
        """
        check_queue_id(queue_id)
        first: api.RawStreamMsg | None = None
        if expect is not None and expect.size > 0:
            first = await self._chunk(queue_id, self.chunk_subject(_b64(queue_id)), 1)
        if first is not None:
            assert expect is not None
            nuid = _b64(queue_id)
            chunks = self._chunks(queue_id, nuid, expect.size, expect.digest, None, first)
        else:
            meta = await self.meta(queue_id)
            if meta is None:
                raise BodyNotFound(queue_id)
            nuid = meta["nuid"]
            stored = BodyInfo(size=int(meta.get("size") or 0), digest=_hex_digest(meta["digest"]))
            if expect is not None and expect != stored:
                raise BodyCorrupt(f"body {queue_id}: not the expected size and digest")
            n_chunks = int(meta.get("chunks") or 0)
            chunks = self._chunks(queue_id, nuid, stored.size, stored.digest, n_chunks)
        self._remember(queue_id, nuid)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _remember(self, queue_id: str, nuid: str) -> None:
        """Note the chunk set of a body being read, for :meth:`delete`."""
        self._opened[queue_id] = nuid
        self._opened.move_to_end(queue_id)
        if len(self._opened) > OPENED_MEMORY:
            self._opened.popitem(last=False)

    async def _chunk(self, queue_id: str, subject: str, seq: int) -> api.RawStreamMsg | None:
        """The first chunk on ``subject`` at or after ``seq``; None when there is none."""
        with _translate(f"body {queue_id}: read chunk"):
            try:
                msg: api.RawStreamMsg = await self.js.get_msg(
                    self.stream, seq=seq, subject=subject, next=True, direct=True
                )
                return msg
            except nats.js.errors.NotFoundError:
                return None

    async def _chunks(
        self,
        queue_id: str,
        nuid: str,
        size: int,
        expected: str,
        n_chunks: int | None,
        first: api.RawStreamMsg | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The chunks of set ``nuid`` in order (``n_chunks`` of them, or None: until
        ``size`` octets arrived; ``first`` already fetched), the size and hex SHA-256
        ``expected`` checked before the last one is yielded."""
        subject = self.chunk_subject(nuid)
        digest = hashlib.sha256()
        seq = 1
        got = count = 0
        msg = first
        held: bytes | None = None  # each chunk is yielded once the next one is in hand
        while count < n_chunks if n_chunks is not None else got < size:
            if msg is None:
                msg = await self._chunk(queue_id, subject, seq)
            if msg is None:
                now = await self.meta(queue_id)
                if now is None or now.get("nuid") != nuid:
                    raise BodyNotFound(f"{queue_id} (deleted or replaced while reading)")
                raise BodyCorrupt(f"body {queue_id}: chunk {count + 1} is missing")
            assert msg.seq is not None
            seq = msg.seq + 1
            data = msg.data or b""
            if not data and n_chunks is None:
                raise BodyCorrupt(f"body {queue_id}: empty chunk")
            digest.update(data)
            got += len(data)
            count += 1
            msg = None
            if held is not None:
                yield held
            held = data
        if got != size or digest.hexdigest() != expected:
            raise BodyCorrupt(f"body {queue_id}: digest or size mismatch")
        if held is not None:
            yield held

    async def info(self, queue_id: str) -> BodyInfo:
        """See :meth:`BodyStore.info`."""
        check_queue_id(queue_id)
        meta = await self.meta(queue_id)
        if meta is None:
            raise BodyNotFound(queue_id)
        return BodyInfo(size=int(meta.get("size") or 0), digest=_hex_digest(meta["digest"]))

    async def delete(self, queue_id: str) -> None:
        """See :meth:`BodyStore.delete`. A fresh body's meta and chunks go in one purge;
        otherwise chunks go first, so a retried delete finishes.

        The chunk set is the one this process last opened under ``queue_id`` when it
        remembers one, else the meta record is read. (Should another process have stored
        the body anew in between, its chunks are left without meta, which the reconciler
        purges.)
        """
        check_queue_id(queue_id)
        nuid = self._opened.pop(queue_id, None)
        if nuid is None:
            meta = await self.meta(queue_id)
            nuid = meta["nuid"] if meta is not None else None
        with _translate(f"body {queue_id}: delete"):
            if nuid == _b64(queue_id):  # a fresh body: meta and chunks in one purge
                await self.js.purge_stream(self.stream, subject=f"$O.{self.bucket}.*.{nuid}")
                return
            if nuid is not None:
                await self.js.purge_stream(self.stream, subject=self.chunk_subject(nuid))
            await self.js.purge_stream(self.stream, subject=self.meta_subject(queue_id))


# --------------------------------------------------------------------------- entries


class _WrongRevision(Exception):
    """The subject's last sequence was not the expected one (and not by our own write)."""


def _is_marker(msg: api.RawStreamMsg) -> bool:
    headers = msg.headers or {}
    return headers.get(_KV_OP) in ("DEL", "PURGE") or _MARKER_REASON in headers


class JetStreamEntryStore:
    """:class:`~jsqueue.store.base.EntryStore` on a JetStream KV bucket (key = queue id).

    The value is :meth:`Entry.to_json` (an inline body after the JSON line); its size is
    bounded by the server's maximum payload (:attr:`max_value_size`).

    The revision is the KV revision (stream sequence). Reads are direct gets. A delete
    writes a purge marker (``KV-Operation: PURGE``, rolled up, so the value is gone) that
    itself expires after :data:`DELETE_MARKER_TTL_S`; a deleted key reads as
    EntryNotFound and can be created again.

    Cost of the listing calls: :meth:`page` and :meth:`count_by_state` get the key list in
    one stream-info request (subjects filter; ~0.13 s and ~4 MB for 100k keys, paged by the
    server at 100k), sort it, then read values by direct get, ``SCAN_BATCH`` at a time:
    :meth:`page` only as many as it needs to fill the page, :meth:`count_by_state` all of
    them. Neither creates a consumer. Values changed during a scan are read as of the moment
    they are fetched (no snapshot).

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket = names.entries_bucket
        self.stream = f"KV_{self.bucket}"
        self._nc = nc
        self._pre = f"$KV.{self.bucket}."
        self._timeout_s = timeout_s

    @property
    def max_value_size(self) -> int:
        """The server's maximum payload, octets (less room for the KV headers)."""
        return max(0, (self._nc.max_payload or 1024 * 1024) - KV_HEADER_ROOM)

    async def _last(self, queue_id: str, *, leader: bool = False) -> api.RawStreamMsg | None:
        with _translate(f"entry {queue_id}: read"):
            try:
                return await self.js.get_msg(
                    self.stream, subject=self._pre + queue_id, direct=not leader
                )
            except nats.js.errors.NotFoundError:
                return None

    async def _write(
        self, queue_id: str, data: bytes, headers: dict[str, str], last: int | None
    ) -> int:
        """Publish one KV write; with ``last``, only if the key's revision is still ``last``.

        Returns:
            the new revision.

        Raises:
            _WrongRevision: the CAS failed.
            StoreUnavailable.
        """
        msg_id = f"{queue_id}:{uuid.uuid4().hex}"
        hdrs = {**headers, _HDR_MSG_ID: msg_id}
        if last is not None:
            hdrs[_HDR_EXPECTED_LAST_SUBJ_SEQ] = str(last)
        what = f"entry {queue_id}: write"
        budget_s = PUBLISH_ATTEMPTS * self._timeout_s
        try:
            ack = await _publish(
                self.js, self._pre + queue_id, data, hdrs, what=what, budget_s=budget_s
            )
            return ack.seq
        except nats.js.errors.APIError as e:
            if not _is_wrong_last_seq(e):
                raise _unavailable(what, e) from e
            # Refused: either someone else wrote, or an earlier try of ours that timed out
            # was stored after all (the check precedes dedupe on the server). Asked of the
            # stream leader: a follower's direct get may not have our write yet.
            current = await self._last(queue_id, leader=True)
            if current is not None and (current.headers or {}).get(_HDR_MSG_ID) == msg_id:
                assert current.seq is not None
                return current.seq
            raise _WrongRevision() from e

    @staticmethod
    def _decode(queue_id: str, msg: api.RawStreamMsg) -> Versioned:
        assert msg.seq is not None
        try:
            return Versioned(Entry.from_json(msg.data or b""), msg.seq)
        except ValidationError as e:
            raise StoreError(f"entry {queue_id}: stored value is not a valid entry: {e}") from e

    async def create(self, entry: Entry) -> int:
        """See :meth:`EntryStore.create`."""
        check_queue_id(entry.id)
        data = encode_entry(entry, self.max_value_size)
        try:
            return await self._write(entry.id, data, {}, last=0)
        except _WrongRevision:
            pass
        current = await self._last(entry.id)
        if current is None or _is_marker(current):
            # Deleted (marker not yet expired) or the marker just expired: take its place.
            try:
                return await self._write(
                    entry.id, data, {}, last=current.seq if current is not None else 0
                )
            except _WrongRevision:
                pass
        raise EntryExists(entry.id)

    async def get(self, queue_id: str) -> Versioned:
        """See :meth:`EntryStore.get`.

        "Not found" is confirmed on the stream leader: with replicas, a direct get may be
        answered by a follower that has not applied the newest writes yet (a replica that
        was just restarted and is catching up; measured), and a worker that took such an
        answer for "entry gone" would drop a work item for good (DESIGN.md §2.2). A stale
        *found* answer is harmless: its revision fails the compare-and-set.
        """
        check_queue_id(queue_id)
        msg = await self._last(queue_id)
        if msg is None or _is_marker(msg):
            msg = await self._last(queue_id, leader=True)
        if msg is None:
            raise EntryNotFound(queue_id)
        if _is_marker(msg):
            raise EntryDeleted(queue_id)
        return self._decode(queue_id, msg)

    async def update(self, entry: Entry, revision: int) -> int:
        """See :meth:`EntryStore.update`."""
        check_queue_id(entry.id)
        if revision < 1:
            raise RevisionConflict(f"entry {entry.id}: expected revision {revision}")
        try:
            return await self._write(
                entry.id, encode_entry(entry, self.max_value_size), {}, last=revision
            )
        except _WrongRevision as e:
            raise RevisionConflict(f"entry {entry.id}: expected revision {revision}") from e

    async def delete(self, queue_id: str, revision: int | None = None) -> None:
        """See :meth:`EntryStore.delete`. Leaves a purge marker that expires on its own."""
        check_queue_id(queue_id)
        if revision is not None and revision < 1:
            raise RevisionConflict(f"entry {queue_id}: expected revision {revision}")
        headers = {_KV_OP: "PURGE", _HDR_ROLLUP: "sub", _HDR_TTL: f"{DELETE_MARKER_TTL_S}s"}
        try:
            await self._write(queue_id, b"", headers, last=revision)
        except _WrongRevision as e:
            raise RevisionConflict(f"entry {queue_id}: expected revision {revision}") from e

    async def keys(self) -> list[str]:
        """Every key in the bucket (deleted keys whose marker has not expired included),
        sorted. One stream-info request per 100k keys; no consumer.

        Raises:
            StoreUnavailable.
        """
        found: list[str] = []
        offset = 0
        while True:
            body = {"subjects_filter": self._pre + ">", "offset": offset}
            try:
                resp = await _api(self._nc, f"STREAM.INFO.{self.stream}", body, self._timeout_s)
            except _ApiError as e:
                raise StoreUnavailable(f"entries: list keys: {e}") from e
            subjects = resp.get("state", {}).get("subjects") or {}
            found.extend(s[len(self._pre) :] for s in subjects)
            offset += len(subjects)
            if not subjects or offset >= int(resp.get("total", 0)):
                break
        found.sort()
        return found

    async def _scan(self, after: str | None) -> AsyncGenerator[Versioned, None]:
        keys = await self.keys()
        start = bisect.bisect_right(keys, after) if after is not None else 0
        for i in range(start, len(keys), SCAN_BATCH):
            batch = keys[i : i + SCAN_BATCH]
            msgs = await asyncio.gather(*(self._last(k) for k in batch))
            for key, msg in zip(batch, msgs, strict=True):
                if msg is not None and not _is_marker(msg):
                    yield self._decode(key, msg)

    async def page(
        self, *, state: EntryState | None = None, after: str | None = None, limit: int = 100
    ) -> list[Versioned]:
        """See :meth:`EntryStore.page`."""
        out: list[Versioned] = []
        if limit < 1:
            return out
        scan = self._scan(after)
        try:
            async for v in scan:
                if state is None or v.entry.state == state:
                    out.append(v)
                    if len(out) >= limit:
                        break
        finally:
            await scan.aclose()
        return out

    async def count_by_state(self) -> dict[EntryState, int]:
        """See :meth:`EntryStore.count_by_state`. Reads every entry (see class docstring)."""
        counts: dict[EntryState, int] = {}
        async for v in self._scan(None):
            st = v.entry.state
            counts[st] = counts.get(st, 0) + 1
        return counts


# --------------------------------------------------------------------------- scheduler


class JetStreamDue:
    """A work item fetched from the durable consumer; see :class:`~jsqueue.store.base.Due`.

    Settling twice is a no-op (like the memory scheduler). Acks are fire-and-forget: if one
    is lost the item is redelivered after the ack wait, which the KV re-check makes harmless
    (DESIGN.md §2.2).
    """

    def __init__(self, msg: Msg, item: WorkItem, deliveries: int) -> None:
        self.item = item
        self.deliveries = deliveries
        self.msg = msg
        self._settled = False

    async def _settle(self, what: str, action: Callable[[], Awaitable[None]]) -> None:
        if self._settled:
            return
        try:
            await action()
        except nats.errors.MsgAlreadyAckdError:
            pass
        except _NatsFailure as e:
            raise _unavailable(
                f"work item {self.item.queue_id}/{self.item.domain}: {what}", e
            ) from e
        self._settled = True

    async def ack(self) -> None:
        """Done: the item is removed for good.

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("ack", self.msg.ack)

    async def retry(self, delay_s: float) -> None:
        """NAK with a delay: delivered again in ``delay_s`` seconds (>= 0).

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("nak", lambda: self.msg.nak(delay=max(0.0, delay_s)))

    async def term(self) -> None:
        """Drop the item for good without delivering it again.

        Raises:
            StoreUnavailable: the connection is closed.
        """
        await self._settle("term", self.msg.term)

    async def in_progress(self) -> None:
        """Restart the ack-wait timer. A no-op once settled.

        Raises:
            StoreUnavailable: the connection is closed.
        """
        if self._settled:
            return
        try:
            await self.msg.in_progress()
        except _NatsFailure as e:
            raise _unavailable(f"work item {self.item.queue_id}: in progress", e) from e


def _encode_item(item: WorkItem) -> bytes:
    return json.dumps(
        {"id": item.queue_id, "domain": item.domain, "generation": item.generation},
        separators=(",", ":"),
    ).encode()


def _not_before(msg: Msg) -> float:
    """The item's due instant (Unix seconds); 0 (due) when the header is absent or bad."""
    try:
        return int((msg.headers or {}).get(NOT_BEFORE_HEADER, "0")) / 1000
    except ValueError:
        return 0.0


def _decode_item(data: bytes) -> WorkItem:
    raw = json.loads(data)
    return WorkItem(
        queue_id=check_queue_id(raw["id"]),
        domain=raw["domain"],
        generation=int(raw.get("generation", 0)),
    )


class JetStreamScheduler:
    """:class:`~jsqueue.store.base.Scheduler` on the work stream and its durable consumer.

    A work item is a message on ``Names.work_subject(queue_id, domain)`` carrying
    ``{id, domain, generation}``, a ``Nats-Msg-Id`` (:meth:`Names.work_msg_id`) and a
    ``Jsq-Not-Before`` header (Unix ms). :meth:`fetch` NAKs items that arrive before that
    instant with the remaining delay. A retry is a NAK with delay (DESIGN.md §1): it counts
    as ack-pending, which is why ``max_ack_pending`` must exceed the deferred backlog.

    Fetches are serialised per instance (one pull request at a time on its inbox); use one
    scheduler per worker loop, or accept that concurrent callers queue.

    Args:
        nc: a connected client.
        names: object names.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.names = names
        self._nc = nc
        self._timeout_s = timeout_s
        self._sub: JetStreamContext.PullSubscription | None = None
        self._fetch_lock = asyncio.Lock()

    async def _publish_item(self, item: WorkItem, at: datetime | None, msg_id: str) -> None:
        subject = self.names.work_subject(item.queue_id, item.domain)
        if at is not None and at.tzinfo is None:
            raise ValueError("schedule time must be timezone-aware")
        not_before = at.timestamp() if at is not None else time.time()
        headers = {_HDR_MSG_ID: msg_id, NOT_BEFORE_HEADER: str(int(not_before * 1000))}
        what = f"work item {item.queue_id}/{item.domain}: publish"
        budget_s = PUBLISH_ATTEMPTS * self._timeout_s
        try:
            await _publish(
                self.js, subject, _encode_item(item), headers, what=what, budget_s=budget_s
            )
        except nats.js.errors.APIError as e:
            raise _unavailable(what, e) from e

    async def schedule(self, item: WorkItem, at: datetime | None = None) -> None:
        """See :meth:`Scheduler.schedule`. A timed-out publish is retried with the same
        ``Nats-Msg-Id``, so it is stored once.

        Raises:
            InvalidName, StoreUnavailable; ValueError: ``at`` is naive.
        """
        msg_id = self.names.work_msg_id(item.queue_id, item.domain, item.generation)
        await self._publish_item(item, at, msg_id)

    async def flush(self, item: WorkItem) -> None:
        """See :meth:`Scheduler.flush`: purge the (queue id, domain) subject, publish due now.

        The new message gets its own ``Nats-Msg-Id`` so the dedupe window cannot swallow it
        when ``item`` equals the purged one.
        """
        subject = self.names.work_subject(item.queue_id, item.domain)
        with _translate(f"work item {item.queue_id}/{item.domain}: flush"):
            await self.js.purge_stream(self.names.work_stream, subject=subject)
        base = self.names.work_msg_id(item.queue_id, item.domain, item.generation)
        await self._publish_item(item, None, f"{base}:flush:{uuid.uuid4().hex}")

    async def cancel(self, queue_id: str) -> None:
        """See :meth:`Scheduler.cancel`."""
        subject = self.names.work_subjects_of(queue_id)
        with _translate(f"work items of {queue_id}: cancel"):
            await self.js.purge_stream(self.names.work_stream, subject=subject)

    async def backlog(self) -> int:
        """See :meth:`Scheduler.backlog`: consumer num_pending + num_ack_pending."""
        with _translate("work consumer: info"):
            info = await self.js.consumer_info(self.names.work_stream, self.names.work_consumer)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def _subscription(self) -> JetStreamContext.PullSubscription:
        if self._sub is None:
            with _translate("work consumer: bind"):
                self._sub = await self.js.pull_subscribe_bind(
                    durable=self.names.work_consumer, stream=self.names.work_stream
                )
        return self._sub

    async def fetch(self, batch: int, timeout_s: float) -> list[Due]:
        """See :meth:`Scheduler.fetch`.

        Items whose ``Jsq-Not-Before`` lies in the future are NAKed with the remaining delay
        and not returned; undecodable items are terminated (logged).

        Raises:
            StoreUnavailable: the connection is closed or the consumer is gone.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._fetch_lock:
            sub = await self._subscription()
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0.001:
                    return []
                if self._nc.is_closed:
                    raise StoreUnavailable("work consumer: fetch: connection closed")
                try:
                    msgs = await sub.fetch(max(1, batch), timeout=remaining)
                except TimeoutError:  # nats-py raises its own and asyncio's: nothing due
                    return []
                except _NatsFailure as e:
                    raise _unavailable("work consumer: fetch", e) from e
                out: list[Due] = []
                for msg in msgs:
                    due = await self._accept(msg)
                    if due is not None:
                        out.append(due)
                if out:
                    return out

    async def _accept(self, msg: Msg) -> JetStreamDue | None:
        try:
            item = _decode_item(msg.data)
            check_domain(item.domain)
        except (ValueError, KeyError, TypeError) as e:
            log.error("terminating undecodable work item on %s: %s", msg.subject, e)
            with _translate("work item: term"):
                await msg.term()
            return None
        wait_s = _not_before(msg) - time.time()
        if wait_s > 0:
            with _translate(f"work item {item.queue_id}/{item.domain}: nak"):
                await msg.nak(delay=wait_s)
            return None
        return JetStreamDue(msg, item, msg.metadata.num_delivered)


# --------------------------------------------------------------------------- ingest log


class JetStreamIngestLog:
    """:class:`~jsqueue.store.base.IngestLog` in a KV bucket (``Names.ingest_bucket``).

    One key per content key holding ``{"id": queue id, "at": unix seconds}``. The bucket
    forgets records after :data:`INGEST_MAX_AGE_S`, so a dedupe window beyond that is cut
    to it. Lookups are direct gets (no consumer); records are plain puts, claims puts that
    expect no record. The bucket is held in the NATS servers' memory (no fsync per message)
    and bounded by :data:`INGEST_MAX_BYTES`: a full NATS restart, or more records than fit,
    forgets the oldest; a resend of a forgotten message is queued anew, as without the log.
    """

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout_s)
        self.stream = f"KV_{names.ingest_bucket}"
        self._pre = f"$KV.{names.ingest_bucket}."

    async def lookup(self, key: str, max_age_s: float) -> str | None:
        """See :meth:`IngestLog.lookup`."""
        check_ingest_key(key)
        with _translate(f"ingest {key[:12]}: read"):
            try:
                msg = await self.js.get_msg(self.stream, subject=self._pre + key, direct=True)
            except nats.js.errors.NotFoundError:
                return None
        if not msg.data:
            return None
        record = json.loads(msg.data)
        if time.time() - float(record["at"]) > max_age_s:
            return None
        return str(record["id"])

    async def claim(self, key: str, queue_id: str, max_age_s: float) -> str | None:
        """See :meth:`IngestLog.claim`: a put expecting no record under ``key``; when one
        is there, it is looked up, and replaced only if older than ``max_age_s``."""
        check_ingest_key(key)
        data = json.dumps({"id": check_queue_id(queue_id), "at": time.time()}).encode()
        what = f"ingest {key[:12]}: claim"
        headers = {_HDR_EXPECTED_LAST_SUBJ_SEQ: "0"}
        try:
            await _publish(self.js, self._pre + key, data, headers, what=what)
            return None
        except nats.js.errors.APIError as e:
            if not _is_wrong_last_seq(e):
                raise _unavailable(what, e) from e
        earlier = await self.lookup(key, max_age_s)
        if earlier is None:  # older than the window: take its place
            await self.record(key, queue_id)
        # (our own id: a retried claim that was stored after all)
        return None if earlier in (None, queue_id) else earlier

    async def record(self, key: str, queue_id: str) -> None:
        """See :meth:`IngestLog.record`."""
        check_ingest_key(key)
        data = json.dumps({"id": check_queue_id(queue_id), "at": time.time()}).encode()
        await _publish(self.js, self._pre + key, data, {}, what=f"ingest {key[:12]}: write")
