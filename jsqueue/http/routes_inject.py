"""``POST /api/v1/inject`` (role ``inject``): a JSON envelope and message, stored through
the SMTP front end's ingest path (:mod:`jsqueue.http.inject`), answered ``202`` with the
queue id once stored durably, as SMTP's ``250``; ``503`` when NATS fails, never ``202``.
Limits are the front end's: ``smtp.max_message_size`` (413) and ``smtp.max_recipients``
(422)."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel

from jsqueue.errors import RequestRejected, StoreUnavailable
from jsqueue.http.auth import Role
from jsqueue.http.context import ApiContext
from jsqueue.http.inject import IDEMPOTENCY_KEY_RE, NotQueued, Submitter
from jsqueue.http.message import transaction
from jsqueue.http.models import InjectBody, InjectResult
from jsqueue.http.routing import Call, Route

IDEMPOTENCY_HEADER = "Idempotency-Key"


def inject_routes(ctx: ApiContext) -> list[Route]:
    """The inject route over ``ctx``."""

    async def inject(call: Call) -> BaseModel:
        keys = call.request.headers.getall(IDEMPOTENCY_HEADER, [])
        if len(keys) > 1:  # a single value (draft-ietf-httpapi-idempotency-key-header §2)
            raise RequestRejected(f"{IDEMPOTENCY_HEADER}: one header, not {len(keys)}", 400)
        key = keys[0] if keys else None
        if key is not None and not IDEMPOTENCY_KEY_RE.match(key):
            raise RequestRejected(f"{IDEMPOTENCY_HEADER}: 1-255 visible ASCII characters")
        smtp = ctx.settings.smtp
        try:
            tx = transaction(
                call.body,
                hostname=smtp.hostname,
                max_size=smtp.max_message_size,
                max_recipients=smtp.max_recipients,
            )
        except RequestRejected:
            raise
        except ValueError as e:  # a parser's refusal not worded as a RequestRejected
            raise RequestRejected(f"invalid message or envelope: {e}"[:300]) from e
        peer = call.request.remote or "127.0.0.1"
        try:
            who = Submitter.of(call.token, peer)
            fingerprint = hashlib.sha256(call.body.model_dump_json().encode()).hexdigest()
            return await ctx.injector.inject(tx, who, idempotency_key=key, fingerprint=fingerprint)
        except NotQueued as e:
            raise StoreUnavailable(f"not queued: {e.reason}") from e

    return [
        Route(
            "POST",
            "/api/v1/inject",
            "inject",
            "Queue one message: envelope with DSN parameters and the RFC 5322 message (raw, "
            "base64, or built from fields).",
            Role.INJECT,
            inject,
            response=InjectResult,
            status=202,
            body=InjectBody,
            errors=(400, 413),
            tag="inject",
            headers={
                IDEMPOTENCY_HEADER: (
                    {"type": "string", "pattern": IDEMPOTENCY_KEY_RE.pattern},
                    "a retry with the same key (and token) within api.idempotency_window_s "
                    "gets the first queue id and stores nothing; a different key never merges; "
                    "the same key with a different request is 422; two such headers are 400",
                )
            },
            description="202 means stored durably (body, entry, work items), as SMTP's 250; "
            "503 means nothing is stored: retry, with the same Idempotency-Key.",
        )
    ]
