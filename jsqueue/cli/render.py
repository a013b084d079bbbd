"""Text renderers of the CLI: the ``mailq``-style listing, ``queue show``, ``queue stats``,
action results and event lines, each from the models the queue operations return
(:mod:`jsqueue.views`, :class:`jsqueue.events.Event`). Pure: models in, lines of text out;
times are printed as ``YYYY-MM-DD HH:MM:SS`` UTC, sizes in octets. Every line is safe for a
terminal: much of what is shown came from remote clients and servers (the EHLO name, reply
texts, addresses), so control characters are shown escaped, never written raw
(:func:`terminal_safe`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from jsqueue.envelope import EntryState
from jsqueue.events import Event, EventKind
from jsqueue.views import ActionResult, BulkResult, EntryDetail, EntrySummary, QueueStats

#: C0 controls (tab aside), DEL, C1 controls and lone surrogates (undecodable octets).
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on (ESC sequences, CR, BEL, C1
    controls) or cannot print (a lone surrogate) as a visible escape (``\\x1b``,
    ``\\udcff``): a remote party cannot set a title, move the cursor or write a clipboard
    through ``queue show``. Pure."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


#: What JSON leaves raw in a string and a terminal acts on: DEL and the C1 controls.
_JSON_UNSAFE = re.compile("[\x7f-\x9f]")


def json_safe(text: str) -> str:
    """A JSON document with DEL and the C1 controls in its strings written as ``\\u00XX``
    (the same JSON; JSON escapes the C0 controls itself), for printing on a terminal. Pure."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _safe(lines: list[str]) -> list[str]:
    return [terminal_safe(line) for line in lines]


def _ts(value: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` of an aware UTC time; ``-`` for None."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def human_age(seconds: float) -> str:
    """An age for people: its two largest units, e.g. ``93784`` → ``1d 2h``, ``125`` →
    ``2m 5s``, anything below one second (or negative) → ``0s``.

    Args:
        seconds: the age, seconds.
    """
    s = int(max(0.0, seconds))
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n]
    return " ".join(shown[:2]) or "0s"


_MARK = {EntryState.HELD: "!", EntryState.ACTIVE: "*"}
#: The header line of ``queue ls``, as ``mailq`` prints it.
LS_HEADER = f"{'-Queue ID-':<27} {'--Size--':>8} {'--Arrival (UTC)--':<19}  -Sender/Recipient-"


def render_entry_lines(e: EntrySummary) -> list[str]:
    """``mailq``-style lines of one entry: id (``!`` held, ``*`` active), size in octets,
    arrival (UTC), sender; then per recipient its state, attempts, next attempt and last
    reply (on a line of its own).

    Returns:
        the lines, without line ends.
    """
    sender = e.reverse_path or "<>"
    lines = [f"{e.id}{_MARK.get(e.state, ' ')} {e.size:>8} {_ts(e.created_at):<19}  {sender}"]
    for r in e.recipients:
        info = f"{r.state.value}"
        if r.attempts:
            info += f", {r.attempts} attempt{'s' if r.attempts != 1 else ''}"
        if r.next_attempt_at and not r.state.is_final:
            info += f", next {_ts(r.next_attempt_at)}"
        lines.append(f"{'':>58}  {r.address}  [{info}]")
        if r.last_reply is not None:
            lines.append(f"{'':>60}({r.last_reply})")
    return _safe(lines)


def render_detail(d: EntryDetail) -> list[str]:
    """``queue show`` lines: envelope fields, leases, the last error, then every recipient
    with its ORCPT, attempt times and last reply (and the host that sent it).

    Returns:
        the lines, without line ends.
    """
    lines = [
        f"id:           {d.id}",
        f"state:        {d.state.value}{' (held)' if d.held else ''}",
        f"arrival:      {_ts(d.created_at)} UTC",
        f"sender:       <{d.reverse_path}>",
        f"size:         {d.size} octets, sha256 {d.digest or '-'}, "
        + ("inline in the entry" if d.body_inline else "in the object store"),
        f"client:       {d.client_address or '-'} (helo {d.helo or '-'})",
        f"envid/ret:    {d.envid or '-'} / {d.ret or '-'}",
        f"smtputf8:     {d.smtputf8}, 8bit body: {d.body_8bit}, dsn: {d.is_dsn}",
        f"generation:   {d.generation} (revision {d.revision})",
    ]
    for domain, lease in d.leases.items():
        lines.append(f"lease:        {domain} by {lease.owner} until {_ts(lease.until)} UTC")
    if d.last_error:
        lines.append(f"last error:   {d.last_error}")
    if d.dkim:
        lines.append(f"dkim:         {d.dkim}")
    lines.append("recipients:")
    for r in d.recipients:
        lines.append(f"  <{r.address}>  {r.state.value}, {r.attempts} attempt(s)")
        if r.orcpt:
            lines.append(f"      orcpt:   {r.orcpt}")
        lines.append(f"      last:    {_ts(r.last_attempt_at)}  next: {_ts(r.next_attempt_at)}")
        if r.last_reply is not None:
            host = r.last_reply.remote_host or "local"
            lines.append(f"      reply:   {r.last_reply} (from {host})")
            if r.last_reply.tls is not None:
                lines.append(f"      tls:     {r.last_reply.tls}")
    return _safe(lines)


def render_stats(s: QueueStats, top: int = 20) -> list[str]:
    """``queue stats`` lines: entries by state, kept records, the oldest entry, the backlog
    and the ``top`` destination domains by open recipients.

    Args:
        s: the statistics.
        top: destination domains shown at most; the rest are counted on one line.

    Returns:
        the lines, without line ends.
    """
    lines = [f"entries:      {s.entries}"]
    for st in EntryState:
        if s.by_state.get(st):
            lines.append(f"  {st.value:<10}  {s.by_state[st]}")
    if s.kept:
        lines.append(
            f"kept:         {s.kept} final records (DSN bookkeeping), not queued "
            "(queue ls --state done)"
        )
    if s.oldest_id is not None and s.oldest_age_s is not None:
        lines.append(f"oldest:       {s.oldest_id} ({human_age(s.oldest_age_s)} old)")
    lines.append(f"backlog:      {'unknown' if s.backlog is None else s.backlog} work items")
    if s.by_domain:
        lines.append("destinations (open recipients / deferred / entries):")
        for domain, d in list(s.by_domain.items())[:top]:
            lines.append(f"  {domain:<40} {d.recipients:>7} {d.deferred:>7} {d.entries:>7}")
        if len(s.by_domain) > top:
            lines.append(f"  ... {len(s.by_domain) - top} more")
    lines.append(f"(scanned in {s.took_s:.2f} s)")
    return _safe(lines)


def render_result(r: ActionResult) -> str:
    """One action result as ``<queue id>: <action> <outcome>[: <detail>]``."""
    detail = f": {r.detail}" if r.detail else ""
    return terminal_safe(f"{r.queue_id}: {r.action.value} {r.outcome.value}{detail}")


def render_counts(b: BulkResult) -> str:
    """The summary line of a bulk action: matched entries and the count per outcome."""
    counts = ", ".join(f"{n} {o.value}" for o, n in sorted(b.counts.items()))
    return f"{b.action.value}: {b.matched} matched; {counts or 'nothing done'}"


def summaries_total(entries: Iterable[EntrySummary]) -> tuple[int, int]:
    """``(entries, octets)`` of a listing, for the ``mailq`` closing line."""
    n = size = 0
    for e in entries:
        n += 1
        size += e.size
    return n, size


def render_event(e: Event) -> str:
    """One event as one line: time (UTC), kind, queue id and what is known (recipient or
    envelope, reply, next attempt, detail, who acted)."""
    parts = [_ts(e.at), f"{e.kind.value:<9}", e.queue_id]
    if e.recipient is not None:
        parts.append(f"to=<{e.recipient}>")
    elif e.recipients is not None and e.kind is EventKind.RECEIVED:
        parts.append(f"from=<{e.reverse_path or ''}> to={','.join(e.recipients)} size={e.size}")
    if e.reply is not None:
        parts.append(f"({e.reply})")
    if e.next_attempt_at is not None:
        parts.append(f"next={_ts(e.next_attempt_at)}")
    if e.detail:
        parts.append(e.detail)
    if e.source:
        parts.append(f"by {e.source}")
    return terminal_safe(" ".join(parts))
