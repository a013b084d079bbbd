"""The MAIL and RCPT commands of one outbound transaction, decided before any goes on the
wire (:func:`plan_transaction`): SMTPUTF8 use (RFC 6531 §3.2), the 8BITMIME conversion
(RFC 6152 §3), the SIZE check (RFC 1870) and the ESMTP parameters (RFC 3461, :mod:`.params`).
Both the one-command-at-a-time transaction of :mod:`.session` and the pipelined one of
:mod:`.pipelining` send exactly these commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from jsqueue.delivery.base import BodySource, DeliveryEnvelope
from jsqueue.delivery.body import BodyCache
from jsqueue.delivery.params import notify_param, orcpt_param, size_limit, smtp_path
from jsqueue.delivery.responses import with_detail
from jsqueue.delivery.transform import ConversionError
from jsqueue.envelope import Recipient, xtext_encode
from jsqueue.replies import (
    R501_BAD_FORWARD_PATH,
    R501_BAD_REVERSE_PATH,
    R554_8BIT_UNSUPPORTED,
    R554_SIZE_EXCEEDED,
    R554_SMTPUTF8_REQUIRED,
    Reply,
)

__all__ = ["Plan", "command_line", "plan_transaction"]

_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
"""Octets no command argument may hold (aiosmtplib refuses them as well: CR/LF injection)."""


def command_line(args: list[bytes]) -> bytes | None:
    """``args`` joined into one command line with its CRLF; None when an argument holds a
    control octet (it would inject a command, RFC 5321 §2.3.8). Pure."""
    if any(_CONTROL.search(a) for a in args):
        return None
    return b" ".join(args) + b"\r\n"


@dataclass
class Plan:
    """What one transaction sends.

    Attributes:
        replies: recipients settled without a command (no SMTPUTF8 at the server, 8-bit
            body that cannot be converted, SIZE exceeded, a path that cannot be encoded).
        mail: the MAIL command's arguments (``[b"MAIL", b"FROM:<...>", *params]``); None
            when nothing is to be sent (every recipient is in ``replies``).
        rcpts: ``(address, RCPT arguments)`` per recipient to offer, in order.
        body: the body to send after ``354`` (the 7-bit conversion when ``converted``).
        converted: the body was converted to 7-bit for a server without 8BITMIME.
        dsn: the server offers DSN (RFC 3461) and the parameters were added; None when the
            plan stopped before it got there.
    """

    replies: dict[str, Reply]
    mail: list[bytes] | None
    rcpts: list[tuple[str, list[bytes]]] = field(default_factory=list)
    body: BodySource | None = None
    converted: bool = False
    dsn: bool | None = None


async def plan_transaction(
    env: DeliveryEnvelope,
    recipients: list[Recipient],
    extensions: dict[str, str],
    body: BodyCache,
    host: str,
) -> Plan:
    """The commands of one transaction to ``host`` with the EHLO ``extensions``.

    Args:
        env: reverse-path and flags (SMTPUTF8, 8BITMIME, RET, ENVID).
        recipients: the recipients of this transaction, in order.
        extensions: the server's EHLO keywords, lower-cased, with their parameters.
        body: the attempt's body (scanned and converted at most once per attempt).
        host: the MX host name in reply texts.

    Returns:
        the plan; recipients that cannot be offered have their reply in ``replies``
        (``554 5.6.7`` no SMTPUTF8, ``554 5.6.3`` no 8BITMIME, ``554 5.3.4`` SIZE, ``501``
        unencodable path). Reads the body only for the header scan or the conversion.

    Raises:
        BodyNotFound: the body source has no body (passed through from ``body``).
        BodyCorrupt: the body does not match its digest (passed through).
        StoreUnavailable: the body store failed (passed through).
    """
    replies: dict[str, Reply] = {}
    server_utf8 = "smtputf8" in extensions
    needs_utf8 = (
        env.smtputf8
        or not env.reverse_path.isascii()
        or any(not r.address.isascii() for r in recipients)
    )
    use_utf8 = server_utf8 and needs_utf8

    def all_get(reply: Reply, addresses: list[str]) -> Plan:
        for a in addresses:
            replies[a] = reply
        return Plan(replies=replies, mail=None)

    utf8_reply = R554_SMTPUTF8_REQUIRED
    everyone = [r.address for r in recipients]
    reverse = smtp_path(env.reverse_path, use_utf8)
    if reverse is None:
        detail = f"{host} lacks SMTPUTF8; sender {env.reverse_path}"
        return all_get(with_detail(utf8_reply, detail), everyone)
    if env.smtputf8 and not use_utf8 and await body.headers_8bit():
        return all_get(
            with_detail(utf8_reply, f"{host} lacks SMTPUTF8; UTF-8 in the header"), everyone
        )
    paths: dict[str, str] = {}
    for r in recipients:
        p = smtp_path(r.address, use_utf8)
        if p is None:
            replies[r.address] = with_detail(utf8_reply, f"{host} lacks SMTPUTF8")
        else:
            paths[r.address] = p
    if not paths:
        return Plan(replies=replies, mail=None)

    # 8-bit body to a server without 8BITMIME: convert (RFC 6152 §3) or fail 5.6.3. A
    # transaction under SMTPUTF8 takes 8-bit text as it is: a server offering SMTPUTF8
    # supports 8BITMIME (RFC 6531 §3.1), even when it forgets to say so.
    body_source: BodySource = body.source
    body_8bit = env.body_8bit
    converted = False
    if body_8bit and "8bitmime" not in extensions and not use_utf8:
        try:
            data = await body.converted()
        except ConversionError as e:
            return all_get(
                with_detail(R554_8BIT_UNSUPPORTED, f"{host} lacks 8BITMIME; {e}"), list(paths)
            )
        body_source = BodySource.from_bytes(data)
        body_8bit = False
        converted = True
    body_source = await body.outgoing(converted)  # DKIM-signed when a key applies (RFC 6376)

    limit = size_limit(extensions)
    if limit is not None and body_source.size > limit:
        detail = f"{body_source.size} octets > {host} SIZE {limit}"
        plan = all_get(with_detail(R554_SIZE_EXCEEDED, detail), list(paths))
        plan.converted = converted
        return plan

    dsn = "dsn" in extensions
    params: list[bytes] = []
    if "size" in extensions:
        params.append(f"SIZE={body_source.size}".encode())
    if body_8bit and "8bitmime" in extensions:
        params.append(b"BODY=8BITMIME")
    if use_utf8:
        params.append(b"SMTPUTF8")
    if dsn:
        if env.ret:
            params.append(f"RET={env.ret}".encode())
        if env.envid:
            params.append(f"ENVID={xtext_encode(env.envid)}".encode())  # RFC 3461 §4.4
    encoding = "utf-8" if use_utf8 else "ascii"
    try:
        mail = [b"MAIL", f"FROM:<{reverse}>".encode(encoding), *params]
    except UnicodeEncodeError:
        plan = all_get(R501_BAD_REVERSE_PATH, list(paths))
        plan.converted, plan.dsn = converted, dsn
        return plan

    by_address = {r.address: r for r in recipients}
    rcpts: list[tuple[str, list[bytes]]] = []
    for address, path in paths.items():
        rcpt_params: list[bytes] = []
        recipient = by_address[address]
        if dsn:
            if recipient.notify:
                rcpt_params.append(f"NOTIFY={notify_param(recipient.notify)}".encode())
            if recipient.orcpt:
                rcpt_params.append(f"ORCPT={orcpt_param(recipient.orcpt)}".encode())
        try:
            rcpts.append((address, [b"RCPT", f"TO:<{path}>".encode(encoding), *rcpt_params]))
        except UnicodeEncodeError:
            replies[address] = R501_BAD_FORWARD_PATH
    return Plan(replies, mail, rcpts, body_source, converted, dsn)
