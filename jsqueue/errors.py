"""The whole jsqueue exception tree.

::

    JsqueueError
    ├── ConfigError                 a setting is missing or invalid (names the setting)
    ├── ListenError                 a listener cannot bind its address (also an OSError)
    ├── InvalidName                 an id / domain / key would break a subject or key
    ├── StoreError                  the storage layer failed
    │   ├── StoreUnavailable        NATS unreachable, timed out, or refused the request
    │   │   └── StoreFull           ... because its storage is full (limits or disk)
    │   ├── EntryTooLarge           an entry's stored form exceeds what the store takes
    │   ├── EntryNotFound           no entry under that queue id
    │   │   └── EntryDeleted        ... and the store knows it was deleted lately
    │   ├── EntryExists             create-if-absent found an entry already there
    │   ├── RevisionConflict        compare-and-set lost: the entry changed meanwhile
    │   ├── BodyNotFound            no body stored under that queue id
    │   └── BodyCorrupt             the stored body does not match its SHA-256 digest
    ├── ProvisioningError           a bucket/stream/consumer exists with settings we cannot apply
    ├── LockLost                    the reconciler lock was lost (or not taken) for a pass
    ├── LeaseLost                   the lease is another worker's: an outcome is not recorded
    ├── PolicyError                 a published TLS policy or report could not be had or sent
    ├── SigningError                a message could not be DKIM-signed (it goes unsigned)
    ├── RequestRejected             the HTTP API refuses a request (carries the HTTP status)
    └── DeliveryError               one delivery attempt failed
        ├── TemporaryDeliveryError  retry later (4xx, timeouts, DNS SERVFAIL ...)
        └── PermanentDeliveryError  give up and bounce (5xx, NXDOMAIN, null MX ...)

Adapters translate library errors (nats, aiosmtplib, dnspython) into this tree at the
boundary with ``raise ... from e``; nothing above the adapters catches library errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jsqueue.replies import Reply


def reason(e: BaseException) -> str:
    """The text of ``e`` for a log line or reply, its class name when it has none (a bare
    ``TimeoutError`` from ``asyncio.timeout`` says nothing of its own). Pure."""
    return str(e) or type(e).__name__


class JsqueueError(Exception):
    """Root of every error jsqueue raises on purpose."""


class ConfigError(JsqueueError):
    """A setting is missing or invalid; the message names the setting and the reason."""


class ListenError(JsqueueError, OSError):
    """A listener could not bind its address; the message names the settings to change
    (e.g. ``http.host/http.port: cannot listen on 127.0.0.1:9125: address already in use``)."""


class InvalidName(JsqueueError, ValueError):
    """A queue id, domain or key token contains characters a NATS subject or KV key cannot hold."""


class StoreError(JsqueueError):
    """The storage layer failed."""


class StoreUnavailable(StoreError):
    """NATS could not be reached, timed out, or refused the request (e.g. bucket full)."""


class StoreFull(StoreUnavailable):
    """NATS refused a write because its storage is full: the server's or account's
    JetStream limits (``max_file_store``, ``max_memory_store``), its disk, or a stream's own
    limits. Temporary, as any StoreUnavailable: space comes back as mail is delivered."""


class EntryTooLarge(StoreError):
    """An entry's stored form is larger than the entry store takes (NATS's max_payload)."""


class EntryNotFound(StoreError):
    """No queue entry exists under the given queue id."""


class EntryDeleted(EntryNotFound):
    """No queue entry exists under the id, and the store knows it was deleted lately (as
    opposed to never stored yet)."""


class EntryExists(StoreError):
    """Create-if-absent found an entry already stored under the queue id."""


class RevisionConflict(StoreError):
    """A compare-and-set update lost the race: the stored revision is not the expected one."""


class BodyNotFound(StoreError):
    """No message body is stored under the given queue id."""


class BodyCorrupt(StoreError):
    """The stored body's bytes do not match the recorded SHA-256 digest."""


class ProvisioningError(JsqueueError):
    """An existing bucket, stream or consumer has settings that could not be brought in line."""


class LockLost(JsqueueError):
    """The reconciler lock was lost (or could not be renewed) during a pass."""


class LeaseLost(JsqueueError):
    """The lease on a destination is another worker's now (it took the destination over, or
    a later process of the same name did): what this worker did there is not recorded over
    it (DESIGN.md §2.3)."""


class PolicyError(JsqueueError):
    """A published TLS policy could not be had (MTA-STS fetch, DNS) or is invalid, or a TLS
    report could not be sent (RFC 8461, RFC 8460).

    Attributes:
        result_type: the RFC 8460 §4.3 result type that names the failure (e.g.
            ``sts-policy-fetch-error``, ``sts-policy-invalid``, ``sts-webpki-invalid``).
    """

    def __init__(self, message: str, result_type: str = "validation-failure") -> None:
        super().__init__(message)
        self.result_type = result_type


class SigningError(JsqueueError):
    """dkimpy could not sign a message (e.g. a header section it cannot parse, RFC 6376
    §5); the attempt sends it unsigned and says why."""


class RequestRejected(JsqueueError, ValueError):
    """The HTTP API refuses a request it cannot act on: a message too large (``status``
    413), an envelope or message that does not check out, a filter selecting too much (422).

    Attributes:
        status: the HTTP status to answer (RFC 9110 §15.5).
    """

    def __init__(self, detail: str, status: int = 422) -> None:
        super().__init__(detail)
        self.status = status


class DeliveryError(JsqueueError):
    """One delivery attempt failed.

    Attributes:
        reply: the remote (or synthesised) SMTP reply that explains the failure.
    """

    def __init__(self, reply: Reply) -> None:
        super().__init__(str(reply))
        self.reply = reply


class TemporaryDeliveryError(DeliveryError):
    """A 4xx-class failure: the recipient is deferred and retried (RFC 5321 §4.2.1)."""


class PermanentDeliveryError(DeliveryError):
    """A 5xx-class failure: the recipient is bounced, never retried (RFC 5321 §4.2.1)."""


def listen_error(section: str, host: str, port: int, error: OSError) -> ListenError:
    """The :class:`ListenError` for ``section``'s listener on ``host:port``."""
    reason = error.strerror or str(error)
    return ListenError(f"{section}.host/{section}.port: cannot listen on {host}:{port}: {reason}")
