"""SMTP replies as the delivery client records them: an aiosmtplib response turned into a
:class:`~jsqueue.replies.Reply` (:func:`to_reply`, RFC 5321 §4.2, RFC 3463 enhanced codes)
and the synthesised replies of a failed hop, with a detail and worded for the smarthost when
the hop is one (:func:`hop_reply`); and the server's limit of recipients per transaction
(:func:`too_many_recipients`, :func:`limit_reply`, :func:`rcpt_reply`, RFC 5321
§4.5.3.1.10).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from aiosmtplib import SMTPResponse

from jsqueue.replies import (
    R451_CONNECT_FAILED,
    R451_CONNECTION_LOST,
    R451_PROTOCOL_ERROR,
    R451_SMARTHOST_CONNECT_FAILED,
    R451_SMARTHOST_CONNECTION_LOST,
    R451_SMARTHOST_TIMEOUT,
    R451_TIMEOUT,
    R452_TOO_MANY_RECIPIENTS,
    Reply,
)

__all__ = [
    "hop_reply",
    "limit_reply",
    "rcpt_reply",
    "refused",
    "to_reply",
    "too_many_recipients",
    "with_detail",
]

_ENHANCED = re.compile(r"^([245])\.(\d{1,3})\.(\d{1,3})(?=\s|$)")


def with_detail(base: Reply, detail: str) -> Reply:
    """``base`` with `` (detail)`` appended to its text; codes unchanged. Pure."""
    return base.model_copy(update={"text": f"{base.text} ({detail})"})


#: MX-worded synthesised replies and their wording for the hop to the smarthost.
_SMARTHOST_WORDING = (
    (R451_CONNECT_FAILED, R451_SMARTHOST_CONNECT_FAILED),
    (R451_CONNECTION_LOST, R451_SMARTHOST_CONNECTION_LOST),
    (R451_TIMEOUT, R451_SMARTHOST_TIMEOUT),
)


def hop_reply(base: Reply, relay: bool) -> Reply:
    """``base`` worded for the hop: its smarthost variant when ``relay`` (the target is
    ``worker.smarthost``) and one exists, else ``base`` itself. Codes never change."""
    if relay:
        for mx_worded, relay_worded in _SMARTHOST_WORDING:
            if base == mx_worded:
                return relay_worded
    return base


def _clean(text: str) -> str:
    """Server text as valid UTF-8 without control characters, C0, DEL or C1 (it goes into
    JSON, DSNs, log lines and operators' terminals)."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join(
        c if c == "\n" or (c >= " " and not "\x7f" <= c <= "\x9f") else " " for c in text
    )


def to_reply(
    response: SMTPResponse, remote_host: str | None, *, intermediate_ok: bool = False
) -> Reply:
    """Turn an aiosmtplib response into a :class:`Reply`.

    Every line of a multi-line reply is kept (joined with ``\\n``); the enhanced status code
    (RFC 2034, RFC 3463) is taken from the first line when its class matches the basic code
    and removed from the start of each line that repeats it. A code outside 2xx/4xx/5xx (3xx
    only where ``intermediate_ok``, i.e. the 354 to DATA) becomes ``451 4.5.0`` protocol error
    (RFC 5321 §4.2.1), so callers never see an impossible reply.

    Args:
        response: code and text as parsed by aiosmtplib.
        remote_host: the MX host name to record in the reply.
        intermediate_ok: accept 3xx (positive intermediate) codes.

    Returns:
        the reply, its text valid UTF-8 without control characters (it goes into JSON and
        DSNs). Pure; never raises.
    """
    code = response.code
    valid = 200 <= code <= 599 and (intermediate_ok or not 300 <= code < 400)
    if not valid:
        return with_detail(R451_PROTOCOL_ERROR, f"{remote_host}: unexpected reply code {code}")
    lines = _clean(response.message).split("\n")
    enhanced: str | None = None
    m = _ENHANCED.match(lines[0])
    if m and m.group(1) == str(code)[0]:
        enhanced = m.group(0)
        lines = [
            line[len(enhanced) :].lstrip() if line.startswith(enhanced) else line for line in lines
        ]
    return Reply(code=code, enhanced=enhanced, text="\n".join(lines), remote_host=remote_host)


#: How servers word their recipient limit in a 552 without the X.5.3 code ("too many
#: recipients", "recipient limit exceeded", "maximum number of recipients reached", ...).
_LIMIT_TEXT = re.compile(
    r"too many (?:recipients|rcpts)|(?:recipients?|rcpts?) limit|limit (?:of|on) recipients"
    r"|max(?:imum)?(?: number of)? (?:recipients|rcpts)",
    re.IGNORECASE,
)


def too_many_recipients(reply: Reply) -> bool:
    """Whether an RCPT reply is the server's limit of recipients per transaction (RFC 5321
    §4.5.3.1.10): ``452``, an enhanced ``X.5.3`` (RFC 3463 §3.6), or ``552`` worded as a
    recipient limit ("too many recipients", "recipient limit exceeded", ...). Pure."""
    if reply.code == 452:
        return True
    if reply.enhanced is not None and reply.enhanced[1:] == ".5.3" and not reply.is_success:
        return True
    return reply.code == 552 and _LIMIT_TEXT.search(reply.text) is not None


def rcpt_reply(reply: Reply, remote_host: str | None) -> tuple[Reply, bool]:
    """An RCPT reply as recorded, and whether it is the server's recipient limit (the
    recipients from this one on go in a further transaction). Pure.

    - The limit (:func:`too_many_recipients`): :func:`limit_reply`, temporary.
    - Any other ``552``: temporary too, as ``452`` with the enhanced code's class 4, the
      server's text unchanged and its codes in ``sent`` (the DSN's Diagnostic-Code is the
      reply the server sent, RFC 3464 §2.3.6; its human-readable part says why). RFC
      5321 §4.5.3.1.10: clients SHOULD treat a 552 to RCPT as temporary (RFC 821 listed
      it for the recipient limit, and servers still send it for that in words of their
      own); RFC 3463 §3.3: X.2.2 mailbox full is a persistent transient failure. It is
      retried like any deferral and bounced when the message expires, never at once.
    - Anything else: unchanged.
    """
    if too_many_recipients(reply):
        return limit_reply(reply, remote_host), True
    if reply.code == 552:
        enhanced = None if reply.enhanced is None else "4" + reply.enhanced[1:]
        was = "552" if reply.enhanced is None else f"552 {reply.enhanced}"
        update = {"code": 452, "enhanced": enhanced, "sent": was}
        return reply.model_copy(update=update), False
    return reply, False


def refused(replies: Mapping[str, Reply]) -> dict[str, Reply]:
    """Those of ``replies`` (per recipient, so far in one transaction) that refuse their
    recipient: 4yz or 5yz, a recipient limit excepted (its recipients go in a further
    transaction). They stand when the transaction then fails (``NextMx.settled``): RFC
    5321 §3.3, each RCPT reply is the server's answer for its recipient. Pure."""
    return {a: r for a, r in replies.items() if not r.is_success and not too_many_recipients(r)}


def limit_reply(reply: Reply, remote_host: str | None) -> Reply:
    """A recipient-limit reply (:func:`too_many_recipients`) as recorded: always temporary;
    a 552 becomes ``452 4.5.3`` with the server's text unchanged (ours when it sent none)
    and its codes in ``sent`` (RFC 5321 §4.5.3.1.10: clients SHOULD treat it as
    temporary; RFC 3464 §2.3.6: a DSN's Diagnostic-Code is the reply as sent). Pure."""
    if reply.is_temporary:
        return reply
    text = reply.text or R452_TOO_MANY_RECIPIENTS.text
    sent = str(reply.code) if reply.enhanced is None else f"{reply.code} {reply.enhanced}"
    update = {"text": text, "remote_host": remote_host, "sent": sent}
    return R452_TOO_MANY_RECIPIENTS.model_copy(update=update)
