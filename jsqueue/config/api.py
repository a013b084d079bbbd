"""The ``api`` settings section: the HTTP API on the process's HTTP endpoint
(:mod:`jsqueue.http`), its bearer tokens and the idempotency window of injection."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from jsqueue.config.base import _Section

#: The longest idempotency window: the ingest log forgets records after an hour
#: (``jsqueue.store.jetstream.provisioning.INGEST_MAX_AGE_S``).
MAX_IDEMPOTENCY_WINDOW_S = 3600.0


class ApiSettings(_Section):
    """The HTTP API (``/api/...``) beside ``/metrics`` on ``http.host:http.port``."""

    enabled: bool = Field(True, description="serve /api/ on the HTTP endpoint")
    tokens_file: Path | None = Field(
        None,
        description="bearer tokens, one 'name:role:sha256:<hex>' line each (a file or a "
        "Kubernetes Secret mount, re-read when it changes; make lines with 'jsqueue token "
        "add'); unset: every /api/ request gets 401",
    )
    idempotency_window_s: float = Field(
        3600.0,
        gt=0,
        le=MAX_IDEMPOTENCY_WINDOW_S,
        description="an inject retried with the same Idempotency-Key within this window "
        "gets the first queue id",
    )
    max_page: int = Field(1000, ge=1, le=10_000, description="largest page of a listing, entries")
    sse_keepalive_s: float = Field(
        15.0, gt=0, description="comment line sent on a quiet events stream"
    )
    max_bulk: int = Field(
        100_000, ge=1, description="most entries one bulk action by filter may touch"
    )
