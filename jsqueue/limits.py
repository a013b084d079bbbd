"""Destination limits as pure arithmetic: which *site* a destination domain belongs to, the
GCRA rate limit on a theoretical arrival time, the concurrency a site is allowed right now
(throttle feedback), consecutive connection failures and the dead-site cool-off (RFC 5321
§4.5.4.1), and which replies are throttling. No I/O, no clock: every function takes ``now_s``
(Unix seconds, float). :mod:`jsqueue.destinations` keeps the state in JetStream and calls these.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from jsqueue.replies import Reply

__all__ = [
    "GcraStep",
    "SiteSnapshot",
    "SiteState",
    "SiteStatus",
    "after_failure",
    "after_success",
    "after_throttle",
    "allowed_sessions",
    "competing",
    "fair_share",
    "full_put_back",
    "gcra",
    "is_connection_failure",
    "is_throttle",
    "per_site_cap",
    "site_for",
    "status",
    "throttle_worn_off",
    "want",
]

#: Words in the text of a 4yz reply that say the receiver throttles us (RFC 5321 §4.2 leaves
#: the text free; these are what large receivers write: "rate limited", "too many
#: connections", "try again later" after a 421, "throttl...").
_THROTTLE_RE = re.compile(
    r"rate.?limit|too many (connections|sessions|messages|concurrent)|throttl|"
    r"slow down|temporarily deferred due to|exceeded.*(rate|limit)",
    re.IGNORECASE,
)


def site_for(domain: str, mx_hosts: Iterable[str], groups: Mapping[str, Sequence[str]]) -> str:
    """The site a destination domain's mail counts against.

    A site is the destination domain by default; ``groups`` maps a site name to host name
    patterns (``fnmatch`` style, e.g. ``*.google.com``): a domain whose MX host names (or the
    domain itself) match one pattern of a group belongs to that group's site, as KumoMTA's
    site names group domains that share MX hosts. Groups are tried in their mapping order,
    MX hosts in the order given (RFC 5321 §5.1 preference order). Pure.

    Args:
        domain: the destination domain (A-label, lower case).
        mx_hosts: its MX host names (trailing dots allowed; case ignored); empty when not
            looked up (then only the domain itself is matched).
        groups: site name -> patterns.

    Returns:
        the group's site name, else ``domain``.
    """
    names = [domain.lower().rstrip(".")] + [h.lower().rstrip(".") for h in mx_hosts]
    for site, patterns in groups.items():
        for pattern in patterns:
            pat = pattern.lower().rstrip(".")
            if any(fnmatch.fnmatchcase(name, pat) for name in names):
                return site
    return domain.lower()


# --------------------------------------------------------------------------- GCRA


@dataclass(frozen=True, slots=True)
class GcraStep:
    """One decision of :func:`gcra`.

    Attributes:
        allowed: the event (a message, a connection) may happen now.
        tat_s: the theoretical arrival time to store when allowed (Unix seconds); the
            unchanged one when refused.
        wait_s: when refused, seconds until the event would be allowed; 0 when allowed.
    """

    allowed: bool
    tat_s: float
    wait_s: float


def gcra(
    tat_s: float | None, now_s: float, per_interval: int, interval_s: float, burst: int = 1
) -> GcraStep:
    """The generic cell rate algorithm (a token bucket kept as one number, the theoretical
    arrival time TAT): at most ``per_interval`` events per ``interval_s`` seconds, ``burst``
    of them back to back. The emission interval is ``T = interval_s / per_interval``; an
    event at ``now`` is allowed when ``max(TAT, now) - now <= T * (burst - 1)``, and then
    TAT becomes ``max(TAT, now) + T``. Over any window of ``w`` seconds at most
    ``w / T + burst`` events pass. Pure; the caller stores ``tat_s`` by compare-and-set.

    Args:
        tat_s: the stored TAT (Unix seconds), None when never used (or expired).
        now_s: the current time, Unix seconds.
        per_interval: events allowed per interval (>= 1).
        interval_s: the interval, seconds (> 0).
        burst: events allowed back to back (>= 1).

    Returns:
        the decision and the TAT to store.

    Raises:
        ValueError: ``per_interval`` or ``burst`` below 1, or ``interval_s`` not positive.
    """
    if per_interval < 1 or burst < 1 or interval_s <= 0:
        raise ValueError("gcra: per_interval and burst must be >= 1, interval_s > 0")
    emission = interval_s / per_interval
    tolerance = emission * (burst - 1)
    tat = now_s if tat_s is None else max(tat_s, now_s)
    ahead = tat - now_s
    if ahead > tolerance + 1e-9:
        return GcraStep(False, tat, ahead - tolerance)
    return GcraStep(True, tat + emission, 0.0)


# --------------------------------------------------------------------------- site state


class SiteStatus(StrEnum):
    """Whether mail goes to a site: ``up``; ``down`` (dead site, deferred without connecting
    until the cool-off ends, RFC 5321 §4.5.4.1); ``probe`` (the cool-off ended: one session
    at a time tries it again)."""

    UP = "up"
    DOWN = "down"
    PROBE = "probe"


@dataclass(frozen=True, slots=True)
class SiteState:
    """What the cluster shares about one site besides its slots and rate buckets.

    Attributes:
        failures: consecutive connection-level failures (no address answered, TLS or the
            greeting failed); reset by any session that gets an answer.
        down_until: end of the dead-site cool-off, Unix seconds; None when never down.
        throttle_limit: sessions allowed while throttled (the concurrency after a 421 or a
            throttling 4yz reply); None when not throttled.
        throttled_until: Unix seconds at which the throttle starts to wear off.
        demand: workers that found every slot they could take taken and still have mail
            for the site, as (owner, Unix seconds until which the demand stands), sorted
            by owner (:func:`want`); the holders of the slots give up those over their
            fair share (:func:`fair_share`).
    """

    failures: int = 0
    down_until: float | None = None
    throttle_limit: int | None = None
    throttled_until: float | None = None
    demand: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict[str, float | int | dict[str, float] | None]:
        """A JSON-ready dict (the KV value)."""
        return {
            "failures": self.failures,
            "down_until": self.down_until,
            "throttle_limit": self.throttle_limit,
            "throttled_until": self.throttled_until,
            "demand": dict(self.demand),
        }

    @classmethod
    def from_json(cls, value: object) -> SiteState:
        """Read :meth:`to_json`'s form; anything unreadable is the empty state (a site
        that is up). Pure."""
        if not isinstance(value, dict):
            return cls()

        def num(key: str) -> float | None:
            v = value.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        failures = num("failures")
        limit = num("throttle_limit")
        raw = value.get("demand")
        demand = sorted(
            (str(owner), float(until))
            for owner, until in (raw.items() if isinstance(raw, dict) else ())
            if isinstance(until, int | float) and not isinstance(until, bool)
        )
        return cls(
            failures=int(failures or 0),
            down_until=num("down_until"),
            throttle_limit=None if limit is None else max(1, int(limit)),
            throttled_until=num("throttled_until"),
            demand=tuple(demand),
        )

    @property
    def is_clear(self) -> bool:
        """No failure counted, no throttle and no demand: the state need not be stored."""
        return (
            self.failures == 0
            and self.down_until is None
            and self.throttle_limit is None
            and not self.demand
        )


def status(state: SiteState, now_s: float) -> SiteStatus:
    """The site's status at ``now_s``: down while the cool-off runs, probe once it ran out
    (until a session gets an answer), else up. A cool-off is set only when the failures
    reached the ``dead_after`` of the worker that counted them (:func:`after_failure`), so
    a reader with another ``dead_after`` (``dest ls`` run without the service's settings)
    sees the same. Pure."""
    if state.down_until is not None:
        return SiteStatus.DOWN if now_s < state.down_until else SiteStatus.PROBE
    return SiteStatus.UP


def after_failure(state: SiteState, now_s: float, threshold: int, cool_off_s: float) -> SiteState:
    """One more consecutive connection-level failure; at ``threshold`` failures (and at
    every failed probe after that) the site is down for ``cool_off_s`` seconds from
    ``now_s`` (RFC 5321 §4.5.4.1: a client keeps "a list of hosts it cannot reach" and
    does not try them for a while). Pure."""
    failures = state.failures + 1
    down_until = now_s + cool_off_s if failures >= threshold else state.down_until
    return replace(state, failures=failures, down_until=down_until)


def after_success(state: SiteState) -> SiteState:
    """A session got an answer: the failure count and the cool-off are cleared (the site is
    up again); a throttle stays until it wears off. Pure."""
    return replace(state, failures=0, down_until=None)


def per_site_cap(concurrency: int) -> int:
    """Deliveries of one site a worker of ``concurrency`` keeps under way or waiting for a
    session unit at most: three quarters, so that a quarter (at least one) is always free
    for other sites' mail, however long a full or slow site's backlog (Postfix keeps its
    process limit, 100, above a destination's, 20, for the same reason). Pure."""
    return max(1, concurrency - max(1, concurrency // 4))


#: Seconds after a halving in which further throttle replies belong to the same burst.
THROTTLE_BURST_S = 1.0


def after_throttle(state: SiteState, now_s: float, current: int, hold_s: float) -> SiteState:
    """A throttle reply (:func:`is_throttle`): halve the sessions allowed (at least 1) and
    hold that for ``hold_s`` seconds (RFC 5321 §4.5.3.2 and §4.2: a 421 closes the
    session; the client should not answer it by opening another at once). ``current`` is
    the concurrency allowed before the reply, by ``state``. The replies of one burst
    (within :data:`THROTTLE_BURST_S` of the last halving: sessions opened together get
    their 421 together) halve once, as TCP halves once per window; ``state`` is then
    returned unchanged. Pure."""
    last = None if state.throttled_until is None else state.throttled_until - hold_s
    if state.throttle_limit is not None and last is not None and now_s - last < THROTTLE_BURST_S:
        return state
    return replace(state, throttle_limit=max(1, current // 2), throttled_until=now_s + hold_s)


def allowed_sessions(state: SiteState, limit: int, now_s: float, grow_s: float) -> int:
    """Sessions a site may have open across the cluster at ``now_s``.

    The configured ``limit``; while throttled, the throttle's limit, which grows back by
    one session every ``grow_s`` seconds once ``throttled_until`` passed (additive
    increase after a multiplicative decrease, Postfix's concurrency feedback in shape);
    one session while connection failures are being counted or a probe runs, so that a
    dying site gets one connection at a time, not ``limit``. Pure.

    Returns:
        an int in ``[1, limit]``.
    """
    allowed = limit
    if state.throttle_limit is not None:
        grown = state.throttle_limit
        if state.throttled_until is not None and now_s > state.throttled_until:
            grown += int((now_s - state.throttled_until) // max(grow_s, 1e-3)) + 1
        allowed = min(allowed, grown)
    if state.failures > 0:
        allowed = 1
    return max(1, min(allowed, limit))


def throttle_worn_off(state: SiteState, limit: int, now_s: float, grow_s: float) -> bool:
    """Whether a throttle has grown back to ``limit`` (it may be forgotten). Pure."""
    if state.throttle_limit is None:
        return False
    return allowed_sessions(replace(state, failures=0), limit, now_s, grow_s) >= limit


def want(state: SiteState, owner: str, now_s: float, ttl_s: float) -> SiteState:
    """``owner`` has mail for the site and found no slot it could take: its demand stands
    until ``now_s + ttl_s``; demands that ran out are dropped. ``state`` itself (nothing to
    write) while the owner's demand still stands for more than half of ``ttl_s``, so that a
    worker refused again and again writes at most once per ``ttl_s / 2``. Pure."""
    live = {o: u for o, u in state.demand if u > now_s}
    if live.get(owner, now_s) - now_s > ttl_s / 2:
        return state
    live[owner] = now_s + ttl_s
    return replace(state, demand=tuple(sorted(live.items())))


def competing(state: SiteState, owner: str, now_s: float) -> int:
    """Workers sharing the site's slots as ``owner`` sees it at ``now_s``: itself and every
    other worker whose demand (:func:`want`) still stands. Pure."""
    return 1 + sum(1 for o, until in state.demand if o != owner and until > now_s)


def fair_share(allowed: int, state: SiteState, owner: str, now_s: float) -> int:
    """The session slots ``owner`` may keep while others want the site: ``allowed`` split
    evenly between the competing workers (:func:`competing`), rounded up, at least 1;
    ``allowed`` itself when nobody else wants the site. A worker that holds more gives the
    rest up as its sessions end, so that several workers with mail for one site share
    its sessions instead of one holding them while the others put their mail back.
    Pure."""
    return max(1, math.ceil(allowed / competing(state, owner, now_s)))


def full_put_back(
    now_s: float, paced_until: float, ahead: int, hold_s: float, units: int, longest_s: float
) -> float:
    """When to offer again an item put back because its site is full here: paced at the rate
    the site's session units turn over, one item per ``hold_s / units`` seconds,
    after the ``ahead`` deliveries waiting for a unit here and after the item put back
    before it (``paced_until``), and at most ``longest_s`` from now. An item is offered
    again about when a unit could take it, neither at once (each offer costs a fetch and a
    put-back, and a backlog of a slow site would be offered many times a second) nor after
    a fixed delay much longer than the site takes to drain (the last of a burst would wait
    for it). Pure.

    Args:
        now_s: now, seconds (any clock; ``paced_until`` uses the same one).
        paced_until: the time returned for the item put back before, or anything up to
            ``now_s`` for none.
        ahead: deliveries of the site waiting for a unit in this worker.
        hold_s: how long a delivery holds its unit, seconds (> 0).
        units: the sessions the site allows now (at least 1 is assumed); the whole site's,
            not this worker's: with N workers an item may be offered up to N times, but
            no worker paces a burst over more than the time the site needs to drain it.
        longest_s: the longest put-back, seconds (``destinations.full_delay_s``).

    Returns:
        the time to offer the item again, in ``(now_s, now_s + longest_s]``; it is also
        the ``paced_until`` of the next one.
    """
    step = hold_s / max(1, units)
    at = max(now_s + ahead * step, paced_until) + step
    return min(at, now_s + longest_s)


@dataclass(frozen=True, slots=True)
class SiteSnapshot:
    """What one worker knows of a site right now, for its metrics (the cluster-wide view is
    :mod:`jsqueue.destinations_admin`'s, read from the bucket).

    Attributes:
        site: the site.
        slots: session slots this worker holds.
        active: deliveries under way.
        limit: the configured session limit.
        allowed: sessions allowed now.
        status: up, down or probe.
        deferred: items put back since start, by reason (full, rate, down, probing).
    """

    site: str
    slots: int
    active: int
    limit: int
    allowed: int
    status: SiteStatus
    deferred: dict[str, int]


# --------------------------------------------------------------------------- replies


def is_throttle(reply: Reply) -> bool:
    """Whether ``reply`` says the receiver throttles us: any 421 (RFC 5321 §4.2.2, §3.8:
    "service not available, closing transmission channel", what receivers send when there
    are too many sessions) that came from the remote, or a 4yz whose text names rate
    limiting or too many connections. Replies jsqueue synthesised itself (no
    ``remote_host``) never are. Pure."""
    if reply.remote_host is None or not reply.is_temporary:
        return False
    return reply.code == 421 or bool(_THROTTLE_RE.search(reply.text))


def is_connection_failure(replies: Iterable[Reply], reached: bool, tried: bool) -> bool:
    """Whether an attempt failed at the connection level (RFC 5321 §4.5.4.1: the site
    could not be reached): a connection was tried (``tried``), no server answered as far
    as MAIL (``not reached``: no address accepted a connection, TLS broke, the greeting
    never came), and every reply is temporary and this queue's own (no ``remote_host``).
    A server's reply, even at the greeting, is the site's answer, not an outage: a 421
    (too many connections) throttles the site (:func:`is_throttle`), a 554 refusal is
    retried on its schedule. Pure."""
    replies = list(replies)
    return (
        tried
        and not reached
        and bool(replies)
        and all(r.is_temporary and r.remote_host is None for r in replies)
    )
