"""The request and response models of the HTTP API that :mod:`jsqueue.views` does not
already hold; the OpenAPI document (:mod:`jsqueue.http.openapi`) is generated from them.

Data only, no I/O. Sizes are octets, ages seconds, times aware UTC (RFC 3339).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jsqueue.envelope import EntryState, Notify
from jsqueue.events import EventKind
from jsqueue.views import Action

#: A queue id (:func:`jsqueue.names.new_queue_id`): 26 lower-case Crockford base32 characters.
QUEUE_ID_PATTERN = r"^[0-9a-hjkmnp-tv-z]{26}$"
QueueId = Annotated[str, Field(pattern=QUEUE_ID_PATTERN, description="a queue id")]
#: A destination domain in its A-label (LDH) form (RFC 5890): U-labels go as ``xn--``.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DOMAIN_PATTERN = rf"^{_LABEL}(?:\.{_LABEL})*\.?$"
Domain = Annotated[
    str,
    Field(
        pattern=DOMAIN_PATTERN,
        max_length=253,
        description="a destination domain, A-label form (xn--... for U-labels)",
    ),
]


class _Strict(BaseModel):
    """Request models: unknown fields are errors (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    """Every error response (4xx, 5xx): the HTTP status, a short reason, and detail."""

    status: int = Field(ge=400, le=599)
    error: str = Field(description="short reason, e.g. 'unauthorized', 'not found'")
    detail: str = Field("", description="what was wrong, for a person")


class ListQuery(_Strict):
    """Query of ``GET /api/v1/queue``: the filters and paging of ``jsqueue queue ls``."""

    state: list[EntryState] | None = Field(
        None, description="only entries in these states (repeatable); default: not done"
    )
    domain: Domain | None = Field(
        None, description="only entries with an open recipient at this domain"
    )
    sender: str | None = Field(
        None,
        max_length=256,
        description="only this reverse-path ('<>' = null, '@example.com' = a domain)",
    )
    min_age_s: float | None = Field(None, ge=0, description="only entries at least this old")
    max_age_s: float | None = Field(None, ge=0, description="only entries at most this old")
    after: QueueId | None = Field(None, description="start after this queue id (next_after)")
    limit: int = Field(100, ge=1, le=10_000, description="entries per page (api.max_page)")


class DestinationsQuery(_Strict):
    """Query of ``GET /api/v1/destinations`` (``jsqueue dest ls``)."""

    queued: bool = Field(
        True, description="count each site's queued work items (one request per site)"
    )


class EntryFilterBody(_Strict):
    """Which entries a bulk action covers (as ``queue <action>`` filters). All must hold."""

    states: list[EntryState] | None = None
    domain: Domain | None = None
    sender: str | None = Field(None, max_length=256)
    min_age_s: float | None = Field(None, ge=0)
    max_age_s: float | None = Field(None, ge=0)


class ActionBody(_Strict):
    """Options of an action on one entry (``POST /api/v1/queue/{queue_id}/{action}``)."""

    domain: Domain | None = Field(None, description="flush only: just this destination domain")
    break_lease: bool = Field(
        False,
        description="flush only: break live workers' leases too (the message may be sent "
        "twice, RFC 5321 §6.1)",
    )


class BulkBody(_Strict):
    """A bulk action (``POST /api/v1/actions/{action}``): ``ids``, or ``filter``, or
    ``all``; exactly one of them. A filter needs at least one condition (422 otherwise):
    every entry is asked for as ``all``, never as an empty filter."""

    ids: list[QueueId] | None = Field(None, max_length=10_000)
    filter: EntryFilterBody | None = None
    all: bool = Field(False, description="every entry still in the queue")
    break_lease: bool = Field(False, description="flush only: break live workers' leases")

    @model_validator(mode="after")
    def _one_selection(self) -> BulkBody:
        given = sum((self.ids is not None, self.filter is not None, self.all))
        if given != 1:
            raise ValueError("give exactly one of ids, filter or all")
        return self


class EventsQuery(_Strict):
    """Query of ``GET /api/v1/events`` (server-sent events)."""

    kind: list[EventKind] | None = Field(None, description="only these kinds (repeatable)")
    queue_id: QueueId | None = Field(None, description="only the events of this message")
    since_s: float | None = Field(
        None, ge=0, le=30 * 86400, description="start with the events of the last N seconds"
    )
    from_start: bool = Field(False, description="start with the oldest event kept")
    until_end: bool = Field(
        False, description="end the stream once the events stored so far are sent"
    )


class RecipientSpec(_Strict):
    """One forward-path with its RFC 3461 DSN parameters."""

    address: str = Field(min_length=3, max_length=254, description="local@domain")
    notify: list[Notify] | None = Field(
        None, description="NOTIFY (RFC 3461 §4.1): NEVER alone, or SUCCESS/FAILURE/DELAY"
    )
    orcpt: str | None = Field(
        None,
        max_length=500,
        description="ORCPT (RFC 3461 §4.2) decoded, 'addr-type;address', e.g. "
        "'rfc822;bob@example.org'",
    )


class Attachment(_Strict):
    """One attachment of a built message."""

    filename: str = Field(min_length=1, max_length=255)
    content_type: str = Field(
        "application/octet-stream", pattern=r"^[!-~]+/[!-~]+$", max_length=255
    )
    content_base64: str = Field(description="the attachment's octets, base64 (RFC 4648 §4)")


class BuiltMessage(_Strict):
    """A message built with the standard library's ``email`` package: headers from these
    fields, a ``text/plain`` and/or ``text/html`` part, attachments. ``Date`` and
    ``Message-ID`` are added. ``bcc`` are envelope recipients only, never a header."""

    from_: str = Field(alias="from", min_length=3, max_length=998, description="From header")
    to: list[str] = Field(default_factory=list, max_length=10_000)
    cc: list[str] = Field(default_factory=list, max_length=10_000)
    bcc: list[str] = Field(default_factory=list, max_length=10_000)
    reply_to: str | None = Field(None, max_length=998)
    subject: str = Field("", max_length=998)
    text: str | None = None
    html: str | None = None
    headers: dict[str, str] = Field(
        default_factory=dict, description="further header fields (name: value)"
    )
    attachments: list[Attachment] = Field(default_factory=list, max_length=100)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class InjectBody(_Strict):
    """``POST /api/v1/inject``: the envelope (RFC 5321 §3.3, RFC 3461 DSN parameters) and the
    RFC 5322 message, given as ``raw`` text, ``raw_base64`` octets or ``message`` fields
    (exactly one).

    ``recipients`` may be left out with ``message``: then To, Cc and Bcc are the envelope.
    ``reverse_path`` may be left out with ``message``: then it is From's address. ``""`` is
    the null reverse-path ``<>``.
    """

    reverse_path: str | None = Field(None, max_length=254)
    recipients: list[RecipientSpec] | None = Field(None, min_length=1)
    envid: str | None = Field(None, min_length=1, max_length=100, description="ENVID, decoded")
    ret: Literal["FULL", "HDRS"] | None = Field(None, description="RET (RFC 3461 §4.3)")
    raw: str | None = Field(None, description="the whole message as text (UTF-8)")
    raw_base64: str | None = Field(None, description="the whole message's octets, base64")
    message: BuiltMessage | None = None

    @model_validator(mode="after")
    def _one_message(self) -> InjectBody:
        given = sum(x is not None for x in (self.raw, self.raw_base64, self.message))
        if given != 1:
            raise ValueError("give exactly one of raw, raw_base64 or message")
        if self.message is None and (self.recipients is None or self.reverse_path is None):
            raise ValueError("raw messages need reverse_path and recipients")
        return self


class InjectResult(BaseModel):
    """The message is stored durably (as SMTP's ``250 2.0.0 queued as <id>``)."""

    queue_id: str
    recipients: int = Field(description="envelope recipients queued")
    size: int = Field(description="the message's size as given (CRLF line ends), octets")
    duplicate: bool = Field(
        False, description="an earlier request with this Idempotency-Key stored it"
    )


class WhoAmI(BaseModel):
    """The caller's token: its name and role (never the token)."""

    name: str
    role: str


__all__ = [
    "QUEUE_ID_PATTERN",
    "Action",
    "ActionBody",
    "Attachment",
    "BuiltMessage",
    "BulkBody",
    "EntryFilterBody",
    "ErrorBody",
    "EventsQuery",
    "InjectBody",
    "InjectResult",
    "ListQuery",
    "QueueId",
    "RecipientSpec",
    "WhoAmI",
]
