"""Logging set-up: readable lines by default, one JSON object per line when configured."""

from __future__ import annotations

import copy
import json
import logging
from datetime import UTC, datetime

from pydantic import BaseModel

from jsqueue.config import LogSettings

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message and any
    ``extra`` fields (queue_id, recipient, outcome ...); a pydantic model among them as
    its fields, a value ``json`` has no type for (a datetime) as ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a JSON line."""
        out = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=_jsonable)


#: Control characters (C0 but tab, DEL, C1) written as ``\\xNN`` in text lines.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if c != 0x09}


class TextFormatter(logging.Formatter):
    """``time level logger: message``, one line per record: control characters of the
    message (CR, LF, ESC ...) are written as ``\\xNN``, so text a client sent and a
    library logs (aiosmtpd's "unrecognised" command line) can neither forge a line nor
    drive the terminal that shows the log. A traceback keeps its lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line of ``record``, its message's control characters escaped (on a copy:
        other handlers see the record as it was)."""
        message = record.message.translate(_CONTROLS)
        if message != record.message:
            record = copy.copy(record)
            record.message = message
        return super().formatMessage(record)


def _jsonable(value: object) -> object:
    """A field ``json`` cannot write: a pydantic model as its fields (``model_dump``: a
    :class:`~jsqueue.replies.TlsNote` as the entry keeps it), anything else as ``str``."""
    return value.model_dump() if isinstance(value, BaseModel) else str(value)


def setup_logging(settings: LogSettings) -> None:
    """Configure the root logger from the ``log`` settings section. Idempotent."""
    handler = logging.StreamHandler()
    if settings.json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    # No line of ours names a thread or process: leave those look-ups out of every record
    # (the logging HOWTO's "Optimization"; one line per recipient and attempt).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # aiosmtpd logs every command line at INFO; keep that for DEBUG runs only.
    logging.getLogger("mail.log").setLevel(
        logging.DEBUG if settings.level == "DEBUG" else logging.WARNING
    )
