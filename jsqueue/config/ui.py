"""The ``ui`` settings section: the dashboard at ``/ui/`` on the process's HTTP endpoint
(:mod:`jsqueue.ui`), its login cookie and the depth history it keeps in memory."""

from __future__ import annotations

from pydantic import Field

from jsqueue.config.base import _Section


class UiSettings(_Section):
    """The dashboard (``/ui/``) beside the HTTP API; it logs in with the API's tokens."""

    enabled: bool = Field(True, description="serve the dashboard at /ui/ (needs api.enabled)")
    sample_interval_s: float = Field(
        10.0,
        gt=0,
        description="shortest time between two depth samples of the overview (one pass "
        "over the entries each; a sample is repeated after at least ten times its own "
        "duration), seconds",
    )
    idle_s: float = Field(
        300.0,
        gt=0,
        description="the overview's depth samples and outcome counts are taken only while "
        "the dashboard is viewed: started by a page view, stopped this many seconds after "
        "the last one, seconds",
    )
    history_samples: int = Field(
        360, ge=2, le=100_000, description="depth samples kept in memory for the charts"
    )
    outcome_minutes: int = Field(
        60,
        ge=1,
        le=1440,
        description="minutes of delivery outcomes counted from the events stream",
    )
    page_size: int = Field(50, ge=1, le=1000, description="entries per page of the list")
    search_budget_s: float = Field(
        5.0,
        gt=0,
        description="longest time a filtered list page reads entries for its matches, "
        "seconds (the page says when it was cut short; its next page goes on from there)",
    )
    history_budget_s: float = Field(
        2.0,
        gt=0,
        description="longest time a message page reads the events stream for its "
        "history, seconds (the page says when the history is cut short)",
    )
    secure_cookie: bool = Field(
        False,
        description="mark the login cookie Secure even on plain HTTP (set it behind a "
        "TLS-terminating proxy); it is always Secure on HTTPS",
    )
    session_max_age_s: int = Field(
        8 * 3600, ge=60, description="lifetime of the login cookie, seconds"
    )
