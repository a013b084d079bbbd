"""Talking to JetStream: the one API request helper, the one table of server error codes,
publishing with retries, pipelined publishes whose refusals reach the caller, batched direct
gets (many subjects' last messages in one request), and the translation of nats errors
into :class:`~jsqueue.errors.StoreUnavailable` at this boundary
(``raise … from e``); every other module of :mod:`jsqueue.store.jetstream` goes through
these (docs/architecture.md, "Storage on JetStream": why a failed write's outcome is
unknown and how retries stay safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from jsqueue.errors import StoreFull, StoreUnavailable, reason
from jsqueue.names import js_api_subject
from jsqueue.store.deadline import retry_budget_s

log = logging.getLogger("jsqueue.store.jetstream")

#: What waits for a reply in an :class:`_Inbox`.
W = TypeVar("W")

#: Tries of a publish that timed out (same Nats-Msg-Id each time); the retries go on for
#: this many request timeouts in all (:func:`publish`).
PUBLISH_ATTEMPTS = 3
#: Pause before the first retry of a publish, seconds; doubled per retry up to the max.
RETRY_PAUSE_S = 0.25
#: Longest pause between retries of a publish, seconds.
RETRY_PAUSE_MAX_S = 1.0
#: Nanoseconds per second (JetStream's durations on the wire).
NS = 1_000_000_000

HDR_MSG_ID = "Nats-Msg-Id"
HDR_EXPECTED_LAST_SUBJ_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_ROLLUP = "Nats-Rollup"
HDR_TTL = "Nats-TTL"
HDR_KV_OP = "KV-Operation"
HDR_MARKER_REASON = "Nats-Marker-Reason"


class ErrCode(IntEnum):
    """JetStream API error codes (``err_code``) jsqueue acts on; names and numbers as in
    nats-server's ``server/errors.json``."""

    #: ``JSAccountResourcesExceededErr``: resource limits exceeded for account (the PubAck
    #: of a publish over the account's ``max_file`` or ``max_mem``).
    ACCOUNT_RESOURCES_EXCEEDED = 10002
    #: ``JSClusterNoPeersErrF``: no suitable peers for placement (R3 before peers are seen).
    CLUSTER_NO_PEERS = 10005
    #: ``JSConsumerNameExistErr``: consumer name already in use.
    CONSUMER_NAME_EXISTS = 10013
    #: ``JSInsufficientResourcesErr``: insufficient resources.
    INSUFFICIENT_RESOURCES = 10023
    #: ``JSMemoryResourcesExceededErr``: insufficient memory resources available.
    MEMORY_RESOURCES_EXCEEDED = 10028
    #: ``JSStorageResourcesExceededErr``: insufficient storage resources available.
    STORAGE_RESOURCES_EXCEEDED = 10047
    #: ``JSNoMessageFoundErr``: no message found (nats-py raises NotFoundError for it).
    NO_MESSAGE_FOUND = 10037
    #: ``JSStreamNameExistErr``: stream name already in use (with another config).
    STREAM_NAME_IN_USE = 10058
    #: ``JSStreamStoreFailedF``: the stream could not store the message (its text says why).
    STREAM_STORE_FAILED = 10077
    #: ``JSStreamWrongLastSequenceErrF``: wrong last sequence (a compare-and-set lost).
    WRONG_LAST_SEQUENCE = 10071
    #: ``JSConsumerAlreadyExists``: CREATE of an existing consumer with another config.
    CONSUMER_ALREADY_EXISTS = 10148
    #: ``JSStreamWrongLastSequenceConstantErr``: wrong last sequence (text without the seq).
    WRONG_LAST_SEQUENCE_CONSTANT = 10164
    #: ``JSStreamDuplicateMessageConflict`` (409): duplicate message id is in process: a
    #: write with this ``Nats-Msg-Id`` was proposed by the stream leader and not yet applied
    #: (a try that timed out during an election); a retry gets its duplicate ack.
    STREAM_DUPLICATE_MESSAGE_CONFLICT = 10158


#: A compare-and-set on the subject's last sequence was refused.
WRONG_LAST_SEQ = frozenset({ErrCode.WRONG_LAST_SEQUENCE, ErrCode.WRONG_LAST_SEQUENCE_CONSTANT})
#: The consumer exists already (created concurrently).
CONSUMER_EXISTS = frozenset({ErrCode.CONSUMER_NAME_EXISTS, ErrCode.CONSUMER_ALREADY_EXISTS})
#: Transient in a cluster whose peers are still coming online.
NO_PLACEMENT = frozenset({ErrCode.CLUSTER_NO_PEERS, ErrCode.INSUFFICIENT_RESOURCES})

#: The server is out of JetStream storage (its or the account's limits, or its disk).
STORAGE_FULL = frozenset(
    {
        ErrCode.ACCOUNT_RESOURCES_EXCEEDED,
        ErrCode.INSUFFICIENT_RESOURCES,
        ErrCode.MEMORY_RESOURCES_EXCEEDED,
        ErrCode.STORAGE_RESOURCES_EXCEEDED,
    }
)
#: What a stream at its own limits (``discard: new``) says when it stores no more.
_STREAM_LIMITS = ("maximum bytes exceeded", "maximum messages exceeded")

#: Failures worth retrying with the same message id.
RETRYABLE = (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, asyncio.TimeoutError)
#: Everything the nats client, a timeout or a socket may raise.
NATS_FAILURES = (nats.errors.Error, asyncio.TimeoutError, OSError)


class ApiError(Exception):
    """The JetStream API answered a request with an error.

    Attributes:
        code: the HTTP-like status (404, 503 …).
        err_code: the JetStream error code (:class:`ErrCode`).
        description: the server's text.
    """

    def __init__(self, err: dict[str, Any]) -> None:
        self.code = int(err.get("code", 0))
        self.err_code = int(err.get("err_code", 0))
        self.description = str(err.get("description", "unknown error"))
        super().__init__(f"{self.description} (status {self.code}, error {self.err_code})")


def describe(e: BaseException) -> str:
    """A one-line text for a nats (or any) error, with the JetStream codes when it has them."""
    if isinstance(e, nats.js.errors.APIError):
        return f"{e.description} (status {e.code}, error {e.err_code})"
    return reason(e)


def is_storage_full(e: BaseException) -> bool:
    """Whether ``e`` is a write refused for lack of storage (:data:`STORAGE_FULL`: the
    server's, the account's, or a stream at its byte or message limit), which the front end
    answers ``452 4.3.1`` (RFC 5321 §4.2.3, RFC 3463 §3.4 X.3.1). Pure; never raises."""
    if isinstance(e, nats.js.errors.APIError):
        err_code, text = e.err_code, e.description or ""
    elif isinstance(e, ApiError):
        err_code, text = e.err_code, e.description
    else:
        return False
    if err_code in STORAGE_FULL:
        return True
    return err_code == ErrCode.STREAM_STORE_FAILED and any(
        limit in text.lower() for limit in _STREAM_LIMITS
    )


def unavailable(what: str, e: BaseException) -> StoreUnavailable:
    """The StoreUnavailable for a failure of ``what`` (to raise ``from e``): a
    :class:`StoreFull` when the server is out of storage."""
    kind = StoreFull if is_storage_full(e) else StoreUnavailable
    return kind(f"{what}: {describe(e)}")


@contextlib.contextmanager
def translate(what: str) -> Iterator[None]:
    """Turn nats, timeout and socket errors into StoreUnavailable naming ``what``.

    Raises:
        StoreUnavailable: the body raised one of :data:`NATS_FAILURES`.
        unavailable: the StoreUnavailable above, as built by
            :func:`~jsqueue.store.jetstream.api.unavailable`.
    """
    try:
        yield
    except NATS_FAILURES as e:
        raise unavailable(what, e) from e


def is_wrong_last_seq(e: BaseException) -> bool:
    """Whether ``e`` is a refused compare-and-set (:data:`WRONG_LAST_SEQ`)."""
    return isinstance(e, nats.js.errors.APIError) and e.err_code in WRONG_LAST_SEQ


def is_temporary(e: BaseException) -> bool:
    """A failure worth retrying with the same message id: timeout, no responder, a 503, or
    "duplicate message id is in process" (an earlier try of this very write, still being
    applied: measured in a fault soak, 8 clients refused 451 after a leader change).

    A 503 for storage (:func:`is_storage_full`: nats-server answers a publish over its
    JetStream limits ``503 insufficient resources``) is not: seconds of retries do not
    free a disk, and the front end's ``452 4.3.1`` (RFC 5321 §4.2.3) is due at once. Pure.
    """
    if isinstance(e, RETRYABLE):
        return True
    if not isinstance(e, nats.js.errors.APIError):
        return False
    if e.err_code == ErrCode.STREAM_DUPLICATE_MESSAGE_CONFLICT:
        return True
    return e.code == 503 and not is_storage_full(e)


async def api_request(nc: NATS, request: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One JetStream API request (``$JS.API.<request>``); raw JSON in and out so unknown
    server fields survive.

    Args:
        nc: a connected client.
        request: the API request without the prefix, e.g. ``STREAM.INFO.<stream>``.
        body: the request's JSON body; None sends an empty payload.
        timeout_s: how long to wait for the answer, seconds.

    Returns:
        the decoded JSON answer.

    Raises:
        ApiError: the server answered with an error.
        StoreUnavailable: no answer within ``timeout_s``, the connection failed, or no
            responder (JetStream not enabled or not available).
        unavailable: the StoreUnavailable above, as built by
            :func:`~jsqueue.store.jetstream.api.unavailable`.
    """
    data = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(js_api_subject(request), data, timeout=timeout_s)
    except nats.errors.NoRespondersError as e:
        raise StoreUnavailable("JetStream is not enabled or not available on this server") from e
    except NATS_FAILURES as e:
        raise unavailable(f"JetStream API {request}", e) from e
    resp = json.loads(msg.data)
    if "error" in resp:
        raise ApiError(resp.get("error") or {})
    return resp


async def stream_subjects(
    nc: NATS, stream: str, subjects_filter: str, timeout_s: float, *, what: str | None = None
) -> dict[str, int]:
    """Subjects of ``stream`` matching ``subjects_filter`` that hold messages, with counts.

    Stream-info requests paged by the server (100k subjects each); no consumer is made.
    Read-only, so safe to repeat.

    Args:
        nc: a connected client.
        stream: the stream's name.
        subjects_filter: a subject filter (wildcards allowed).
        timeout_s: per-request timeout, seconds.
        what: names the listing in errors; ``stream <stream>: list subjects`` when None.

    Returns:
        subject → number of messages stored on it.

    Raises:
        StoreUnavailable: no answer, or the server refused the request (e.g. no such
            stream).
    """
    found: dict[str, int] = {}
    offset = 0
    while True:
        body = {"subjects_filter": subjects_filter, "offset": offset}
        try:
            resp = await api_request(nc, f"STREAM.INFO.{stream}", body, timeout_s)
        except ApiError as e:
            raise StoreUnavailable(f"{what or f'stream {stream}: list subjects'}: {e}") from e
        subjects = resp.get("state", {}).get("subjects") or {}
        found.update(subjects)
        offset += len(subjects)
        if not subjects or offset >= int(resp.get("total", 0)):
            return found


async def publish(
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
    passed, whichever comes later (within :func:`~jsqueue.store.deadline.retry_store_for`
    the budget is what is left to its deadline); pauses grow from :data:`RETRY_PAUSE_S` to
    :data:`RETRY_PAUSE_MAX_S`. Idempotent when ``headers`` carry a ``Nats-Msg-Id`` (within
    the stream's dedupe window) or an expected last sequence.

    Args:
        js: the JetStream context to publish with.
        subject: the stream subject.
        payload: the message body, octets.
        headers: message headers (sent unchanged on every try).
        what: names the write in errors and logs.
        attempts: tries at least.
        budget_s: time the retries may take in all, seconds.

    Returns:
        the stream's acknowledgement (stream, sequence).

    Raises:
        nats.js.errors.APIError: the stream refused the message (not a temporary failure;
            a refusal for storage is raised at its first try, :func:`is_temporary`).
        StoreUnavailable: every attempt timed out or found no stream leader, or the
            connection failed.
        unavailable: the StoreUnavailable above, as built by
            :func:`~jsqueue.store.jetstream.api.unavailable`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_budget_s(budget_s)
    pause = RETRY_PAUSE_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await js.publish(subject, payload, headers=dict(headers))
        except nats.js.errors.APIError as e:
            if not is_temporary(e):
                raise
            last: BaseException = e
        except RETRYABLE as e:
            last = e
        except nats.errors.Error as e:
            raise unavailable(what, e) from e
        if attempt >= attempts and loop.time() + pause >= deadline:
            break
        level = logging.WARNING if attempt == 1 else logging.DEBUG
        log.log(level, "%s: attempt %d failed (%s); retrying", what, attempt, describe(last))
        await asyncio.sleep(pause)
        pause = min(2 * pause, RETRY_PAUSE_MAX_S)
    log.warning("%s: giving up after %d attempts: %s", what, attempt, describe(last))
    raise unavailable(what, last) from last


async def get_stored(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    what: str,
    seq: int | None = None,
    leader: bool = False,
) -> api.RawStreamMsg | None:
    """One read of a stream message: the last on ``subject``, or with ``seq`` the first on
    ``subject`` at or after ``seq``. A direct get (any replica answers; DESIGN.md §7: fast)
    unless ``leader``: then the stream leader answers (``STREAM.MSG.GET``), so a write it
    acknowledged is seen. Read-only, so safe to repeat.

    Returns:
        the message, or None when there is none.

    Raises:
        StoreUnavailable: no answer, no stream leader, or the connection failed.
        unavailable: the StoreUnavailable above, as built by :func:`unavailable`.
    """
    with translate(f"{what}: read"):
        try:
            if seq is None:
                return await js.get_msg(stream, subject=subject, direct=not leader)
            return await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=not leader)
        except nats.js.errors.NotFoundError:
            return None


async def get_confirmed(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    what: str,
    seq: int | None = None,
    settled: Callable[[api.RawStreamMsg], bool] = lambda _: True,
    tries: int = 1,
    budget_s: float = 0.0,
) -> api.RawStreamMsg | None:
    """A read (:func:`get_stored`) whose "not found" is confirmed on the stream leader.

    A direct get may be answered by a replica that has not applied the newest writes (one
    just restarted or resumed and catching up: measured, a worker found 46 bodies "not
    found" right after a node came back), or time out on a replica that is silent. So a
    miss, a message ``settled`` refuses (a delete marker the leader may know to be
    replaced), or a failed direct get is asked again of the stream leader: ``tries`` times
    at least and for ``budget_s`` seconds (what is left of an enclosing
    :func:`~jsqueue.store.deadline.retry_store_for` block instead, when there is one)
    while the leader fails (an election: ~4–9 s, DESIGN.md §6), with growing pauses
    (:data:`RETRY_PAUSE_S` to :data:`RETRY_PAUSE_MAX_S`). A found answer of a replica is
    taken as it is (a stale one fails the compare-and-set that follows). Read-only.

    Returns:
        the message (the leader's answer when the direct get missed), or None when the
        leader has none either.

    Raises:
        StoreUnavailable: every try of the leader failed (the last failure is the cause).
        unavailable: the StoreUnavailable above, as built by :func:`unavailable`.
    """
    try:
        msg = await get_stored(js, stream, subject, what=what, seq=seq)
        if msg is not None and settled(msg):
            return msg
    except StoreUnavailable as e:
        log.debug("%s: direct get failed (%s); asking the stream leader", what, e)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_budget_s(budget_s)
    pause = RETRY_PAUSE_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await get_stored(js, stream, subject, what=what, seq=seq, leader=True)
        except StoreUnavailable:
            if attempt >= tries and loop.time() + pause >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(2 * pause, RETRY_PAUSE_MAX_S)


class _Inbox(Generic[W]):
    """Replies to many requests on one wildcard subscription of the connection, told apart
    by a token at the end of the reply subject (``<inbox>.<n>``); what waits for each
    reply is kept under its token until the subclass's :meth:`_on_reply` settles it.

    Args:
        nc: a connected client; the subscription is made at the first request and kept
            (the client resubscribes it after a reconnect).
    """

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = ""
        self._pending: dict[str, W] = {}
        self._count = 0

    async def _reply_to(self, waiter: W) -> tuple[str, str]:
        """A new token for ``waiter`` and the reply subject that carries it.

        Raises:
            nats.errors.Error: the subscription could not be made.
        """
        if not self._prefix:
            prefix = self._nc.new_inbox()
            await self._nc.subscribe(f"{prefix}.*", cb=self._on_reply)
            self._prefix = prefix
        self._count += 1
        token = str(self._count)
        self._pending[token] = waiter
        return token, f"{self._prefix}.{token}"

    def _waiter(self, msg: Any) -> W | None:
        """What waits for the reply ``msg`` (None: nobody any more)."""
        return self._pending.get(msg.subject.rsplit(".", 1)[-1])

    async def _on_reply(self, msg: Any) -> None:
        raise NotImplementedError


class PipelinedPublisher(_Inbox[asyncio.Future[api.PubAck]]):
    """Publishes to streams without waiting for each ack: :meth:`publish` writes the
    message (in call order on the one connection) and returns a future of its
    acknowledgement.

    The client library's own ``publish_async`` loses a stream's refusal: its reply handler
    raises the error instead of setting it on the future (which then never completes), so
    a chunk refused for lack of storage looked like a timeout. Here a refusal completes the
    future with the :class:`nats.js.errors.APIError` the stream answered, and no
    responders (no stream) with :class:`nats.js.errors.NoStreamResponseError`.

    Args:
        nc: a connected client; the reply subscription is made at the first publish and
            kept (the client resubscribes it after a reconnect).
    """

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[api.PubAck]:
        """Write one message to a stream subject; the future completes with its ack.

        Raises:
            nats.errors.Error: the write itself failed (connection closed ...).
        """
        fut: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        token, reply = await self._reply_to(fut)
        fut.add_done_callback(lambda _: self._pending.pop(token, None))
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except BaseException:
            fut.cancel()
            raise
        return fut

    async def _on_reply(self, msg: Any) -> None:
        fut = self._waiter(msg)
        if fut is None or fut.done():
            return
        status = (msg.headers or {}).get("Status")
        if status == "503":
            fut.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            resp = json.loads(msg.data)
        except ValueError:
            fut.set_exception(nats.errors.Error(f"malformed publish ack on {msg.subject}"))
            return
        err = resp.get("error") if isinstance(resp, dict) else None
        if err is not None:
            fut.set_exception(
                nats.js.errors.APIError(
                    code=err.get("code"),
                    description=err.get("description"),
                    err_code=err.get("err_code"),
                    stream=resp.get("stream"),
                )
            )
            return
        fut.set_result(api.PubAck.from_response(resp))


#: Subjects asked for in one batched direct get (nats-server answers ``413 Too Many
#: Results`` above 1 024).
DIRECT_BATCH = 256
#: Octets one batched direct get may answer with: the server stops there and says how many
#: messages it left out, which :meth:`DirectBatch.last` asks for again. Bounds what a batch
#: of large entries (inline bodies) holds in memory at once.
DIRECT_BATCH_BYTES = 4 << 20
#: The first nats-server release that answers batched direct gets (ADR-31); an older one
#: answers the first message only, so :class:`DirectBatch` is not used with it.
DIRECT_BATCH_SINCE = (2, 11)


@dataclass
class _Batch:
    """One batched direct get under way: the messages so far, and its outcome (messages,
    and how many results the server left out)."""

    done: asyncio.Future[tuple[list[api.RawStreamMsg], int]]
    msgs: list[api.RawStreamMsg] = field(default_factory=list)


def _raw_message(msg: Any) -> api.RawStreamMsg:
    """A direct get's answer as the stored message (subject, sequence, data, headers)."""
    headers = msg.headers or {}
    raw = api.RawStreamMsg()
    raw.subject = headers.get("Nats-Subject")
    raw.seq = int(headers.get("Nats-Sequence", "0"))
    raw.data = msg.data
    raw.headers = headers
    return raw


class DirectBatch(_Inbox[_Batch]):
    """The last message of many subjects of a stream in few requests: batched direct gets
    (``multi_last``, nats-server >= 2.11; the stream must allow direct gets).

    A scan of a KV bucket by one direct get per key costs one request (and its reply
    handling on both sides) per key; here one request covers :data:`DIRECT_BATCH` keys.
    Like every direct get it may be answered by a replica that has not applied the newest
    writes: what it returns is a snapshot (a missing subject may exist on the leader).
    Read-only, so safe to repeat.

    Args:
        nc: a connected client; the reply subscription is made at the first request and
            kept (the client resubscribes it after a reconnect).
    """

    @property
    def supported(self) -> bool:
        """Whether the connected server answers batched direct gets
        (:data:`DIRECT_BATCH_SINCE`)."""
        try:
            version = self._nc.connected_server_version
            return (version.major, version.minor) >= DIRECT_BATCH_SINCE
        except (AttributeError, TypeError, ValueError):  # not connected, or no version
            return False

    async def last(
        self, stream: str, subjects: Sequence[str], timeout_s: float
    ) -> dict[str, api.RawStreamMsg]:
        """The last message of each of ``subjects`` (no wildcards) that has one.

        Args:
            stream: the stream's name.
            subjects: subjects of the stream; asked for :data:`DIRECT_BATCH` at a time.
            timeout_s: how long to wait for one request's whole answer, seconds.

        Returns:
            subject -> its last message; a subject without a message is absent.

        Raises:
            TimeoutError: a request was not answered in full within ``timeout_s``.
            nats.js.errors.NoStreamResponseError: no such stream (no responders, 503), as
                :class:`PipelinedPublisher` reports it.
            nats.js.errors.APIError: the server refused a request otherwise (413 …).
            nats.errors.Error: the request could not be written (connection closed …).
            All of them are :data:`NATS_FAILURES`, which :func:`translate` turns into
            StoreUnavailable.
        """
        found: dict[str, api.RawStreamMsg] = {}
        for i in range(0, len(subjects), DIRECT_BATCH):
            todo = list(dict.fromkeys(subjects[i : i + DIRECT_BATCH]))
            while todo:
                msgs, left = await self._request(stream, todo, timeout_s)
                for msg in msgs:
                    if msg.subject is not None:
                        found[msg.subject] = msg
                if left <= 0 or not msgs:
                    break
                todo = [s for s in todo if s not in found]
        return found

    async def _request(
        self, stream: str, subjects: list[str], timeout_s: float
    ) -> tuple[list[api.RawStreamMsg], int]:
        batch = _Batch(asyncio.get_running_loop().create_future())
        token, reply = await self._reply_to(batch)
        body = {"multi_last": subjects, "batch": len(subjects), "max_bytes": DIRECT_BATCH_BYTES}
        try:
            await self._nc.publish(
                js_api_subject(f"DIRECT.GET.{stream}"), json.dumps(body).encode(), reply=reply
            )
            async with asyncio.timeout(timeout_s):
                return await batch.done
        finally:
            self._pending.pop(token, None)

    async def _on_reply(self, msg: Any) -> None:
        batch = self._waiter(msg)
        if batch is None or batch.done.done():
            return
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:
            batch.msgs.append(_raw_message(msg))
        elif status == "204":  # end of the batch; what it left out is pending
            left = int(headers.get("Nats-Num-Pending", "0") or 0)
            batch.done.set_result((batch.msgs, left))
        elif status == "404":  # none of the subjects has a message
            batch.done.set_result((batch.msgs, 0))
        elif status == "503":  # no responders: no such stream
            batch.done.set_exception(nats.js.errors.NoStreamResponseError())
        else:
            text = headers.get(api.Header.DESCRIPTION) or headers.get("Description") or ""
            batch.done.set_exception(nats.js.errors.APIError(code=int(status), description=text))
