"""jsqueue fed by another SMTP front end, and by HTTP, delivering to Postfix.

Three real mail programs on loopback: a *submission* Postfix (Debian's package, own config
dir) with ``relayhost = [127.0.0.1]:<jsqueue's SMTP port>`` and no other route out;
``jsqueue up`` (embedded nats-server, front end, worker, HTTP API); and the *MX* Postfix of
``make e2e`` for ``dest.example.test``, storing into a Maildir. A DNS server on loopback
gives the worker that MX. swaks submits to the submission Postfix, which queues and relays
to jsqueue, which delivers to the MX. A second message goes in over ``POST
/api/v1/inject``. Each arrives exactly once, its body intact, with the trace fields of
every hop on top.

Needs Postfix and swaks installed (``make tools``). Nothing leaves 127.0.0.0/8.
"""

from __future__ import annotations

import base64
import email
import email.policy
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from jsqueue.http.auth import Role, add_token
from support.dns import DnsServer
from support.postfix import (
    SWAKS,
    JsqueueProcess,
    Postfix,
    free_port,
    make_workdir,
    require_tools,
    up_env,
)

pytestmark = pytest.mark.timeout(180)

DEST = "dest.example.test"
BOB = f"bob@{DEST}"
CAROL = f"carol@{DEST}"
ALICE = "alice@submit.example.test"


class Chain:
    def __init__(self, submit: Postfix, mx: Postfix, api_url: str, token: str) -> None:
        self.submit = submit
        self.mx = mx
        self.api_url = api_url
        self.token = token


@pytest.fixture(scope="module")
def chain() -> Iterator[Chain]:
    require_tools(SWAKS)
    workdir = make_workdir("jsqueue-relayhost-")
    mx = Postfix.mx(workdir / "mx", [BOB, CAROL])
    zone = f"{DEST}. MX 10 mx.{DEST}.\nmx.{DEST}. A {mx.host}\n"
    token = add_token(workdir / "tokens", "app", Role.INJECT)
    smtp_port = free_port("127.0.0.1")
    try:
        with DnsServer(zone) as dns:
            mx.start()
            env = up_env(
                workdir,
                mx,
                dns,
                smtp__port=str(smtp_port),
                api__tokens_file=str(workdir / "tokens"),
            )
            jsq = JsqueueProcess(["up"], env, workdir / "jsqueue.log").start()
            submit = Postfix(
                workdir / "submit",
                "127.0.0.1",
                free_port("127.0.0.1"),
                {
                    "myhostname": "submit.example.test",
                    # The setup the README shows: every non-local destination goes to
                    # jsqueue's front end; no DNS, no other route.
                    "relayhost": f"[127.0.0.1]:{smtp_port}",
                    "default_transport": "smtp",
                    "relay_transport": "smtp",
                },
            )
            try:
                api = jsq.wait_for_log(r"HTTP endpoint on (http://\S+)/metrics").group(1)
                jsq.wait_for_log(r"jsqueue running")
                submit.start()
                yield Chain(submit, mx, api, token)
            finally:
                submit.remove()
                status = jsq.stop()
                mx.remove()
            assert status == 0, f"jsqueue up exited with {status}:\n{jsq.log()[-3000:]}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


BODY = "Hello Bob,\r\nrelayed through Postfix and jsqueue.\r\n.one leading dot\r\n"


def test_postfix_relayhost_feeds_jsqueue(chain: Chain, tmp_path: Path) -> None:
    message = tmp_path / "m.eml"
    message.write_bytes(
        f"From: Alice <{ALICE}>\r\nTo: Bob <{BOB}>\r\nSubject: via relayhost\r\n"
        f"Message-ID: <relayhost-1@submit.example.test>\r\n\r\n{BODY}".encode()
    )
    proc = subprocess.run(
        [
            SWAKS,
            "--server",
            chain.submit.host,
            "--port",
            str(chain.submit.port),
            "--from",
            ALICE,
            "--to",
            BOB,
            "--data",
            f"@{message}",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = chain.mx.wait_for_messages(BOB, 1, timeout_s=60)
    raw = path.read_bytes()
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    received = msg.get_all("Received")
    assert received is not None
    hops = [" ".join(r.split()) for r in received]
    # newest first: the MX, jsqueue (from the submission Postfix), the submission Postfix
    assert any("by relay.jsqueue.example.test (jsqueue) with ESMTP" in h for h in hops), hops
    assert any("by submit.example.test (Postfix)" in h for h in hops), hops
    assert msg["Message-ID"] == "<relayhost-1@submit.example.test>"
    # (swaks ends the DATA with one more line end of its own)
    body = raw.replace(b"\r\n", b"\n").rstrip(b"\n")
    assert body.endswith(BODY.replace("\r\n", "\n").rstrip("\n").encode())
    assert chain.submit.queue_empty()
    assert len(chain.mx.messages(BOB)) == 1


def test_http_inject_reaches_the_postfix_mx(chain: Chain) -> None:
    raw = (
        f"From: App <app@submit.example.test>\r\nTo: {CAROL}\r\nSubject: over HTTP\r\n"
        f"Message-ID: <http-1@submit.example.test>\r\n\r\nfrom the API\r\n"
    ).encode()
    r = requests.post(
        chain.api_url + "/api/v1/inject",
        headers={"Authorization": f"Bearer {chain.token}", "Idempotency-Key": "e2e-1"},
        data=json.dumps(
            {
                "reverse_path": "app@submit.example.test",
                "recipients": [{"address": CAROL}],
                "raw_base64": base64.b64encode(raw).decode(),
            }
        ),
        timeout=30,
    )
    assert r.status_code == 202, r.text
    (path,) = chain.mx.wait_for_messages(CAROL, 1, timeout_s=60)
    got = path.read_bytes().replace(b"\n", b"\r\n")
    assert got.endswith(raw)
    assert b"with HTTP id " + r.json()["queue_id"].encode() in got
