"""DKIM signing cost: what :class:`jsqueue.delivery.dkim.DkimSigner` (dkimpy, relaxed/relaxed)
spends on one message, by size and algorithm.

dkimpy has no streaming interface: it splits the whole message into lines, canonicalises
the body in memory and hashes it. This prints, per message size and algorithm (Ed25519-SHA256,
RSA-SHA256 2048 bits), the median wall time of ``DkimSigner.sign`` over ``--runs`` runs (the
algorithms alternating within each run), the time per MB, and the peak of Python memory
allocated during one signature (tracemalloc, a separate run). A benchmark, not a test:
nothing is asserted. The load average is printed first and last; the machine is shared,
so compare figures of the same run.

Usage::

    python bench/dkim_sign.py [--sizes 100000,1000000,10000000] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import nacl.signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from jsqueue.config.dkim import DkimSettings
from jsqueue.delivery.dkim import DkimSigner, SigningKey


def _message(size: int) -> bytes:
    head = (
        b"From: Alice <alice@example.test>\r\nTo: bob@dest.example.test\r\n"
        b"Subject: bench\r\nDate: Mon, 02 Mar 2026 09:00:00 +0000\r\n"
        b"Message-ID: <bench@example.test>\r\nMIME-Version: 1.0\r\n\r\n"
    )
    line = b"Some text  with\tblanks, as mail has it " + b"x" * 34 + b" \r\n"
    return head + line * max(1, (size - len(head)) // len(line))


def _keys(directory: Path) -> dict[str, DkimSigner]:
    ed = directory / "ed.key"
    ed.write_bytes(base64.b64encode(bytes(nacl.signing.SigningKey.generate())))
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (directory / "rsa.key").write_bytes(pem)
    out = {}
    for name, selector in (("ed25519", "ed.key"), ("rsa2048", "rsa.key")):
        settings = DkimSettings.model_validate(
            {
                "keys": [
                    {"domain": "example.test", "selector": "s", "key_file": directory / selector}
                ]
            }
        )
        out[name] = DkimSigner.from_settings(settings)
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000", help="octets, comma list")
    parser.add_argument("--runs", type=int, default=5, help="runs per size (median)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load average at start: {_load()}  (cpus: {os.cpu_count()})")
    with tempfile.TemporaryDirectory() as tmp:
        signers = _keys(Path(tmp))
        print(f"{'size':>10} {'algorithm':>9} {'median s':>9} {'s per MB':>9} {'peak MB':>8}")
        for size in sizes:
            message = _message(size)
            keys: dict[str, list[SigningKey]] = {
                n: s.keys_for(message[: message.index(b"\r\n\r\n") + 2], "")
                for n, s in signers.items()
            }
            times: dict[str, list[float]] = {n: [] for n in signers}
            for run in range(args.runs):
                order = list(signers) if run % 2 == 0 else list(reversed(signers))
                for name in order:
                    start = time.perf_counter()
                    await signers[name].sign(message, keys[name])
                    times[name].append(time.perf_counter() - start)
            for name, signer in signers.items():
                tracemalloc.start()
                await signer.sign(message, keys[name])
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                median = statistics.median(times[name])
                print(
                    f"{len(message):>10} {name:>9} {median:>9.3f} "
                    f"{median / (len(message) / 1e6):>9.3f} {peak / 1e6:>8.1f}"
                )
        for signer in signers.values():
            signer.close()
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    asyncio.run(main())
