"""The checker of the fault soak (``bench/nemesis.py``): what the clients, the sink MX, the
nemesis and the workers' logs saw, turned into figures. Pure: no process, no network.

Inputs, all times :func:`time.monotonic` of the soak's process unless named ``wall``:

* the clients' :class:`~support.cluster.Load` per front end (every try of every message,
  its reply code and the 250's queue id);
* the sink's :class:`~support.cluster.CountingMx` (arrival time and sending worker of every
  copy, by its EHLO name);
* the nemesis's journal (:class:`Fault`) and the processes that exited by themselves
  (:class:`Death`);
* the workers' JSON log lines (:func:`read_log`).

A duplicate is *explained* when an earlier copy's worker could not record it: that worker
was stopped by the nemesis (SIGKILL, or SIGTERM beyond its drain) within
:data:`RECORD_WINDOW_S` after the copy arrived and had not logged the delivery by then
(RFC 5321 §6.1: the 250 came, the record did not), or the worker logged that the attempt
could not be recorded, or that the MX's reply to the final dot never came
(``uncertain``).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jsqueue.nats_cluster import SERVER_NAME_PREFIX
from support.cluster import CountingMx, Load

#: How long after a copy's arrival a worker stop can still be what kept it from being
#: recorded, seconds (a record retries through a NATS election of up to ~10 s).
RECORD_WINDOW_S = 30.0
#: Wall clock against monotonic clock: a log line may be stamped this much earlier, seconds.
CLOCK_SLACK_S = 0.5
#: The sink stamps a copy when its event loop gets to it, which on a loaded box can be
#: seconds after the worker wrote the final dot: a worker killed up to this long before a
#: copy's stamp may still have sent it, seconds.
SINK_LAG_S = 5.0
#: Fault kinds that stop a worker (its unrecorded deliveries are sent again).
WORKER_STOPS = ("worker-kill", "worker-term")
#: A worker's message: an attempt's outcome was not written to the queue.
_UNRECORDED = re.compile(r"attempt not recorded")
#: A worker's message: a work item was left unsettled for a store error (it comes back).
_UNAVAILABLE = re.compile(r"store unavailable")
#: A deferral caused by the queue's own store, not by the MX (the sink always says 250).
_STORE_TROUBLE = re.compile(r"4\.3\.0|not found|unavailable", re.IGNORECASE)


@dataclass
class Fault:
    """One fault of the nemesis: what was hit and when it was back (None: never)."""

    kind: str
    target: str
    at: float
    wall: float
    back_at: float | None = None
    detail: str = ""


@dataclass
class Death:
    """A process that exited while nobody had stopped it, or did not start again."""

    name: str
    at: float
    returncode: int | None
    tail: str


@dataclass
class LogLine:
    """One JSON log line of a worker: wall time (POSIX seconds) and its fields."""

    worker: str
    wall: float
    fields: dict[str, Any]


def read_log(worker: str, path: Path) -> list[LogLine]:
    """The JSON lines of a worker's log (other lines, such as tracebacks, are skipped)."""
    lines: list[LogLine] = []
    if not path.exists():
        return lines
    for text in path.read_text(errors="replace").splitlines():
        if not text.startswith("{"):
            continue
        try:
            fields = json.loads(text)
            wall = datetime.fromisoformat(fields["time"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        lines.append(LogLine(worker, wall, fields))
    return lines


@dataclass
class Summary:
    """The soak's figures (also the JSON summary file)."""

    seed: int
    duration_s: float
    rate_per_s: float
    shortened: dict[str, str]
    faults: list[dict[str, Any]] = field(default_factory=list)
    fault_counts: dict[str, int] = field(default_factory=dict)
    accepted: int = 0
    given_up: int = 0
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    duplicates: int = 0
    duplicates_explained: dict[str, int] = field(default_factory=dict)
    duplicates_unexplained: list[str] = field(default_factory=list)
    refusals: int = 0
    refusals_with_quorum: int = 0
    refusals_by_frontend: dict[str, int] = field(default_factory=dict)
    refusal_codes: dict[str, int] = field(default_factory=dict)
    refusal_times: list[tuple[float, str, int]] = field(default_factory=list)
    connections_lost: int = 0
    longest_refusal_window_s: float = 0.0
    longest_refusal_window_at: str = ""
    deferrals: int = 0
    store_trouble_deferrals: int = 0
    store_trouble_examples: list[str] = field(default_factory=list)
    unrecorded_lines: int = 0
    store_unavailable_lines: int = 0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    age_at_delivery_p50_s: float | None = None
    age_at_delivery_p99_s: float | None = None
    drain_s: float | None = None
    self_deaths: list[dict[str, Any]] = field(default_factory=list)

    def failures(self, strict: bool) -> list[str]:
        """Why the soak failed (empty: it passed); ``strict`` adds the refusal and
        store-trouble targets."""
        why = []
        if self.lost:
            why.append(f"{self.lost} acknowledged messages never delivered")
        if self.self_deaths:
            why.append(f"{len(self.self_deaths)} processes died by themselves")
        if self.duplicates_unexplained:
            why.append(f"{len(self.duplicates_unexplained)} duplicates unexplained")
        if strict and self.refusals_with_quorum:
            why.append(f"{self.refusals_with_quorum} refusals while a quorum stood")
        if strict and self.store_trouble_deferrals:
            why.append(f"{self.store_trouble_deferrals} deferrals for the queue's own store")
        return why

    def lines(self) -> list[str]:
        """The figures, one line each."""
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.fault_counts.items()))
        explained = sum(self.duplicates_explained.values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.duplicates_explained.items()))
        by_fe = ", ".join(f"{k} {v}" for k, v in sorted(self.refusals_by_frontend.items()))
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.refusal_codes.items()))
        return [
            f"seed: {self.seed}",
            f"faults: {len(self.faults)} in {self.duration_s:g} s ({counts})",
            f"acknowledged (250): {self.accepted}; given up by the clients: {self.given_up}",
            f"lost (250, never delivered): {self.lost}",
            f"duplicates at the sink: {self.duplicates} (explained {explained}: {why or '-'}; "
            f"unexplained {len(self.duplicates_unexplained)})",
            f"refusals (4xx/5xx): {self.refusals} ({by_fe or '-'}; codes {codes or '-'}); "
            f"while a quorum stood: {self.refusals_with_quorum}",
            f"longest refusal window: {self.longest_refusal_window_s:.1f} s "
            f"({self.longest_refusal_window_at or '-'})",
            f"connections lost mid-transaction: {self.connections_lost}",
            f"store-trouble deferrals: {self.store_trouble_deferrals} of {self.deferrals} "
            f"deferrals; logged 'attempt not recorded' {self.unrecorded_lines}, "
            f"'store unavailable' {self.store_unavailable_lines}",
            f"250 -> delivered latency: p50 {_s(self.latency_p50_s)}, "
            f"p99 {_s(self.latency_p99_s)}, max {_s(self.latency_max_s)}; as the workers "
            f"logged it: p50 {_s(self.age_at_delivery_p50_s)}, "
            f"p99 {_s(self.age_at_delivery_p99_s)}",
            f"drain after the faults: {_s(self.drain_s)}",
            f"processes dead by themselves: {len(self.self_deaths)}",
        ]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# --------------------------------------------------------------------------- clients


def check_clients(summary: Summary, loads: dict[str, Load], t0: float) -> None:
    """Acknowledged, given up, refusals (count, per front end, per code, when), lost
    connections and the longest time one message was refused before its 250."""
    for fe, load in loads.items():
        accepted = load.accepted()
        summary.accepted += len(accepted)
        summary.given_up += len({a.index for a in load.attempts} - set(accepted))
        for a in load.attempts:
            if a.code is None:
                summary.connections_lost += 1
            elif a.code != 250:
                summary.refusals += 1
                summary.refusals_by_frontend[fe] = summary.refusals_by_frontend.get(fe, 0) + 1
                summary.refusal_codes[str(a.code)] = summary.refusal_codes.get(str(a.code), 0) + 1
                summary.refusal_times.append((round(a.started - t0, 2), fe, a.code))
        for index, window in _refusal_windows(load).items():
            if window > summary.longest_refusal_window_s:
                summary.longest_refusal_window_s = window
                summary.longest_refusal_window_at = f"{fe}, message {index}"


def count_refusals_with_quorum(
    summary: Summary, loads: dict[str, Load], faults: list[Fault], deaths: list[Death]
) -> None:
    """Refusals begun while at most one NATS node was down or paused (by the nemesis, or
    dead by itself)."""
    down = [(f.at, f.back_at or math.inf) for f in faults if f.kind.startswith("nats-")]
    down += [(d.at, math.inf) for d in deaths if d.name.startswith(SERVER_NAME_PREFIX)]
    for load in loads.values():
        for a in load.attempts:
            if a.code is not None and a.code != 250:
                nodes_out = sum(1 for start, end in down if start <= a.started <= end)
                summary.refusals_with_quorum += nodes_out <= 1


def _refusal_windows(load: Load) -> dict[int, float]:
    """Per refused message: from the start of its first refused try to the end of its
    last try (its 250, or where the client gave up), seconds."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for a in load.attempts:
        if a.code is not None and a.code != 250:
            first.setdefault(a.index, a.started)
        last[a.index] = a.ended
    return {i: last[i] - started for i, started in first.items()}


# --------------------------------------------------------------------------- sink


def check_sink(
    summary: Summary,
    loads: dict[str, Load],
    mx: CountingMx,
    recipient: Callable[[int], str],
) -> dict[str, list[tuple[float, str]]]:
    """Lost messages and the 250 -> first arrival latency; returns every copy per
    recipient as (arrival, sending client's EHLO name), in arrival order. ``recipient``
    maps a message index to its address."""
    senders = mx.client_names()
    copies: dict[str, list[tuple[float, str]]] = {}
    for at, tx in mx.accepted:
        for rcpt in tx.rcpt_to:
            copies.setdefault(rcpt.lower(), []).append((at, senders.get(id(tx), "")))
    latencies = []
    for load in loads.values():
        for index, attempt in load.accepted().items():
            rcpt = recipient(index)
            if rcpt not in copies:
                summary.lost += 1
                if len(summary.lost_examples) < 20:
                    summary.lost_examples.append(f"{rcpt} queue id {attempt.queue_id}")
                continue
            latencies.append(copies[rcpt][0][0] - attempt.ended)
    summary.latency_p50_s = percentile(latencies, 0.50)
    summary.latency_p99_s = percentile(latencies, 0.99)
    summary.latency_max_s = max(latencies, default=None)
    summary.duplicates = sum(len(c) - 1 for c in copies.values())
    return copies


# --------------------------------------------------------------------------- duplicates


def explain_duplicates(
    summary: Summary,
    copies: dict[str, list[tuple[float, str]]],
    faults: list[Fault],
    logs: list[LogLine],
    worker_of: dict[str, str],
    resent: dict[str, str],
    wall_offset_s: float,
) -> None:
    """Each copy but the last of a recipient is explained (counted by reason) or listed.
    ``worker_of`` maps an EHLO name to a worker's name; ``resent`` says why a client sent a
    recipient's message again ("lost connection", "4xx"), when it did: a message stored
    twice (two queue ids in the workers' logs) is then two messages to deliver.
    ``wall_offset_s`` turns a monotonic time into wall time (log lines)."""
    by_worker_rcpt: dict[tuple[str, str], list[LogLine]] = {}
    queue_ids: dict[str, set[str]] = {}
    for line in logs:
        rcpt = str(line.fields.get("recipient") or "").lower()
        if rcpt:
            by_worker_rcpt.setdefault((line.worker, rcpt), []).append(line)
            queue_ids.setdefault(rcpt, set()).add(str(line.fields.get("queue_id")))
    unrecorded = [line for line in logs if _failed_record(line)]
    for rcpt, seen in copies.items():
        stored_twice = len(queue_ids.get(rcpt, ())) - 1 if rcpt in resent else 0
        for at, ehlo in seen[:-1]:
            worker = worker_of.get(ehlo, ehlo)
            lines = by_worker_rcpt.get((worker, rcpt), [])
            why = _why_copy(at, at + wall_offset_s, worker, lines, faults, unrecorded)
            if why is None and stored_twice > 0:
                stored_twice -= 1
                why = f"stored twice: the client resent after a {resent[rcpt]}"
            if why is None:
                when = datetime.fromtimestamp(at + wall_offset_s, UTC).isoformat()
                summary.duplicates_unexplained.append(f"{rcpt} by {worker} at {when}")
            else:
                summary.duplicates_explained[why] = summary.duplicates_explained.get(why, 0) + 1


def resent_messages(loads: dict[str, Load], recipient: Callable[[int], str]) -> dict[str, str]:
    """Recipient -> why its message was sent again ("lost connection" or "4xx"; the
    first such try), for every message tried more than once."""
    why: dict[str, str] = {}
    for load in loads.values():
        for a in load.attempts:
            if a.code != 250:
                why.setdefault(recipient(a.index), "lost connection" if a.code is None else "4xx")
    return why


def _why_copy(
    at: float,
    wall: float,
    worker: str,
    lines: list[LogLine],
    faults: list[Fault],
    unrecorded: list[LogLine],
) -> str | None:
    """Why a copy sent by ``worker`` at ``at`` (``wall`` in wall time; the worker's log
    ``lines`` for the recipient) was sent again, or None."""
    for f in faults:
        stop = f.kind in WORKER_STOPS and f.target == worker
        if stop and -SINK_LAG_S <= f.at - at <= RECORD_WINDOW_S:
            logged = any(
                line.fields.get("outcome") == "delivered" and line.wall <= f.wall for line in lines
            )
            if not logged:
                return f"{f.kind} before its record"
    if any(line.fields.get("uncertain") for line in lines):
        return "uncertain (no reply to the dot)"
    queue_ids = {str(line.fields.get("queue_id")) for line in lines}
    for line in unrecorded:
        if line.worker != worker or line.wall < wall - CLOCK_SLACK_S:
            continue
        if any(q in line.fields.get("message", "") for q in queue_ids):
            return "record failed (logged)"
    return None


def _failed_record(line: LogLine) -> bool:
    message = line.fields.get("message", "")
    return bool(_UNRECORDED.search(message) or _UNAVAILABLE.search(message))


# --------------------------------------------------------------------------- deferrals


def check_worker_logs(summary: Summary, logs: list[LogLine]) -> None:
    """Deferrals (the sink always accepts: every one is the queue's doing), those for the
    queue's own store (4.3.0, body not found, store unavailable), the attempts the workers
    could not record, and the age of each message when a worker logged its delivery."""
    ages = [
        float(line.fields["delay_s"])
        for line in logs
        if line.fields.get("outcome") == "delivered" and "delay_s" in line.fields
    ]
    summary.age_at_delivery_p50_s = percentile(ages, 0.50)
    summary.age_at_delivery_p99_s = percentile(ages, 0.99)
    for line in logs:
        fields = line.fields
        message = fields.get("message", "")
        summary.unrecorded_lines += bool(_UNRECORDED.search(message))
        summary.store_unavailable_lines += bool(_UNAVAILABLE.search(message))
        if fields.get("outcome") != "deferred":
            continue
        summary.deferrals += 1
        reply = str(fields.get("reply") or "")
        if _STORE_TROUBLE.search(reply):
            summary.store_trouble_deferrals += 1
            if len(summary.store_trouble_examples) < 10:
                summary.store_trouble_examples.append(f"{line.worker}: {reply[:200]}")


def check_faults(summary: Summary, faults: list[Fault], deaths: list[Death], t0: float) -> None:
    """The journal and the self-deaths, times relative to the load's start."""
    summary.fault_counts = dict(Counter(f.kind for f in faults))
    for f in faults:
        row = {"time": datetime.fromtimestamp(f.wall, UTC).isoformat(), **asdict(f)}
        row["at"] = round(f.at - t0, 2)
        row["back_at"] = None if f.back_at is None else round(f.back_at - t0, 2)
        summary.faults.append(row)
    for d in deaths:
        summary.self_deaths.append({**asdict(d), "at": round(d.at - t0, 2)})
