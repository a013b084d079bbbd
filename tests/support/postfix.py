"""Real Postfix instances (Debian's ``postfix`` package) on loopback, for tests and benchmarks.

Each :class:`Postfix` lives in its own directory (``main.cf``, ``master.cf``, queue, data,
mail, log) and is run with ``postfix -c DIR start``, so it never touches the system
instance and several can run side by side. One smtpd listens on ``host:port`` (a 127.0.0.x
address and a free port). Two roles:

* :meth:`Postfix.mx` - the receiving MX: the ``virtual`` delivery agent stores mail for the
  listed mailboxes in Maildirs under ``DIR/mail/<domain>/<local part>/``; a recipient of
  those domains that is not listed gets ``550 5.1.1`` at RCPT (Postfix's
  ``smtpd_reject_unlisted_recipient``).
* :meth:`Postfix.relay` - a relay (the benchmark's reference MTA): mail for the routed
  domains is queued (fsync before ``250``, Postfix's default) and sent to a fixed
  ``[address]:port`` per domain (``transport_maps``).

Neither role can resolve or reach a real domain: no DNS (``smtp_dns_support_level =
disabled``, ``disable_dns_lookups``, ``smtp_host_lookup = native``, no peer name lookup),
every other destination goes to the ``error`` transport, and only loopback addresses are
used. Logs go to ``DIR/maillog`` (``maillog_file``, Postfix ≥ 3.4).

:class:`JsqueueProcess` runs jsqueue beside it the same way: a real process started
through the CLI (``python -m jsqueue up|smtp|worker|nats``) with ``JSQUEUE_*`` settings.

Usage::

    with Postfix.mx(workdir, mailboxes=["bob@dest.example.test"]) as mx:
        ...  # deliver to mx.host:mx.port
        mx.wait_for_messages("bob@dest.example.test", 1)
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

from support.dns import DnsServer

#: Where the Debian package puts the commands.
POSTFIX = "/usr/sbin/postfix"
POSTCONF = "/usr/sbin/postconf"
SMTP_SINK = "/usr/sbin/smtp-sink"
SMTP_SOURCE = "/usr/sbin/smtp-source"
SWAKS = "/usr/bin/swaks"
#: The unprivileged account the ``virtual`` agent writes Maildirs as (Debian's ``nobody``).
MAIL_UID = 65534
MAIL_GID = 65534
INSTALL_HINT = (
    "Postfix and swaks are not installed: run `make tools` (as root; installs Debian's "
    "postfix and swaks packages)"
)

_MASTER_CF = """\
# service type  private unpriv  chroot  wakeup  maxproc command
{listen} inet  n       -       n       -       -       smtpd
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
tlsmgr    unix  -       -       n       1000?   1       tlsmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
local     unix  -       n       n       -       -       local
virtual   unix  -       n       n       -       -       virtual
lmtp      unix  -       -       n       -       -       lmtp
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""


def _drain(fd: int) -> str:
    """Everything buffered on a pseudo-terminal's controller side (the writer has closed)."""
    chunks: list[bytes] = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the terminal side is closed and nothing is left
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


class PostfixError(RuntimeError):
    """A Postfix command failed or Postfix is not installed."""


def require_tools(*paths: str) -> None:
    """Fail with the install hint when one of the Debian programs is missing.

    Raises:
        PostfixError: a program is not installed.
    """
    missing = [p for p in paths if not os.access(p, os.X_OK)]
    if missing:
        raise PostfixError(f"{INSTALL_HINT}; missing: {', '.join(missing)}")


def loopback_address(third: int | None = None) -> str:
    """A random 127.0.x.y address (``x`` = ``third`` when given), y in 2..254."""
    x = third if third is not None else random.randint(10, 250)
    return f"127.0.{x}.{random.randint(2, 254)}"


def free_port(host: str, *, others: Iterable[str] = ()) -> int:
    """A TCP port free on ``host`` and on every address in ``others`` (for one shared port).

    Raises:
        OSError: none found in 50 tries.
    """
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        try:
            for other in others:
                with socket.socket() as t:
                    t.bind((other, port))
        except OSError:
            continue
        return port
    raise OSError(f"no free port on {host} and {list(others)}")


def make_workdir(prefix: str) -> Path:
    """A fresh directory under the system temp dir that Postfix's unprivileged processes can
    traverse (pytest's own temp dirs are private to root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=tempfile.gettempdir()))
    path.chmod(0o755)
    return path


class Postfix:
    """One Postfix instance in ``directory``, smtpd on ``host:port``.

    Use :meth:`mx` or :meth:`relay` to build one; :meth:`start`/:meth:`stop` (or ``with``).

    Args:
        directory: the instance's own directory (config, queue, data, mail, log).
        host: 127.0.0.x address smtpd listens on.
        port: smtpd port.
        settings: ``main.cf`` parameters on top of the isolating base settings.
        mailboxes: addresses the ``virtual`` agent delivers to (Maildir).
        listeners: more smtpd listeners on the same port, address → ``-o`` overrides of
            that smtpd (e.g. ``{"127.0.3.4": {"smtpd_discard_ehlo_keywords": "8bitmime"}}``
            for a server without 8BITMIME).
    """

    def __init__(
        self,
        directory: Path,
        host: str,
        port: int,
        settings: Mapping[str, str],
        mailboxes: Iterable[str] = (),
        listeners: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        require_tools(POSTFIX, POSTCONF)
        self.directory = directory
        self.host = host
        self.port = port
        self.settings = dict(settings)
        self.mailboxes = sorted(set(mailboxes))
        self.listeners = {a: dict(o) for a, o in (listeners or {}).items()}
        self.config_dir = directory / "etc"
        self.mail_dir = directory / "mail"
        self.log_file = directory / "maillog"
        self._write_config()

    # ----------------------------------------------------------------------- builders

    @classmethod
    def mx(
        cls,
        directory: Path,
        mailboxes: Iterable[str],
        *,
        host: str | None = None,
        port: int | None = None,
        hostname: str = "mx.example.test",
        extra: Mapping[str, str] | None = None,
        listeners: Mapping[str, Mapping[str, str]] | None = None,
    ) -> Postfix:
        """The final MX for the domains of ``mailboxes``; each gets a Maildir. ``extra``:
        more ``main.cf`` parameters; ``listeners``: see :class:`Postfix`."""
        boxes = sorted(set(mailboxes))
        domains = sorted({b.rsplit("@", 1)[1].lower() for b in boxes})
        host = host or loopback_address()
        settings = {
            "myhostname": hostname,
            "virtual_mailbox_domains": " ".join(domains),
            "virtual_mailbox_base": str(directory / "mail"),
            "virtual_mailbox_maps": f"texthash:{directory / 'etc' / 'vmailbox'}",
            "virtual_uid_maps": f"static:{MAIL_UID}",
            "virtual_gid_maps": f"static:{MAIL_GID}",
            "virtual_minimum_uid": "100",
            "smtpd_reject_unlisted_recipient": "yes",
            # Mail from jsqueue on 127.0.0.1 is not "local": leave its headers alone.
            "local_header_rewrite_clients": "",
            **(extra or {}),
        }
        port = port or free_port(host, others=list(listeners or {}))
        return cls(directory, host, port, settings, boxes, listeners)

    @classmethod
    def relay(
        cls,
        directory: Path,
        routes: Mapping[str, str],
        *,
        host: str | None = None,
        port: int | None = None,
        hostname: str = "relay.example.test",
        extra: Mapping[str, str] | None = None,
    ) -> Postfix:
        """A relay queueing mail for ``routes`` (domain → ``[address]:port``) and sending it
        there over SMTP. Only 127.0.0.0/8 clients may relay."""
        host = host or loopback_address()
        settings = {
            "myhostname": hostname,
            "relay_domains": " ".join(sorted(routes)),
            "transport_maps": f"texthash:{directory / 'etc' / 'transport'}",
            **(extra or {}),
        }
        pf = cls(directory, host, port or free_port(host), settings)
        (pf.config_dir / "transport").write_text(
            "".join(f"{domain} smtp:{target}\n" for domain, target in sorted(routes.items()))
        )
        return pf

    # ----------------------------------------------------------------------- config

    def _base_settings(self) -> dict[str, str]:
        d = self.directory
        return {
            "compatibility_level": "3.6",
            "queue_directory": str(d / "queue"),
            "data_directory": str(d / "data"),
            "mail_owner": "postfix",
            "setgid_group": "postdrop",
            "syslog_name": f"postfix-{d.name}",
            "maillog_file": str(self.log_file),
            "maillog_file_prefixes": str(d),
            # Must name an interface address: the smtpd address itself is in master.cf.
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "mydomain": "example.test",
            "myorigin": "$myhostname",
            "mydestination": "",
            "mynetworks": "127.0.0.0/8",
            "relayhost": "",
            # No DNS and no real destination, ever.
            "disable_dns_lookups": "yes",
            "smtp_dns_support_level": "disabled",
            "smtp_host_lookup": "native",
            "lmtp_host_lookup": "native",
            "smtpd_peername_lookup": "no",
            "default_transport": "error:5.3.0 outbound mail is disabled here",
            "relay_transport": "error:5.3.0 outbound mail is disabled here",
            "local_transport": "error:5.1.1 local delivery is disabled here",
            "alias_maps": "",
            "alias_database": "",
            "local_recipient_maps": "",
            "notify_classes": "",
            "biff": "no",
            "smtpd_banner": "$myhostname ESMTP",
            "smtp_tls_security_level": "none",
            "smtpd_tls_security_level": "none",
        }

    def _write_config(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o755)
        # The config dir must be root's alone (postfix check); queue and data go beside it.
        self.config_dir.mkdir(mode=0o755, exist_ok=True)
        (self.directory / "queue").mkdir(mode=0o755, exist_ok=True)
        settings = {**self._base_settings(), **self.settings}
        (self.config_dir / "main.cf").write_text(
            "".join(f"{k} = {v}\n" for k, v in settings.items())
        )
        more = "".join(
            f"{address}:{self.port} inet n - n - - smtpd"
            + "".join(f" -o {k}={v}" for k, v in options.items())
            + "\n"
            for address, options in self.listeners.items()
        )
        (self.config_dir / "master.cf").write_text(
            _MASTER_CF.format(listen=f"{self.host}:{self.port}") + more
        )
        if self.mailboxes:
            self.mail_dir.mkdir(exist_ok=True)
            os.chown(self.mail_dir, MAIL_UID, MAIL_GID)
            (self.config_dir / "vmailbox").write_text(
                "".join(f"{box} {self._relative_maildir(box)}/\n" for box in self.mailboxes)
            )

    @staticmethod
    def _relative_maildir(address: str) -> str:
        local, domain = address.rsplit("@", 1)
        return f"{domain.lower()}/{local}"

    # ----------------------------------------------------------------------- lifecycle

    def _command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``postfix -c DIR args``. Its messages go to the terminal only (else to the
        log daemon, which may not run yet), so it gets a pseudo-terminal to write to."""
        controller, terminal = os.openpty()
        try:
            proc = subprocess.run(
                [POSTFIX, "-c", str(self.config_dir), *args],
                stdin=subprocess.DEVNULL,
                stdout=terminal,
                stderr=terminal,
                timeout=60,
                check=False,
            )
            os.close(terminal)
            terminal = -1
            output = _drain(controller)
        finally:
            if terminal >= 0:
                os.close(terminal)
            os.close(controller)
        if check and proc.returncode != 0:
            raise PostfixError(
                f"postfix {' '.join(args)} (in {self.directory}) failed with status "
                f"{proc.returncode}: {output.strip()}\n{self.log_tail()}"
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")

    @property
    def running(self) -> bool:
        """True while the instance's master process runs."""
        return self._command("status", check=False).returncode == 0

    def start(self) -> Postfix:
        """Start the instance and wait until smtpd accepts connections.

        Raises:
            PostfixError: ``postfix start`` failed or smtpd did not answer within 30 s.
        """
        self._command("start")
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=5) as s:
                    if s.recv(512).startswith(b"220"):
                        s.sendall(b"QUIT\r\n")
                        return self
            except OSError as e:
                if time.monotonic() > deadline:
                    raise PostfixError(
                        f"postfix smtpd on {self.host}:{self.port} not answering: {e}"
                    ) from e
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the instance (``postfix stop`` waits for the master to exit); idempotent."""
        if self.running:
            self._command("stop")

    def abort(self) -> None:
        """Stop at once (``postfix abort``), for teardown after a failure; idempotent."""
        if self.running:
            self._command("abort", check=False)

    def remove(self) -> None:
        """Stop and delete the instance directory."""
        self.abort()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Postfix:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------------- inspection

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the instance's mail log (for failure messages)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no mail log)"
        return "\n".join(text.splitlines()[-lines:])

    def maildir(self, address: str) -> Path:
        """The Maildir of a mailbox given to :meth:`mx`."""
        return self.mail_dir / self._relative_maildir(address)

    def messages(self, address: str) -> list[Path]:
        """Message files in the mailbox (``new`` and ``cur``), oldest first."""
        box = self.maildir(address)
        files = [p for sub in ("new", "cur") if (box / sub).is_dir() for p in (box / sub).iterdir()]
        return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))

    def wait_for_messages(self, address: str, count: int, timeout_s: float = 30.0) -> list[Path]:
        """Wait until the mailbox holds at least ``count`` messages; return them.

        Raises:
            AssertionError: not within ``timeout_s`` seconds (with the mail log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.messages(address)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{address}: {len(found)} of {count} messages within {timeout_s} s\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def queue_empty(self) -> bool:
        """True when the instance's queue holds no message (active, incoming, deferred)."""
        queue = self.directory / "queue"
        for sub in ("maildrop", "incoming", "active", "deferred", "hold"):
            base = queue / sub
            if base.is_dir() and any(p.is_file() for p in base.rglob("*")):
                return False
        return True


# --------------------------------------------------------------------------- jsqueue CLI


def up_env(workdir: Path, mx: Postfix, dns: DnsServer, **more: str) -> dict[str, str]:
    """The ``JSQUEUE_*`` settings of a ``jsqueue up`` that delivers to ``mx`` (its MX
    records served by ``dns``): an embedded nats-server and the front end on any port of
    127.0.0.1, short timeouts and retries, logs at INFO; ``more`` adds or overrides
    settings (``JSQUEUE_`` and the upper case added: ``NATS__PREFIX="jsq"``)."""
    env = {
        "JSQUEUE_NATS__STORE_DIR": str(workdir / "nats"),
        "JSQUEUE_NATS__PORT": "0",
        "JSQUEUE_SMTP__HOST": "127.0.0.1",
        "JSQUEUE_SMTP__PORT": "0",
        "JSQUEUE_SMTP__HOSTNAME": "relay.jsqueue.example.test",
        "JSQUEUE_WORKER__MX_PORT": str(mx.port),
        "JSQUEUE_WORKER__NAMESERVERS": f'["{dns.host}"]',
        "JSQUEUE_WORKER__NAMESERVER_PORT": str(dns.port),
        "JSQUEUE_WORKER__DNS_TIMEOUT_S": "2",
        "JSQUEUE_WORKER__CONNECT_TIMEOUT_S": "2",
        "JSQUEUE_WORKER__EHLO_NAME": "relay.jsqueue.example.test",
        "JSQUEUE_WORKER__BODY_CACHE_DIR": str(workdir / "cache"),
        "JSQUEUE_WORKER__DRAIN_TIMEOUT_S": "5",
        "JSQUEUE_RETRY__BASE_S": "1",
        "JSQUEUE_RETRY__FACTOR": "1",
        "JSQUEUE_RETRY__JITTER": "0",
        "JSQUEUE_DSN__REPORTING_MTA": "relay.jsqueue.example.test",
        "JSQUEUE_HTTP__PORT": "0",
        "JSQUEUE_LOG__LEVEL": "INFO",
    }
    env.update({f"JSQUEUE_{k.upper()}": v for k, v in more.items()})
    return env


class JsqueueProcess:
    """``python -m jsqueue <command>`` as a child process with ``JSQUEUE_*`` settings.

    Output goes to ``log_file``; :meth:`wait_for_log` waits for a line to appear in it
    (for example the front end's "listening on" line that carries its port).

    Args:
        command: the CLI command and arguments, e.g. ``["up"]``.
        env: ``JSQUEUE_…`` variables (added to the current environment).
        log_file: where stdout and stderr go.
    """

    def __init__(self, command: list[str], env: Mapping[str, str], log_file: Path) -> None:
        self.command = command
        self.env = {**os.environ, **env}
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> JsqueueProcess:
        """Start the process (see :meth:`wait_for_log` for readiness)."""
        with self.log_file.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jsqueue", *self.command],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        """The child's process id.

        Raises:
            RuntimeError: not started.
        """
        if self.proc is None:
            raise RuntimeError("not started")
        return self.proc.pid

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_log(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """Wait until a line matching ``pattern`` (a regex) was written; return the match.

        Raises:
            AssertionError: the process exited or nothing matched within ``timeout_s`` s.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log()
            if m := regex.search(text):
                return m
            exited = self.proc is not None and self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                why = "exited" if exited else f"nothing within {timeout_s} s"
                tail = "\n".join(text.splitlines()[-30:])
                raise AssertionError(f"jsqueue {self.command}: {why} matching {pattern!r}\n{tail}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after ``timeout_s`` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode
