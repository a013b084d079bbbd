"""The message body within one delivery attempt: read from its source once per session, scanned
once for 8-bit header octets (SMTPUTF8, RFC 6531) and converted once to 7-bit MIME for a
server without 8BITMIME (RFC 6152 §3), the converted copy kept for the rest of the attempt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from jsqueue.delivery.base import BodySource
from jsqueue.delivery.transform import ConversionError, has_8bit_headers, to_7bit

__all__ = ["MAX_CONVERT_OCTETS", "BodyCache", "aclose"]

MAX_CONVERT_OCTETS = 64 * 1024 * 1024
"""Largest 8-bit body converted to 7-bit in memory; larger ones fail with 5.6.3."""


async def aclose(iterator: AsyncIterator[bytes]) -> None:
    """Close ``iterator`` when it can be closed (an async generator); never raises itself."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class BodyCache:
    """The body as sent to the current server: original, or converted to 7-bit (kept for
    the rest of the attempt), plus the header scan result. Errors of the body source
    (``BodyNotFound``, ``BodyCorrupt``, ``StoreUnavailable``) pass through its methods.

    Args:
        source: the message; opened once per scan, conversion and session.
    """

    def __init__(self, source: BodySource) -> None:
        self.source = source
        self._converted: bytes | None = None
        self._conversion_error: str | None = None
        self._headers_8bit: bool | None = None

    async def headers_8bit(self) -> bool:
        """Whether the header section has octets >= 0x80 (RFC 6532; reads only the header
        section, once per attempt).

        Raises:
            BodyNotFound: the body source has no body (passed through).
            BodyCorrupt: the body does not match its digest (passed through).
            StoreUnavailable: the body store failed (passed through).
        """
        if self._headers_8bit is None:
            tail = b""
            found = False
            first = True
            iterator = self.source.open()
            try:
                async for chunk in iterator:
                    data = tail + chunk
                    if first and data.startswith(b"\r\n"):
                        break  # no header section at all
                    first = False
                    end = data.find(b"\r\n\r\n")
                    if has_8bit_headers(data if end < 0 else data[:end]):
                        found = True
                        break
                    if end >= 0:
                        break
                    tail = data[-3:]
            finally:
                await aclose(iterator)
            self._headers_8bit = found
        return self._headers_8bit

    async def converted(self) -> bytes:
        """The body converted to 7-bit MIME (RFC 6152 §3), converted once per attempt and
        kept in memory (at most :data:`MAX_CONVERT_OCTETS` octets read).

        Raises:
            ConversionError: see :func:`to_7bit`, or the body is too large to convert
                (raised again on each later call).
            BodyNotFound: the body source has no body (passed through).
            BodyCorrupt: the body does not match its digest (passed through).
            StoreUnavailable: the body store failed (passed through).
        """
        if self._conversion_error is not None:
            raise ConversionError(self._conversion_error)
        if self._converted is None:
            try:
                if self.source.size > MAX_CONVERT_OCTETS:
                    raise ConversionError(
                        f"{self.source.size} octets is too large to convert to 7-bit"
                    )
                parts = []
                iterator = self.source.open()
                try:
                    async for chunk in iterator:
                        parts.append(chunk)
                finally:
                    await aclose(iterator)
                self._converted = to_7bit(b"".join(parts))
            except ConversionError as e:
                self._conversion_error = str(e)
                raise
        return self._converted
