"""The message body within one delivery attempt: read from its source once per session, scanned
once for 8-bit header octets (SMTPUTF8, RFC 6531) and converted once to 7-bit MIME for a
server without 8BITMIME (RFC 6152 §3), the converted copy kept for the rest of the attempt;
DKIM-signed (RFC 6376) once per attempt and variant, after any conversion, so that the
signature covers the exact bytes on the wire (:meth:`BodyCache.outgoing`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from jsqueue.delivery.base import BodySource
from jsqueue.delivery.dkim import DkimSigner, Signed, SigningKey
from jsqueue.delivery.signing import signature_domains
from jsqueue.delivery.transform import ConversionError, has_8bit_headers, header_end, to_7bit
from jsqueue.errors import SigningError, StoreError

__all__ = ["MAX_CONVERT_OCTETS", "BodyCache", "aclose"]

MAX_CONVERT_OCTETS = 64 * 1024 * 1024
"""Largest 8-bit body converted to 7-bit in memory; larger ones fail with 5.6.3."""

MAX_HEADER_OCTETS = 1024 * 1024
"""At most this much of the message is read to find the header section (DKIM key choice)."""

log = logging.getLogger(__name__)


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
        source: the message; opened once per scan, conversion, signature and session.
        signer: DKIM signer (``worker.dkim``); None = never signed.
        reverse_path: the envelope's (it may pick the signing key).
    """

    def __init__(
        self, source: BodySource, signer: DkimSigner | None = None, reverse_path: str = ""
    ) -> None:
        self.source = source
        self.signer = signer
        self.reverse_path = reverse_path
        self._converted: bytes | None = None
        self._conversion_error: str | None = None
        self._headers_8bit: bool | None = None
        self._header_section: bytes | None = None
        self._outgoing: dict[bool, BodySource] = {}
        self._dkim: dict[bool, str | None] = {}

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

    async def header_section(self) -> bytes:
        """The header section up to and including the CRLF of its last field (at most
        :data:`MAX_HEADER_OCTETS` read), once per attempt.

        Raises:
            BodyNotFound: the body source has no body (passed through).
            BodyCorrupt: the body does not match its digest (passed through).
            StoreUnavailable: the body store failed (passed through).
        """
        if self._header_section is None:
            data = b""
            iterator = self.source.open()
            try:
                async for chunk in iterator:
                    data += chunk
                    if b"\r\n\r\n" in data or data.startswith(b"\r\n"):
                        break
                    if len(data) >= MAX_HEADER_OCTETS:
                        break
            finally:
                await aclose(iterator)
            end = header_end(data)
            self._header_section = data[: max(end - 2, 0)]
        return self._header_section

    async def _whole(self) -> bytes:
        parts = []
        iterator = self.source.open()
        try:
            async for chunk in iterator:
                parts.append(chunk)
        finally:
            await aclose(iterator)
        return b"".join(parts)

    async def outgoing(self, converted: bool) -> BodySource:
        """The message as it goes to this server, DKIM-signed when a key applies (RFC 6376
        §5; :class:`~jsqueue.delivery.dkim.DkimSigner`): the original, or with
        ``converted`` its 7-bit form (:meth:`converted` must have succeeded), with the
        ``DKIM-Signature`` fields on top (§5.6). Signed once per variant and attempt, over
        exactly these bytes. A message that cannot be signed (too large, dkimpy refuses
        it) goes unsigned and :meth:`dkim` says why. When the body store fails while the
        message is read for its signature (``BodyNotFound`` after an admin delete,
        ``BodyCorrupt``, ``StoreUnavailable``), the source returned raises that error
        when opened, so the transaction ends before its final dot as for a failure during
        DATA (RFC 5321 §4.1.1.4): never raised here, never sent unsigned instead.
        """
        cached = self._outgoing.get(converted)
        if cached is not None:
            return cached
        base = BodySource.from_bytes(self._converted) if converted and self._converted else None
        plain = base or self.source
        try:
            out = await self._signed(converted, base, plain)
        except StoreError as e:
            log.warning("DKIM: the body could not be read for its signature: %r", e)
            out = _failing(e, plain.size)
            self._dkim[converted] = None
        self._outgoing[converted] = out
        return out

    async def _signed(
        self, converted: bool, base: BodySource | None, plain: BodySource
    ) -> BodySource:
        """:meth:`outgoing` without the store failures: those pass through.

        Raises:
            BodyNotFound: the body source has no body (passed through).
            BodyCorrupt: the body does not match its digest (passed through).
            StoreUnavailable: the body store failed (passed through).
        """
        signed = Signed()
        # Without keys the header section is read only to find signatures a conversion
        # may break: no extra read of a message sent as it is.
        if self.signer is not None and (self.signer.by_domain or converted):
            headers = await self.header_section()
            keys = self.signer.keys_for(headers, self.reverse_path)
            if keys:
                signed = await self._sign(base, keys)
            if converted and (theirs := signature_domains(headers)):
                note = (
                    f"7-bit conversion: the message's own DKIM signature(s) "
                    f"d={', d='.join(theirs)} may no longer verify"
                )
                log.warning("%s", note)
                signed = Signed(signed.header, f"{signed.summary or 'none of ours'}; {note}")
        self._dkim[converted] = signed.summary
        return _prefixed(signed.header, plain) if signed.header else plain

    async def _sign(self, base: BodySource | None, keys: list[SigningKey]) -> Signed:
        assert self.signer is not None
        size = base.size if base is not None else self.source.size
        reason = self.signer.unsigned_reason(size)
        if reason is not None:
            return Signed(b"", reason)
        message = self._converted if base is not None and self._converted else await self._whole()
        try:
            return await self.signer.sign(message, keys)
        except SigningError as e:
            log.warning("DKIM: %s; sent unsigned", e)
            return Signed(b"", f"unsigned: {e}")

    def dkim(self, converted: bool) -> str | None:
        """What :meth:`outgoing` did about DKIM for that variant: ``d=… s=… a=…`` per
        signature, ``unsigned: <why>``, a note on the message's own signatures after a
        7-bit conversion, or None (no key applies, or not signed yet)."""
        return self._dkim.get(converted)


def _failing(error: StoreError, size: int) -> BodySource:
    """A source that raises ``error`` when read (the DATA path aborts the transaction)."""

    async def chunks() -> AsyncIterator[bytes]:
        raise error
        yield b""  # pragma: no cover - makes this an async generator

    return BodySource(open=chunks, size=size)


def _prefixed(header: bytes, source: BodySource) -> BodySource:
    """``source`` with ``header`` in front of it."""

    async def chunks() -> AsyncIterator[bytes]:
        yield header
        iterator = source.open()
        try:
            async for chunk in iterator:
                yield chunk
        finally:
            await aclose(iterator)

    return BodySource(open=chunks, size=len(header) + source.size)
