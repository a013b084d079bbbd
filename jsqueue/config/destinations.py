"""The ``[destinations]`` section: per-site limits held across the whole cluster (sessions,
message and connection rates), dead-site detection (RFC 5321 §4.5.4.1) and throttle
feedback; site groups by MX host pattern; per-site overrides."""

from __future__ import annotations

import re
from typing import NamedTuple, TypeVar

from pydantic import Field, field_validator

from jsqueue.config.base import _Section
from jsqueue.errors import InvalidName

__all__ = ["SITE_PATTERN", "DestinationSettings", "Rate", "check_site", "parse_rate"]

_V = TypeVar("_V")

#: A site's name (:mod:`jsqueue.limits`): a destination domain (A-label), an address
#: literal (RFC 5321 §4.1.3, ``[192.0.2.1]``, ``[IPv6:2001:db8::1]``) or a site group's name,
#: as it appears in paths and on the command line (case-insensitive).
SITE_PATTERN = r"^(?:[A-Za-z0-9_.-]{1,253}|\[(?:[0-9.]{7,15}|[Ii][Pp][Vv]6:[0-9A-Fa-f:.]{2,45})\])$"
_SITE_RE = re.compile(SITE_PATTERN)


def check_site(site: str) -> str:
    """Return the site name in the lower-case form sites are kept under. Pure.

    Raises:
        InvalidName: empty, longer than 253, or a character other than letters, digits,
            ``.``, ``-`` and ``_`` outside an address literal (a wildcard such as ``*``
            names no site).
    """
    if not isinstance(site, str) or not _SITE_RE.match(site):
        raise InvalidName(
            f"invalid site {site!r}: a domain or a site group's name "
            "(letters, digits, '.', '-', '_')"
        )
    return site.lower()  # as routing domains are, address literals included


_RATE_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*(s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


class Rate(NamedTuple):
    """A rate limit: ``events`` per ``interval_s`` seconds."""

    events: int
    interval_s: float


def parse_rate(text: str) -> Rate:
    """``"100/m"``, ``"5/s"``, ``"1000/h"`` or ``"30/10s"`` as a :class:`Rate`. Pure.

    Raises:
        ValueError: not of that form, or a zero count or interval.
    """
    m = _RATE_RE.match(text)
    if m is None:
        raise ValueError(f"not a rate like 100/m, 5/s, 30/10s: {text!r}")
    count, mult = int(m.group(1)), int(m.group(2) or 1)
    if count < 1 or mult < 1:
        raise ValueError(f"a rate needs a count and an interval of at least 1: {text!r}")
    return Rate(count, mult * _UNIT_S[m.group(3)])


def _rate_or_none(value: object) -> object:
    """``off``, ``none`` or empty as unset; any other text checked as a rate.

    Raises:
        ValueError: not a rate.
    """
    if isinstance(value, str) and value.strip().lower() in ("", "off", "none"):
        return None
    if isinstance(value, str):
        parse_rate(value)
    return value


class DestinationSettings(_Section):
    """Destination limits, shared by every worker through JetStream (a site is a destination
    domain, or a group of domains by MX host name)."""

    enabled: bool = Field(True, description="apply the cluster-wide destination limits")
    sessions: int = Field(20, ge=1, description="SMTP sessions per site across the cluster")
    site_sessions: dict[str, int] = Field(
        default_factory=dict, description="per-site session limits (site -> sessions)"
    )
    message_rate: str | None = Field(
        None, description="messages per interval per site (100/m, 5/s, 30/10s); off when unset"
    )
    site_message_rates: dict[str, str] = Field(
        default_factory=dict, description="per-site message rates (site -> rate)"
    )
    connection_rate: str | None = Field(
        None, description="new SMTP sessions per interval per site; off when unset"
    )
    site_connection_rates: dict[str, str] = Field(
        default_factory=dict, description="per-site connection rates (site -> rate)"
    )
    rate_burst: int = Field(1, ge=1, description="events a rate limit lets through back to back")
    groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="sites by MX host pattern (site -> patterns such as *.google.com)",
    )
    dead_after: int = Field(
        5, ge=1, description="consecutive connection failures that mark a site down"
    )
    cool_off_s: float = Field(300.0, gt=0, description="how long a dead site stays down, seconds")
    probe_ttl_s: float = Field(
        120.0, gt=0, description="longest a probe of a dead site blocks other probes, seconds"
    )
    throttle_hold_s: float = Field(
        120.0, gt=0, description="seconds a throttle reply halves the site's sessions"
    )
    throttle_grow_s: float = Field(
        10.0, gt=0, description="then one more session allowed every this many seconds"
    )
    slot_ttl_s: float = Field(
        10.0, ge=2, description="a crashed worker's session slots free after this, seconds"
    )
    slot_wait_s: float = Field(
        1.0, ge=0, description="longest wait for a session slot before the item is put back"
    )
    full_delay_s: float = Field(
        30.0,
        gt=0,
        description="longest put-back of an item whose site is at its limit (paced by the "
        "site's session turnover up to this), seconds",
    )
    state_refresh_s: float = Field(
        1.0, gt=0, description="how old a worker's copy of a site's state may be, seconds"
    )
    metrics_sites: int = Field(
        20, ge=1, description="sites named in metric labels (the rest are 'other')"
    )

    @field_validator("message_rate", "connection_rate", mode="before")
    @classmethod
    def _rate(cls, value: object) -> object:
        """Check a rate (``off`` / ``none`` / empty is unset).

        Raises:
            ValueError: not a rate.
        """
        return _rate_or_none(value)

    @field_validator("site_message_rates", "site_connection_rates")
    @classmethod
    def _rates(cls, value: dict[str, str]) -> dict[str, str]:
        """Check every per-site rate.

        Raises:
            ValueError: a value is not a rate.
        """
        for text in value.values():
            parse_rate(text)
        return value

    @field_validator("site_sessions")
    @classmethod
    def _sessions(cls, value: dict[str, int]) -> dict[str, int]:
        """Check every per-site session limit.

        Raises:
            ValueError: a limit below 1.
        """
        for site, n in value.items():
            if n < 1:
                raise ValueError(f"site {site}: sessions must be at least 1")
        return value

    @field_validator(
        "site_sessions", "site_message_rates", "site_connection_rates", "groups", mode="after"
    )
    @classmethod
    def _site_names(cls, value: dict[str, _V]) -> dict[str, _V]:
        """Key every per-site setting and group by its site's name in lower case, the form
        sites are kept and looked up under (``dest show`` and the HTTP API take any case).

        Raises:
            ValueError: a key that names no site (:func:`jsqueue.names.check_site`), or two
                keys that differ only in case.
        """
        names = {check_site(site): v for site, v in value.items()}
        if len(names) != len(value):
            raise ValueError("two sites differ only in case")
        return names

    def sessions_of(self, site: str) -> int:
        """The session limit of ``site``."""
        return self.site_sessions.get(site, self.sessions)

    def message_rate_of(self, site: str) -> Rate | None:
        """The message rate limit of ``site``; None = unlimited."""
        return _rate_of(self.site_message_rates, self.message_rate, site)

    def connection_rate_of(self, site: str) -> Rate | None:
        """The connection rate limit of ``site``; None = unlimited."""
        return _rate_of(self.site_connection_rates, self.connection_rate, site)


def _rate_of(per_site: dict[str, str], default: str | None, site: str) -> Rate | None:
    """``site``'s own rate, else ``default``, parsed (checked when the settings loaded)."""
    text = per_site.get(site, default)
    return None if text is None else parse_rate(text)
