"""Configuration: environment over TOML file over defaults, the generated reference in
docs/configuration.md, secrets hidden by ``config show``, and invalid settings as one line
with exit code 2 through the real command line (a child process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_cli import cli_env, jsqueue

from jsqueue.config import (
    DestinationSettings,
    DsnSettings,
    HttpSettings,
    NatsSettings,
    Settings,
    SmarthostSettings,
    SmtpSettings,
    WorkerSettings,
    load_settings,
    setting_paths,
    settings_reference,
)
from jsqueue.envelope import routing_domain
from jsqueue.errors import ConfigError, InvalidName
from jsqueue.names import Names

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_reference_documents_every_setting() -> None:
    """Every field path of Settings (nested sections included) is in docs/configuration.md
    with its environment variable, and the file is what the generator prints today."""
    text = DOC.read_text()
    paths = setting_paths()
    assert len(paths) > 60 and "worker.smarthost.password" in paths
    for path in paths:
        assert f"| `{path}` |" in text, f"{path} is not documented"
        if path.startswith("worker.dkim.keys."):  # an element of a list: no variable of its own
            assert f"| `{path}` | in `JSQUEUE_WORKER__DKIM__KEYS` |" in text
            continue
        assert f"`JSQUEUE_{path.upper().replace('.', '__')}`" in text
    for section in Settings.model_fields:
        assert f"## `{section}`" in text
    assert text == settings_reference(), "regenerate: python -m jsqueue.config > " + str(DOC)


def test_every_setting_states_default_and_meaning() -> None:
    """Each table row has a default (or 'required'/'unset') and a meaning; durations say
    seconds in the unit column."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    assert {row.split("`")[1] for row in rows} >= set(setting_paths())
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 6, row
        path, _env, _type, default, unit, meaning = cells
        assert default and meaning, row
        if path.rstrip("`").endswith("_s"):
            assert unit == "seconds", row


async def test_env_over_toml_over_defaults_and_secrets_hidden(tmp_path: Path) -> None:
    """``config show``: the environment wins over the TOML file, which wins over defaults;
    passwords (SecretStr, and inside NATS URLs) are masked in text and JSON."""
    toml = tmp_path / "jsqueue.toml"
    toml.write_text(
        "[worker]\nmx_port = 2526\nconcurrency = 7\n"
        '[worker.smarthost]\nhost = "relay.example.test"\npassword = "toml-secret-1"\n'
        '[nats]\nurls = ["nats://ops:url-secret-2@127.0.0.1:4222"]\n'
    )
    env = cli_env(
        JSQUEUE_CONFIG=str(toml),
        JSQUEUE_WORKER__CONCURRENCY="9",
        JSQUEUE_NATS__PASSWORD="env-secret-3",
    )
    as_json = await jsqueue("config", "show", "--json", env=env)
    assert as_json.code == 0, as_json.err
    data = json.loads(as_json.out)
    assert data["worker"]["mx_port"] == 2526  # file
    assert data["worker"]["concurrency"] == 9  # environment over file
    assert data["worker"]["batch"] == 20  # default
    assert data["nats"]["urls"] == ["nats://ops:**********@127.0.0.1:4222"]
    assert data["nats"]["password"] == "**********"
    assert data["worker"]["smarthost"]["password"] == "**********"
    text = await jsqueue("config", "show", env=env)
    assert text.code == 0 and "[worker]" in text.out and "mx_port = 2526" in text.out
    for run in (as_json, text):
        for secret in ("toml-secret-1", "url-secret-2", "env-secret-3"):
            assert secret not in run.out + run.err


INVALID = [
    pytest.param(
        {"JSQUEUE_WORKER_MX_PORT": "2526"},
        None,
        r"JSQUEUE_WORKER_MX_PORT: no such setting \(did you mean JSQUEUE_WORKER__MX_PORT\?\)",
        id="env-misspelt",
    ),
    pytest.param(
        {"JSQUEUE_FOO__BAR": "1"},
        None,
        r"^jsqueue: invalid configuration: JSQUEUE_FOO__BAR: no such setting",
        id="env-unknown",
    ),
    pytest.param(
        {"JSQUEUE_SMTP__RELAY_NETWORKS": '["10.0.0.300/8"]'},
        None,
        r"smtp\.relay_networks\[0\]: Input is not a valid IPv4 network "
        r"\(from JSQUEUE_SMTP__RELAY_NETWORKS\)$",
        id="env-list-item",
    ),
    pytest.param({"JSQUEUE_WORKER__MX_PORT": "99999"}, None, r"worker\.mx_port: .*65535", id="env"),
    pytest.param(  # nats-py failed on it with a traceback when connecting
        {"JSQUEUE_NATS__URLS": '["nats://127.0.0.1:notaport"]'},
        None,
        r"nats\.urls: .*'nats://127\.0\.0\.1:notaport': the port must be a number",
        id="nats-url-port",
    ),
    pytest.param(
        {},
        '[nats]\nurls = ["nats://a:4222", "http://b:4222"]\n',
        r"nats\.urls: .*'http://b:4222': the scheme must be nats, tls, ws or wss",
        id="nats-url-scheme",
    ),
    pytest.param(
        {"JSQUEUE_NATS__URLS": '["ws://a:80", "nats://b:4222"]'},
        None,
        r"nats\.urls: .*cannot be mixed",
        id="nats-url-mixed",
    ),
    pytest.param(
        {"JSQUEUE_WORKER__TLS_POLICIES": "not-json"},
        None,
        r"worker \(JSQUEUE_WORKER__TLS_POLICIES\): not valid JSON.*a table as '\{",
        id="env-json",
    ),
    pytest.param({}, "[retry]\nbase_s = -1\n", r"retry\.base_s: .*greater than 0", id="toml"),
    pytest.param(
        {},
        "[smtp]\nprot = 25\n",
        r"smtp\.prot: no such setting \(did you mean smtp\.port\?\); see docs/configuration\.md$",
        id="toml-unknown",
    ),
    pytest.param(
        {},
        "[worker.smarthost]\nhots = 'relay.example.test'\n",
        r"worker\.smarthost\.hots: no such setting \(did you mean worker\.smarthost\.host\?\)",
        id="toml-unknown-nested",
    ),
    pytest.param(
        {},
        "[wroker]\nmx_port = 25\n",
        r"wroker: no such setting \(did you mean worker\?\)",
        id="toml-section",
    ),
    pytest.param(
        {"JSQUEUE_WORKER": '{"mx_prot": 25}'},
        None,
        r"worker\.mx_prot: no such setting \(did you mean worker\.mx_port\?\)"
        r".*\(from JSQUEUE_WORKER\)$",
        id="env-json-unknown",
    ),
    pytest.param(
        {}, "[smtp]\ninline_body_max = true\n", r"smtp\.inline_body_max: .*true/false", id="bool"
    ),
    pytest.param(
        {"JSQUEUE_WORKER__SMARTHOST__HOST": "[127.0.0.1]:2600"},
        None,
        r"worker\.smarthost\.host: .*not a host name or IP address.*without brackets.*port is",
        id="host-port",
    ),
    pytest.param(
        {}, '[http]\nhost = ""\n', r"http\.host: .*not a host name or IP address", id="empty-host"
    ),
    pytest.param(
        {"JSQUEUE_WORKER__NAMESERVERS": "resolver.example.test"},
        None,
        r"worker\.nameservers: .*not an IP address",
        id="nameserver-name",
    ),
    pytest.param(
        {"JSQUEUE_OUTBOUND_TLS__DNSSEC_NAMESERVERS": "unbound"},
        None,
        r"outbound_tls\.dnssec_nameservers: .*not an IP address",
        id="dnssec-nameserver-name",
    ),
    pytest.param(
        {"JSQUEUE_OUTBOUND_TLS__DANE": "true"},
        None,
        r"outbound_tls\.dane .*outbound_tls\.dnssec_nameservers",
        id="dane-without-resolver",
    ),
    pytest.param({}, "[worker\nmx_port = \n", r"config file .*jsqueue\.toml: ", id="toml-bad"),
    pytest.param(
        {},
        b'[smtp]\nhostname = "r\xe9lais.example.test"\n',
        r"config file .*jsqueue\.toml: not UTF-8 at line 2, column 14 \(byte 0xe9\)",
        id="toml-not-utf8",
    ),
    pytest.param(
        {},
        '[smtp]\nhostname = "mx.example.test\\r\\nX-Injected: yes"\n',
        r"smtp\.hostname: .*not a domain name: 'mx\.example\.test\\r\\nX-Injected: yes'",
        id="hostname-crlf",
    ),
    pytest.param(
        {"JSQUEUE_WORKER__EHLO_NAME": "relay.example.test\r\nRSET"},
        None,
        r"worker\.ehlo_name: .*not a domain name or address literal",
        id="ehlo-name-crlf",
    ),
    pytest.param(
        {"JSQUEUE_NATS__PREFIX": "a.b"}, None, r"nats\.prefix: .*not a name prefix", id="prefix"
    ),
    pytest.param(
        {"JSQUEUE_WORKER__OWN_NAMES": '["ok.example.test", "bad name"]'},
        None,
        r"worker\.own_names: .*not a domain name or address literal: 'bad name'",
        id="own-names",
    ),
    pytest.param(
        {"JSQUEUE_WORKER__OWN_ADDRESSES": '["192.0.2.1", "mx.example.test"]'},
        None,
        r"worker\.own_addresses: .*'mx.example.test'",
        id="own-addresses",
    ),
    pytest.param(
        {"JSQUEUE_SMTP__POSTMASTER": "ops"},
        None,
        r"smtp\.postmaster: .*not an address: 'ops'",
        id="postmaster",
    ),
    pytest.param(
        {"JSQUEUE_SMTP__POSTMASTER": "o ps@example.test"},
        None,
        r"smtp\.postmaster: .*no spaces",
        id="postmaster-space",
    ),
    pytest.param(
        {},
        '[destinations.groups]\n"google mail" = ["*.google.com"]\n',
        r"destinations\.groups: .*invalid site 'google mail'",
        id="group-name",
    ),
    pytest.param({"JSQUEUE_CONFIG": "/nonexistent/j.toml"}, None, r"not found", id="no-file"),
    pytest.param(
        {},
        "[nats]\nack_wait_s = inf\n",
        r"^jsqueue: invalid configuration: nats\.ack_wait_s: .*finite number",
        id="toml-inf",
    ),
    pytest.param(
        {"JSQUEUE_RETRY__FACTOR": "nan"},
        None,
        r"retry\.factor: .*finite number.* \(from JSQUEUE_RETRY__FACTOR\)",
        id="env-nan",
    ),
]


@pytest.mark.parametrize(("env", "toml", "message"), INVALID)
async def test_invalid_setting_is_one_line_exit_2(
    tmp_path: Path, env: dict[str, str], toml: str | bytes | None, message: str
) -> None:
    """An invalid value from the environment or a TOML file, a malformed TOML file (not
    TOML, not UTF-8) or a missing one: exit code 2, one line on stderr naming the setting
    and why, no traceback."""
    args: list[str] = []
    if toml is not None:
        path = tmp_path / "jsqueue.toml"
        if isinstance(toml, bytes):
            path.write_bytes(toml)
        else:
            path.write_text(toml)
        args = ["--config", str(path)]
    run = await jsqueue(*args, "config", "show", env=cli_env(**env))
    assert run.code == 2, (run.code, run.out, run.err)
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("jsqueue: invalid configuration: ")
    assert re.search(message, lines[0]), lines[0]
    assert run.out == ""


def test_load_settings_errors_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_settings itself raises ConfigError (never a pydantic or TOML error)."""
    monkeypatch.delenv("JSQUEUE_CONFIG", raising=False)
    monkeypatch.setenv("JSQUEUE_WORKER", "{not json")
    with pytest.raises(ConfigError, match=r"^worker \(JSQUEUE_WORKER\): not valid JSON"):
        load_settings()
    monkeypatch.delenv("JSQUEUE_WORKER")
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=f"^config file {tmp_path}: is a directory"):
        load_settings(tmp_path)
    good = tmp_path / "good.toml"
    good.write_text("[http]\nport = 0\nqueue_depth_interval_s = 0\n")
    settings = load_settings(good)
    assert settings.http.port == 0 and settings.http.queue_depth_interval_s == 0


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("relay.example.test", True),
        ("relay", True),
        ("mail_relay", True),  # not RFC 1123, but container names have it
        ("127.0.0.1", True),
        ("::1", True),
        ("", False),
        ("127.0.0.1:2600", False),
        ("[::1]", False),
        ("smtp://relay.example.test", False),
        ("999.1.1.1", False),  # RFC 1123 §2.1: never dotted-decimal unless an address
        ("-relay.example.test", False),
        ("relay example.test", False),
    ],
)
def test_host_settings_take_a_name_or_an_address(value: str, ok: bool) -> None:
    """``smtp.host``, ``http.host`` and ``worker.smarthost.host`` take a host name or an IP
    address, so that ``host:port``, a URL or an empty value fails at start, naming the
    setting, instead of at the first connection (or binding every interface)."""
    for model, values in (
        (SmarthostSettings, {"host": value}),
        (HttpSettings, {"host": value}),
        (SmtpSettings, {"host": value}),
    ):
        if ok:
            assert model.model_validate(values).host == value
        else:
            with pytest.raises(ValidationError, match="not a host name or IP address"):
                model.model_validate(values)


@pytest.mark.parametrize(
    ("value", "hostname", "ehlo_name"),
    [
        ("relay.example.test", True, True),
        ("localhost", True, True),
        ("xn--bcher-kva.example", True, True),
        ("a-1.b2.example", True, True),
        ("[192.0.2.1]", False, True),
        ("[IPv6:2001:db8::1]", False, True),
        ("[ipv6:2001:db8::1]", False, True),
        ("", False, False),
        ("relay.example.test\r\nX-Injected: yes", False, False),
        ("relay.example.test\n", False, False),
        ("relay example.test", False, False),
        ("relay.example.test.", False, False),
        ("mail_relay.example.test", False, False),  # no underscore in RFC 5321 Domain
        ("-relay.example.test", False, False),
        ("relay-.example.test", False, False),
        ("a..example.test", False, False),
        ("a" * 64 + ".example.test", False, False),
        ("bücher.example", False, False),  # U-labels as xn--
        ("192.0.2.1", False, False),  # an address only as a literal
        ("[2001:db8::1]", False, False),
        ("[IPv6:192.0.2.1]", False, False),
        ("[IPv6:fe80::1%eth0]", False, False),
        ("[192.0.2.300]", False, False),
        ("[192.0.2.1]\r\n", False, False),
    ],
)
def test_our_smtp_names_are_domains(value: str, hostname: bool, ehlo_name: bool) -> None:
    """``smtp.hostname`` (greeting, EHLO reply, Received:) is an RFC 5321 §4.1.2 Domain;
    ``worker.ehlo_name`` a Domain or an address literal (§4.1.3). Anything else, a CR LF
    above all (a reply line without a code, a header line in every Received: field), fails
    at load, naming the setting."""
    for model, values, ok in (
        (SmtpSettings, {"hostname": value}, hostname),
        (WorkerSettings, {"ehlo_name": value}, ehlo_name),
    ):
        if ok:
            assert model.model_validate(values).model_dump()[next(iter(values))] == value
        else:
            with pytest.raises(ValidationError, match="not a domain name"):
                model.model_validate(values)


@pytest.mark.parametrize("prefix", ["jsq", "t-1_x", "a" * 32, "a.b", "a b", "A", "1a", "", "a>"])
def test_nats_prefix_is_checked_at_load_as_names_does(prefix: str) -> None:
    """``nats.prefix`` takes exactly what :class:`~jsqueue.names.Names` takes, so a bad one
    fails at load naming the setting, not at the first NATS request."""
    try:
        Names(prefix)
    except InvalidName:
        with pytest.raises(ValidationError, match="not a name prefix"):
            NatsSettings(prefix=prefix)
    else:
        assert NatsSettings(prefix=prefix).prefix == prefix
    with pytest.raises(ValidationError):
        NatsSettings(prefix="a" * 33)


def test_a_list_setting_takes_a_bare_comma_separated_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``JSQUEUE_SMTP__RELAY_NETWORKS=10.0.0.0/8`` is one network, not a JSON error; a
    comma-separated value is a list; JSON still works."""
    monkeypatch.delenv("JSQUEUE_CONFIG", raising=False)
    monkeypatch.setenv("JSQUEUE_SMTP__RELAY_NETWORKS", "10.0.0.0/8")
    assert [str(n) for n in load_settings().smtp.relay_networks] == ["10.0.0.0/8"]
    monkeypatch.setenv("JSQUEUE_SMTP__RELAY_NETWORKS", "10.0.0.0/8, 192.0.2.0/24")
    assert [str(n) for n in load_settings().smtp.relay_networks] == ["10.0.0.0/8", "192.0.2.0/24"]
    monkeypatch.setenv("JSQUEUE_NATS__URLS", '["nats://a:4222", "nats://b:4222"]')
    assert load_settings().nats.urls == ["nats://a:4222", "nats://b:4222"]


def test_every_known_variable_is_accepted_and_an_unknown_one_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each setting's own variable passes the check; a name between them does not."""
    from jsqueue.config import env_names

    names = env_names()
    assert {"JSQUEUE_WORKER__MX_PORT", "JSQUEUE_WORKER__SMARTHOST__HOST", "JSQUEUE_NATS"} <= names
    monkeypatch.delenv("JSQUEUE_CONFIG", raising=False)
    monkeypatch.setenv("jsqueue_worker__mx_port", "2526")  # names are not case-sensitive
    assert load_settings().worker.mx_port == 2526
    monkeypatch.setenv("JSQUEUE_WORKER__SMARTHOST__PORTS", "25")
    with pytest.raises(ConfigError, match=r"^JSQUEUE_WORKER__SMARTHOST__PORTS: no such setting"):
        load_settings()


def test_the_dedupe_window_is_no_longer_than_the_delete_marker_lives() -> None:
    """A resend of a message delivered meanwhile is known as a copy by its entry's delete
    marker (RFC 5321 §6.1): a window longer than the marker's life would queue it again, so
    the setting stops at that life, and a longer value is one line naming it."""
    from jsqueue.config.sections import DEDUPE_WINDOW_MAX_S
    from jsqueue.store.jetstream.entries import DELETE_MARKER_TTL_S

    assert DEDUPE_WINDOW_MAX_S == DELETE_MARKER_TTL_S
    assert SmtpSettings(dedupe_window_s=DEDUPE_WINDOW_MAX_S).dedupe_window_s == 900
    with pytest.raises(ValidationError, match="dedupe_window_s"):
        SmtpSettings(dedupe_window_s=DEDUPE_WINDOW_MAX_S + 1)


def test_per_site_settings_and_groups_are_keyed_in_lower_case() -> None:
    """Sites are kept under lower-case names (domains are, and ``dest show`` and the HTTP
    API fold case), so a per-site setting written ``Example.TEST`` applies to
    ``example.test`` and a group ``Google`` is the site ``google``; two keys that differ
    only in case are refused, as one of them would be lost."""
    d = DestinationSettings(
        site_sessions={"Example.TEST": 3},
        site_message_rates={"[IPv6:2001:DB8::1]": "5/s"},
        groups={"Google": ["*.google.com"]},
    )
    assert d.sessions_of("example.test") == 3
    assert d.message_rate_of(routing_domain("u@[IPv6:2001:db8::1]")) == (5, 1.0)
    assert list(d.groups) == ["google"]
    with pytest.raises(ValidationError, match="differ only in case"):
        DestinationSettings(site_sessions={"a.test": 2, "A.test": 3})


def test_own_names_may_end_in_a_dot() -> None:
    """``worker.own_names`` are only compared with what next hops send (case and a final
    dot ignored), so ``MX2.Example.Test.`` is taken as written."""
    names = ["MX2.Example.Test.", "[192.0.2.1]"]
    assert WorkerSettings(own_names=names).own_names == names


def test_own_addresses_are_kept_in_their_normal_form() -> None:
    """``worker.own_addresses`` are compared with MX addresses as IP addresses: an
    IPv4-mapped one is its IPv4 address, an IPv6 one is compressed, white space dropped."""
    given = [" ::ffff:192.0.2.1", "2001:DB8:0:0::25"]
    assert WorkerSettings(own_addresses=given).own_addresses == ["192.0.2.1", "2001:db8::25"]


def test_the_front_end_takes_the_dsn_postmaster_when_it_has_none() -> None:
    """RFC 5321 §4.5.1: ``<Postmaster>`` goes to ``smtp.postmaster``, else to the
    ``dsn.postmaster`` an operator set for double bounces; with neither it stays unset
    (and the front end refuses it)."""
    dsn = DsnSettings(postmaster="pm@example.test")
    assert Settings(dsn=dsn).front_end().postmaster == "pm@example.test"
    own = SmtpSettings(postmaster="ops@example.test")
    assert Settings(smtp=own, dsn=dsn).front_end().postmaster == "ops@example.test"
    assert Settings().front_end().postmaster == ""


def test_no_numeric_setting_takes_an_infinity_or_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOML and pydantic read ``inf``/``nan``; no setting means anything by them (``0`` is
    "off" where a setting can be off), and they broke the process later, far from the
    setting (an infinite ``nats.ack_wait_s`` was an OverflowError traceback while the
    consumer was provisioned): every int or float setting refuses them at load, naming
    itself."""
    monkeypatch.delenv("JSQUEUE_CONFIG", raising=False)
    defaults = Settings()
    numeric = []
    for path in setting_paths():
        value: object = defaults
        for part in path.split("."):
            value = getattr(value, part, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            numeric.append(path)
    assert {"nats.ack_wait_s", "smtp.session_timeout_s", "retry.factor"} <= set(numeric)
    for path in numeric:
        name = "JSQUEUE_" + path.upper().replace(".", "__")
        for bad in ("inf", "-inf", "nan", "Infinity"):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: "):
                load_settings()
        monkeypatch.delenv(name)
