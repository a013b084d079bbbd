"""OpenDKIM (Debian's ``opendkim`` package) as a verifying milter for a test Postfix, with
its key lookups going to the loopback :class:`~support.dns.DnsServer` only.

OpenDKIM resolves through libunbound; ``ResolverConfiguration`` names an unbound config
that forwards every query to the test DNS server (``forward-addr: 127.0.0.1@<port>``),
lets it query loopback (``do-not-query-localhost: no``) and undoes unbound's built-in
``test.`` local zone (RFC 6761), which would answer NXDOMAIN for ``*.example.test`` itself.
No DNSSEC validation (``module-config: "iterator"``), no syslog. The milter runs in the
foreground as a child of the test (``-f``), on a free 127.0.0.1 port; the system service is
never used. Postfix gets ``smtpd_milters = inet:127.0.0.1:<port>`` and adds nothing itself:
OpenDKIM adds ``Authentication-Results: <authserv-id>; dkim=pass header.d=… header.s=…``
(RFC 8601) for every signature it checked.

Usage::

    with DnsServer(zone) as dns, OpenDkim(workdir / "opendkim", dns) as milter:
        mx = Postfix.mx(workdir / "postfix", boxes, extra=milter.postfix_settings())
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from support.dns import DnsServer
from support.postfix import free_port

OPENDKIM = "/usr/sbin/opendkim"
AUTHSERV_ID = "mx.verifier.example.test"
INSTALL_HINT = "OpenDKIM is not installed: run `make tools` (installs Debian's opendkim)"


class OpenDkim:
    """One verifying OpenDKIM milter in ``directory``.

    Args:
        directory: its config, unbound config and output file.
        dns: the loopback DNS server that serves the ``_domainkey`` TXT records.
    """

    def __init__(self, directory: Path, dns: DnsServer) -> None:
        self.directory = directory
        self.dns = dns
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.output = directory / "opendkim.out"

    def postfix_settings(self) -> dict[str, str]:
        """``main.cf`` parameters that make Postfix's smtpd use this milter (a milter
        failure is a temporary reply, never mail let through unverified)."""
        return {
            "smtpd_milters": f"inet:127.0.0.1:{self.port}",
            "non_smtpd_milters": "",
            "milter_default_action": "tempfail",
            "milter_protocol": "6",
        }

    def _write(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        unbound = self.directory / "unbound.conf"
        unbound.write_text(
            "server:\n"
            "  do-not-query-localhost: no\n"
            '  module-config: "iterator"\n'
            "  use-syslog: no\n"
            '  local-zone: "test." nodefault\n'
            "forward-zone:\n"
            '  name: "."\n'
            f"  forward-addr: {self.dns.host}@{self.dns.port}\n"
        )
        conf = self.directory / "opendkim.conf"
        conf.write_text(
            "Mode v\n"
            f"Socket inet:{self.port}@127.0.0.1\n"
            "Background no\n"
            "Syslog no\n"
            f"PidFile {self.directory / 'opendkim.pid'}\n"
            f"ResolverConfiguration {unbound}\n"
            f"AuthservID {AUTHSERV_ID}\n"
            "AlwaysAddARHeader yes\n"
            "MinimumKeyBits 1024\n"
            "UserID root\n"
        )
        return conf

    def start(self) -> OpenDkim:
        """Start the milter and wait until it accepts connections.

        Raises:
            RuntimeError: OpenDKIM is not installed, exited, or did not listen in 15 s.
        """
        if not Path(OPENDKIM).exists():
            raise RuntimeError(INSTALL_HINT)
        self.port = free_port("127.0.0.1")
        conf = self._write()
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                [OPENDKIM, "-f", "-x", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"opendkim exited {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"opendkim not listening: {e}: {self.log()}") from e
            time.sleep(0.05)

    def log(self) -> str:
        """What the milter printed."""
        try:
            return self.output.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the milter (its own PID only); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> OpenDkim:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
