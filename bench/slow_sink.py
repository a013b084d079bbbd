"""An SMTP sink whose every reply arrives ``--delay-ms`` after the command it answers: a
receiving MTA one round trip away (real MXes are 20-150 ms away), on loopback, without
``tc netem`` (this machine's kernel has no netem module).

Each reply is sent at (arrival of the line it answers + delay), in order, so pipelined
commands (RFC 2920) that arrive together are answered together one delay later, as over a
real path: the sink measures round trips, not commands. It advertises PIPELINING, 8BITMIME
and SMTPUTF8 like a common MX, accepts everything, and discards the message.

Output (stdout, one record per counted message, CR-separated like ``smtp-sink -c``):
``mesg=N rt=M sess=S peak=P``: messages received, round trips (client writes that had to
wait for a reply: a burst of data after the sink's last reply counts once), sessions, and
the most sessions that were open at once (what a receiver's per-client limit sees).

Usage: ``python bench/slow_sink.py HOST PORT --delay-ms 50``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

try:
    import uvloop
except ImportError:  # pragma: no cover - the bench runs in the project's venv
    uvloop = None  # type: ignore[assignment]


class Counters:
    def __init__(self) -> None:
        self.mesg = 0
        self.rt = 0
        self.sess = 0
        self.open = 0
        self.peak = 0

    def report(self) -> None:
        sys.stdout.write(f"mesg={self.mesg} rt={self.rt} sess={self.sess} peak={self.peak}\r")
        sys.stdout.flush()


EHLO = (
    b"250-slow-sink.bench.example.test\r\n250-PIPELINING\r\n250-8BITMIME\r\n"
    b"250-SMTPUTF8\r\n250 SIZE 104857600\r\n"
)


async def session(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, c: Counters
) -> None:
    loop = asyncio.get_running_loop()
    c.sess += 1
    c.open += 1
    c.peak = max(c.peak, c.open)
    replies: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
    last_reply_at = loop.time()
    waiting = True  # the client is waiting for a reply (its next write is a new round trip)

    async def send() -> None:
        nonlocal last_reply_at, waiting
        while (item := await replies.get()) is not None:
            at, data = item
            pause = at - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            writer.write(data)
            last_reply_at = loop.time()
            if replies.empty():
                waiting = True
        await writer.drain()

    sender = asyncio.create_task(send())
    c.rt += 1  # connect + greeting
    replies.put_nowait((loop.time() + delay_s, b"220 slow-sink ESMTP\r\n"))
    in_data = False
    try:
        while line := await reader.readline():
            now = loop.time()
            if waiting:
                c.rt += 1
                waiting = False
            if in_data:
                if line in (b".\r\n", b".\n"):
                    in_data = False
                    c.mesg += 1
                    c.report()
                    replies.put_nowait((now + delay_s, b"250 2.0.0 Ok: queued\r\n"))
                continue
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                reply = EHLO if verb == b"EHLO" else b"250 slow-sink\r\n"
            elif verb == b"DATA":
                in_data = True
                reply = b"354 End data with <CR><LF>.<CR><LF>\r\n"
            elif verb == b"QUIT":
                replies.put_nowait((now + delay_s, b"221 2.0.0 Bye\r\n"))
                break
            else:  # MAIL, RCPT, RSET, NOOP ...
                reply = b"250 2.0.0 Ok\r\n"
            replies.put_nowait((now + delay_s, reply))
    finally:
        c.open -= 1
        replies.put_nowait(None)
        with contextlib.suppress(Exception):
            await sender
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    args = parser.parse_args()
    c = Counters()
    delay_s = args.delay_ms / 1000

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await session(r, w, delay_s, c)

    server = await asyncio.start_server(handle, args.host, args.port, backlog=1024)
    async with server:
        c.report()
        await server.serve_forever()


if __name__ == "__main__":
    if uvloop is not None:
        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
