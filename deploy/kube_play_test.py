"""The container deployment played for real: image, k8s/ manifests, NATS cluster, kill -9.

``make deploy-test`` (part of ``make test``), as root: rootful podman. Each step prints
``deploy: <step> <seconds> s``:

1. podman, runc and debootstrap from Debian when missing; podman's configuration and store
   under WORK (runc, cgroupfs, no systemd, registries blocked: nothing is ever pulled).
2. The Dockerfile's base without a registry: ``debootstrap --variant=minbase bookworm`` from
   the mirror apt uses, imported and tagged as the Dockerfile's FROM (python 3.11, as
   bookworm's). Kept as a cache while its package list is the same (``rm -r WORK`` drops it).
3. The repository's Dockerfile, unmodified (pip in the build is configured as the host's).
4. ``k8s/`` played with ``podman kube play`` (``manifests.py``: what podman plays
   differently, one function each): three NATS servers as ``k8s/nats-values.yaml`` makes
   the NATS chart configure them, the front end and worker Deployments with their
   ConfigMaps and Secrets, and a sink MX the workers relay to, on a podman network of
   static addresses.
5. Mail from the host through the front ends; ``kill -9`` of the NATS server leading the
   most streams, of a worker and of a front end; more mail. Checks: every message answered
   250 reaches the sink once and in time, the probe endpoints answer, the killed
   containers come back (podman's restart policy from the pods' restartPolicy).
6. Everything made is removed by name, also at the start after an interrupted run; the
   base image stays (the cache), and so does the pause image podman builds for its pods.

Traffic stays on this machine: the host talks to the pods over the podman bridge (checked
before the first packet), the pods' DNS is their own loopback and nothing is configured to
reach further than the sink. Exit status 1 with one ``deploy: FAIL <reason>`` line per
failed check. ``JSQUEUE_DEPLOY_TEST=skip`` skips the test (machines without root).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import email
import functools
import json
import os
import shutil
import signal
import smtplib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import manifests
import yaml
from manifests import ADDRESSES, NATS_PODS, SINK_POD, SMTP_PORT, Obj, name_of

KUBECTL = Path(sys.executable).parent / "kubectl"
#: Everything the test keeps on disk: podman's configuration and store (with the base image
#: cache), and FILES, made afresh by each run (rendered manifests, Secret files, the mail).
WORK = Path(os.environ.get("JSQUEUE_DEPLOY_DIR", "/var/tmp/jsqueue-deploy"))
FILES = WORK / "files"
SINK_MAIL = FILES / "sink"

PYTHON_VERSION = "3.11"  # bookworm's: the base image's tag says what it holds
BASE_IMAGE = f"localhost/python:{PYTHON_VERSION}-slim-bookworm"
#: What the Dockerfile needs in its base: python with venv and pip, groupadd/useradd, CAs.
BASE_PACKAGES = ("python3", "python3-venv", "passwd", "ca-certificates")
BASE_LABEL = "jsqueue.deploy-test.base-packages"
IMAGE = "localhost/jsqueue:deploy-test"
NETWORK = "jsqueue-deploy"
SECRETS = ("jsqueue-nats", "jsqueue-smtp-auth", "jsqueue-smtp-tls", "jsqueue-dkim")
IMAGE_USER = 10001  # the Dockerfile's USER

HTTP_PORT = 9125  # jsqueue's /healthz and /readyz (configmap.yaml)
NATS_MONITOR_PORT = 8222  # nats-values.yaml
#: The front end whose ``jsqueue queue`` commands look into the queue (never killed).
ADMIN_POD = "jsqueue-smtp-1"

#: Messages sent before the kills, during the recovery, and once the killed pods are back.
BATCHES = (60, 90, 30)
SENDER_THREADS = 4
#: How long a client keeps trying one message (4xx, lost connections), seconds.
SEND_DEADLINE_S = 120.0
READY_TIMEOUT_S = 180.0
RECOVERY_TIMEOUT_S = 120.0
#: A message may take this long from its 250 to the sink: a crashed worker's message comes
#: back after the consumer's ack wait (ack_wait_s 60 s, configmap.yaml), then goes, seconds.
MAX_DELIVERY_DELAY_S = 90.0
#: Watch the sink at least this long after the worker's kill: a duplicate from its
#: unacknowledged work would show after the ack wait, seconds.
DUPLICATE_WATCH_S = 75.0
#: A duplicate is explained by the worker's kill when the killed worker delivered the first
#: copy at most this long before it: recording the 250 can wait that long on a NATS stream
#: whose leader was killed at the same moment, seconds.
CRASH_WINDOW_S = 30.0
#: How long the test waits for the last deliveries (a late one is then reported), seconds.
DELIVERY_TIMEOUT_S = 360.0


class DeployError(Exception):
    """A step that cannot go on; the message is the one-line reason."""


# ---- running things -----------------------------------------------------------------------


def podman_env() -> dict[str, str]:
    """podman's environment: configuration and store under WORK, no systemd timers."""
    return dict(
        os.environ,
        CONTAINERS_CONF=str(WORK / "etc/containers.conf"),
        CONTAINERS_STORAGE_CONF=str(WORK / "etc/storage.conf"),
        CONTAINERS_REGISTRIES_CONF=str(WORK / "etc/registries.conf"),
        DISABLE_HC_SYSTEMD="true",
    )


def run(
    *args: str | Path, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command and capture its output.

    Raises:
        DeployError: it failed and ``check`` is set (with the tail of its stderr).
    """
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DeployError(f"{' '.join(map(str, args[:3]))} exited {proc.returncode}: {tail}")
    return proc


def podman(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run podman with the test's configuration (errors as in ``run``)."""
    return run("podman", *args, check=check, env=podman_env())


@contextlib.contextmanager
def step(name: str) -> Iterator[list[str]]:
    """Print ``deploy: <name> (<notes>) <seconds> s`` when the step ends, failed or not;
    the notes are what the block appends to the list it gets."""
    start = time.monotonic()
    notes: list[str] = []
    try:
        yield notes
    finally:
        detail = f" ({', '.join(notes)})" if notes else ""
        print(f"deploy: {name}{detail} {time.monotonic() - start:.1f} s", flush=True)


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``ok`` twice a second.

    Raises:
        DeployError: it stayed false for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise DeployError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)


# ---- 1. packages, podman's configuration --------------------------------------------------

#: path:package, installed in one go when a path is missing.
PACKAGES = ("/usr/bin/podman:podman", "/usr/sbin/runc:runc", "/usr/sbin/debootstrap:debootstrap")


def install_packages() -> None:
    """apt-get install what is missing; a policy-rc.d (only while there is none) keeps
    services from starting, as in the Makefile's ``tools`` target."""
    missing = sorted({p.split(":")[1] for p in PACKAGES if not Path(p.split(":")[0]).exists()})
    if not missing:
        return
    rcd = Path("/usr/sbin/policy-rc.d")
    made = not rcd.exists()
    if made:
        rcd.write_text("#!/bin/sh\nexit 101\n")
        rcd.chmod(0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run("apt-get", "update", "-qq", env=env)
        run("apt-get", "install", "-y", "-qq", *missing, env=env)
    finally:
        if made:
            rcd.unlink()


def write_podman_config() -> None:
    """Rootful podman as it works on these machines: runc (crun refuses the hybrid cgroup
    layout), cgroupfs (no systemd), ulimits root may set (no CAP_SYS_RESOURCE; conmon's
    nproc is 32768); store under WORK; no registry reachable, so nothing is pulled."""
    etc = WORK / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "containers.conf").write_text(
        "[containers]\n"
        'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'static_dir = "{WORK}/storage/libpod"\n'
        f'tmp_dir = "{WORK}/podman-run/libpod"\n'
        f'volume_path = "{WORK}/storage/volumes"\n\n'
        "[network]\n"
        'network_backend = "netavark"\n'
        f'network_config_dir = "{WORK}/etc/networks"\n'
    )
    (etc / "storage.conf").write_text(
        "[storage]\n"
        'driver = "overlay"\n'
        f'graphroot = "{WORK}/storage"\n'
        f'runroot = "{WORK}/podman-run/storage"\n'
    )
    (etc / "registries.conf").write_text(
        "unqualified-search-registries = []\n"
        'short-name-mode = "disabled"\n\n'
        '[[registry]]\nlocation = "docker.io"\nblocked = true\n\n'
        '[[registry]]\nlocation = "quay.io"\nblocked = true\n'
    )


# ---- 2. base image ------------------------------------------------------------------------


def apt_mirror() -> str:
    """The Debian mirror apt already uses for bookworm (deb822 ``.sources`` or ``.list``).

    Raises:
        DeployError: there is none.
    """
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in filter(Path.is_file, files):
        if path.name.endswith(".sources"):
            for paragraph in path.read_text().split("\n\n"):
                fields = {
                    key.strip(): value.split()
                    for key, _, value in (line.partition(":") for line in paragraph.splitlines())
                    if value and not key.startswith(("#", " "))
                }
                if "deb" in fields.get("Types", []) and "bookworm" in fields.get("Suites", []):
                    return fields["URIs"][0]
        elif path.name.endswith(".list"):
            for line in path.read_text().splitlines():
                words = [w for w in line.split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb" and words[2] == "bookworm":
                    return words[1]
    raise DeployError("no Debian bookworm mirror in /etc/apt/sources.list{,.d/*}")


def base_image() -> str:
    """The Dockerfile's base from debootstrap and ``podman import``, unless the cached one
    holds the same packages. Returns "cached" or "built".

    Raises:
        DeployError: debootstrap or the import failed.
    """
    wanted = ",".join(BASE_PACKAGES)
    label = podman("image", "inspect", "--format", "{{json .Labels}}", BASE_IMAGE, check=False)
    if label.returncode == 0 and (json.loads(label.stdout) or {}).get(BASE_LABEL) == wanted:
        return "cached"
    rootfs = WORK / "base-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    mirror = apt_mirror()
    run("debootstrap", "--variant=minbase", f"--include={wanted}", "bookworm", rootfs, mirror)
    # The Dockerfile runs `python -m venv`, the name the python images give their python.
    (rootfs / "usr/local/bin/python").symlink_to("/usr/bin/python3")
    for leftover in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        leftover.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    changes = [
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        f"LABEL {BASE_LABEL}={wanted}",
        'CMD ["python3"]',
    ]
    imported = subprocess.run(
        ["podman", "import", *(f"--change={c}" for c in changes), "-", BASE_IMAGE],
        stdin=tar.stdout,
        capture_output=True,
        text=True,
        env=podman_env(),
    )
    tar.wait()
    shutil.rmtree(rootfs)
    if tar.returncode or imported.returncode:
        raise DeployError(f"podman import of the base image: {imported.stderr.strip()}")
    return "built"


# ---- 3. the image -------------------------------------------------------------------------

#: The host's pip settings the build's pip needs too: where the index is and how to trust it
#: (file:// locations are left out: they are not inside the build).
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host", "cert", "proxy", "timeout")


def host_pip_settings() -> dict[str, str]:
    """``pip config list`` of the host: its files, then PIP_* variables (which win)."""
    listed = run(sys.executable, "-m", "pip", "config", "list").stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        key = "timeout" if key == "default-timeout" else key
        if key in PIP_KEYS and section in ("global", "install", ":env:"):
            (env if section == ":env:" else files)[key] = value.strip("'\"")
    settings = files | env
    for key in ("index-url", "extra-index-url"):
        urls = [u for u in settings.pop(key, "").split() if u.startswith(("http:", "https:"))]
        if urls:
            settings[key] = " ".join(urls)
    return settings


def build_image() -> None:
    """``podman build`` of the unmodified Dockerfile. Its pip gets the host's settings as a
    mounted /etc/pip.conf (and the host's CA file beside it); RUN steps use the host's
    network, so they reach the index as the host's pip does (HTTP proxy variables pass
    through by default).

    Raises:
        DeployError: the build failed.
    """
    settings = host_pip_settings()
    mounts = []
    if "cert" in settings:
        mounts.append(f"--volume={settings['cert']}:/etc/pip-build/ca.crt:ro")
        settings["cert"] = "/etc/pip-build/ca.crt"
    pip_conf = FILES / "pip.conf"
    pip_conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    mounts.append(f"--volume={pip_conf}:/etc/pip.conf:ro")
    arg = f"--build-arg=PYTHON_VERSION={PYTHON_VERSION}"
    podman(
        "build", "--pull=never", "--network=host", *mounts, arg, f"--tag={IMAGE}", manifests.REPO
    )


# ---- 4. the pods --------------------------------------------------------------------------


@dataclass
class Cluster:
    """The pods as played: their containers by pod name, and the two Deployments' pods."""

    containers: dict[str, str]  # pod -> its container (kube play names it <pod>-<name>)
    frontends: list[str]
    workers: list[str]

    @classmethod
    def of(cls, objects: list[Obj]) -> Cluster:
        pods = [obj for obj in objects if obj["kind"] == "Pod"]
        return cls(
            containers={
                name_of(pod): f"{name_of(pod)}-{manifests.containers(pod)[0]['name']}"
                for pod in pods
            },
            frontends=[name_of(p) for p in pods if name_of(p).startswith("jsqueue-smtp-")],
            workers=[name_of(p) for p in pods if name_of(p).startswith("jsqueue-worker-")],
        )

    @property
    def pods(self) -> list[str]:
        return list(self.containers)

    def inspect(self, pod: str, template: str) -> str:
        return podman("inspect", "--format", template, self.containers[pod]).stdout.strip()


def objects_to_play(password: str) -> tuple[list[Obj], dict[str, Obj], list[str]]:
    """The pods and ConfigMaps to play, the Secrets, and what podman cannot play.

    Raises:
        DeployError: a pod has no address in ADDRESSES.
    """
    rendered = run(KUBECTL, "kustomize", manifests.K8S).stdout
    secrets = manifests.secrets(password)
    jsqueue, skipped = manifests.jsqueue_objects(
        [doc for doc in yaml.safe_load_all(rendered) if doc], IMAGE, secrets, FILES / "secrets"
    )
    values = yaml.safe_load((manifests.K8S / "nats-values.yaml").read_text())
    objects = [
        *manifests.nats_objects(values, IMAGE),
        manifests.sink_pod(IMAGE, SINK_MAIL),
        *jsqueue,
    ]
    pods = {name_of(obj) for obj in objects if obj["kind"] == "Pod"}
    if pods - ADDRESSES.keys():
        raise DeployError(f"no address for pods {sorted(pods - ADDRESSES.keys())}")
    return objects, secrets, skipped


def play(objects: list[Obj], secrets: dict[str, Obj]) -> None:
    """The network, the Secrets, then every pod, created stopped (kube play shares one
    volume per ConfigMap and rewrites it as it creates each pod: none may run meanwhile).

    Raises:
        DeployError: podman refused something.
    """
    # Not --internal: an internal network gives the host no address to reach the pods by.
    podman("network", "create", "--disable-dns", f"--subnet={manifests.SUBNET}", NETWORK)
    for secret in secrets.values():
        # podman 4.3's secretKeyRef reads a podman secret holding a JSON object of base64
        # values (kube play of a Secret document stores YAML, which it cannot parse).
        path = FILES / f"secret-{name_of(secret)}.json"
        path.write_text(json.dumps(secret["data"]))
        podman("secret", "create", name_of(secret), path)
    manifest = FILES / "kube.yaml"
    manifest.write_text(manifests.dump(objects))
    pods = [name_of(obj) for obj in objects if obj["kind"] == "Pod"]
    addresses = [f"--ip={ADDRESSES[pod]}" for pod in pods]  # in the order of the pods
    podman("kube", "play", "--start=false", f"--network={NETWORK}", *addresses, manifest)


def check_route_to_pods() -> None:
    """The host must reach the pods over the network's bridge, which gets its address with
    the first running pod; before that, their addresses would go out by the default route.

    Raises:
        DeployError: an address is not routed over the bridge.
    """
    bridge = podman("network", "inspect", "--format", "{{.NetworkInterface}}", NETWORK)
    for pod, address in ADDRESSES.items():
        route = run("ip", "-o", "route", "get", address).stdout.split()
        if route[route.index("dev") + 1] != bridge.stdout.strip():
            raise DeployError(f"{pod} {address} not routed over the bridge: {' '.join(route)}")


def logs_tail(lines: int = 15) -> None:
    """The last lines of every container's log, on stderr (after a failure)."""
    names = podman("ps", "--all", "--format={{.Names}}", check=False).stdout.split()
    for container in (name for name in names if not name.endswith("-infra")):
        out = podman("logs", f"--tail={lines}", container, check=False)
        print(f"---- {container}\n{out.stdout}{out.stderr}", file=sys.stderr)


def cleanup(pods: list[str]) -> None:
    """Remove by name what a run makes (an interrupted run's too): pods, Secrets, network,
    the image, the build's untagged layers, FILES. Volumes: those of ConfigMaps, claims and
    emptyDirs; the store under WORK holds no others, so all of its volumes go."""
    for pod in pods:
        podman("pod", "rm", "--force", "--time=0", pod, check=False)
    for volume in podman("volume", "ls", "--quiet", check=False).stdout.split():
        podman("volume", "rm", "--force", volume, check=False)
    for secret in SECRETS:
        podman("secret", "rm", secret, check=False)
    podman("network", "rm", "--force", NETWORK, check=False)
    podman("rmi", "--force", IMAGE, check=False)
    podman("image", "prune", "--force", check=False)
    shutil.rmtree(FILES, ignore_errors=True)


# ---- probes -------------------------------------------------------------------------------


def http_status(url: str) -> int | None:
    """The status of a GET, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def endpoints(pod: str) -> list[str]:
    """A pod's probe endpoints: NATS's /healthz on the monitor port (the chart's probes),
    jsqueue's /healthz and /readyz on its http port (the manifests' probes)."""
    if pod in NATS_PODS:
        return [f"http://{ADDRESSES[pod]}:{NATS_MONITOR_PORT}/healthz"]
    if pod.startswith("jsqueue-"):
        return [f"http://{ADDRESSES[pod]}:{HTTP_PORT}/{path}" for path in ("healthz", "readyz")]
    return []


def silent(pods: list[str]) -> list[str]:
    """The endpoints of these pods that do not answer 200."""
    return [url for pod in pods for url in endpoints(pod) if http_status(url) != 200]


def sink_listens() -> bool:
    with (
        contextlib.suppress(OSError),
        socket.create_connection((ADDRESSES[SINK_POD], SMTP_PORT), timeout=2),
    ):
        return True
    return False


def stream_leaders() -> collections.Counter[str]:
    """How many JetStream streams each NATS server leads (the monitor's /jsz)."""
    for pod in NATS_PODS:
        url = f"http://{ADDRESSES[pod]}:{NATS_MONITOR_PORT}/jsz?accounts=true&streams=true"
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=5) as r:
            return collections.Counter(
                stream["cluster"]["leader"]
                for account in json.load(r).get("account_details", [])
                for stream in account.get("stream_detail", [])
                if stream.get("cluster", {}).get("leader")
            )
    return collections.Counter()


# ---- 5. mail, kills, checks ---------------------------------------------------------------

SENDER = "deploy-test@client.example"
RECIPIENT = "someone@example.net"


@dataclass
class Client:
    """SMTP clients on threads, and what they saw per attempt ``<message>.<attempt>`` (its
    tag, in the X-Deploy-Tag field)."""

    frontends: list[str]
    accepted: dict[str, tuple[str, float]] = field(default_factory=dict)  # tag: queue id, when
    lost_in_data: set[str] = field(default_factory=set)  # connection lost during DATA
    refused_after_data: dict[str, str] = field(default_factory=dict)  # tag: reply
    unsent: dict[int, str] = field(default_factory=dict)  # message: last error
    retried: collections.Counter[str] = field(default_factory=collections.Counter)  # why
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, number: int) -> None:
        """One message as a client sends it: on a 4xx or a lost connection, again (at the
        other front end) until SEND_DEADLINE_S; a 5xx ends it."""
        deadline = time.monotonic() + SEND_DEADLINE_S
        attempt, last = 0, "no attempt"
        while time.monotonic() < deadline:
            attempt += 1
            tag = f"{number}.{attempt}"
            host = ADDRESSES[self.frontends[(number + attempt) % len(self.frontends)]]
            body = (
                f"From: <{SENDER}>\r\nTo: <{RECIPIENT}>\r\nSubject: deploy test {number}\r\n"
                f"X-Deploy-Tag: {tag}\r\n\r\nmessage {number}\r\n"
            )
            in_data = False
            try:
                with smtplib.SMTP(host, SMTP_PORT, "client.example", timeout=30) as smtp:
                    smtp.ehlo()
                    code, text = smtp.mail(SENDER)
                    if code == 250:
                        code, text = smtp.rcpt(RECIPIENT)
                    if code == 250:
                        in_data = True
                        code, text = smtp.data(body)
                    last = f"{code} {text.decode(errors='replace')}"
                    with self.lock:
                        if code == 250:  # "250 2.0.0 queued as <id>"
                            self.accepted[tag] = (last.split()[-1], time.time())
                            return
                        if in_data:
                            self.refused_after_data[tag] = last
                        self.retried[f"{code} {'after DATA' if in_data else 'before DATA'}"] += 1
                    if code >= 500:
                        break
            except smtplib.SMTPResponseException as e:  # 421 greeting, DATA refused
                last = f"{e.smtp_code} {e.smtp_error.decode(errors='replace')}"
                with self.lock:
                    self.retried[f"{e.smtp_code} before DATA"] += 1
                if e.smtp_code >= 500:
                    break
            except (OSError, smtplib.SMTPException) as e:  # the connection, lost or refused
                last = f"{host}: {e!r}"
                with self.lock:
                    self.retried[type(e).__name__] += 1
                    if in_data:
                        self.lost_in_data.add(tag)
            time.sleep(0.5)
        with self.lock:
            self.unsent[number] = last

    def send_all(self, numbers: range) -> list[threading.Thread]:
        """Send these messages on SENDER_THREADS threads; returns them, started."""
        todo = list(numbers)
        lock = threading.Lock()

        def loop() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    number = todo.pop(0)
                self.send(number)

        threads = [threading.Thread(target=loop) for _ in range(SENDER_THREADS)]
        for thread in threads:
            thread.start()
        return threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


@dataclass
class Kill:
    pod: str
    restarts_before: int
    at: float  # time.time()


def kill9(cluster: Cluster, pod: str) -> Kill:
    """SIGKILL to the container's main process from the host: a crash or an OOM kill, not
    a stop, so podman's restart policy applies."""
    restarts = int(cluster.inspect(pod, "{{.RestartCount}}"))
    os.kill(int(cluster.inspect(pod, "{{.State.Pid}}")), signal.SIGKILL)
    return Kill(pod, restarts, time.time())


def came_back(cluster: Cluster, kill: Kill) -> bool:
    """Restarted by podman, running, and its endpoints answer."""
    status, restarts = cluster.inspect(kill.pod, "{{.State.Status}} {{.RestartCount}}").split()
    return status == "running" and int(restarts) > kill.restarts_before and not silent([kill.pod])


@dataclass
class Delivery:
    tag: str
    peer: str  # the worker's address
    at: float


def deliveries() -> list[Delivery]:
    """Every message the sink stored, oldest first."""
    found = []
    for path in SINK_MAIL.glob("*.eml"):
        message = email.message_from_bytes(path.read_bytes())
        found.append(
            Delivery(message["X-Deploy-Tag"], message["X-Sink-Peer"], float(message["X-Sink-Time"]))
        )
    return sorted(found, key=lambda d: d.at)


def queue_state(cluster: Cluster, queue_id: str) -> str:
    """An entry as ``jsqueue queue show`` (in a front end) sees it, in one line: state,
    attempts, next attempt, last reply, leases."""
    command = ("jsqueue", "queue", "show", "--json", queue_id)
    shown = podman("exec", cluster.containers[ADMIN_POD], *command, check=False)
    try:
        entry = json.loads(shown.stdout)
    except ValueError:
        return f"{queue_id}: {shown.stderr.strip()[:100]}"
    recipient = entry["recipients"][0]
    reply = recipient["last_reply"] or {}
    leases = [
        f"{lease['owner']} until {lease['until']}" for lease in (entry["leases"] or {}).values()
    ]
    return (
        f"queue id {queue_id} {entry['state']}, attempts {recipient['attempts']}, next "
        f"{recipient['next_attempt_at']}, last reply {reply.get('code')} "
        f"{reply.get('enhanced')} {reply.get('text', '')[:160]!r}, leases {leases or 'none'}"
    )


def pod_at(address: str) -> str:
    """The pod of an address."""
    return {ip: pod for pod, ip in ADDRESSES.items()}.get(address, address)


def check_deliveries(cluster: Cluster, client: Client, worker_kill: Kill) -> list[str]:
    """Each 250 delivered once and within MAX_DELIVERY_DELAY_S; failures as one-liners. A
    duplicate whose first copy the killed worker delivered shortly before its kill is
    reported, not failed: a crash between the remote 250 and the record, which SMTP cannot
    close (RFC 5321 §6.1)."""
    accepted = set(client.accepted)
    overdue: dict[str, str] = {}  # tag: the queue's word on it when it became late
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while time.monotonic() < deadline:
        waiting = accepted - {d.tag for d in deliveries()}
        for tag in waiting - overdue.keys():
            if time.time() > client.accepted[tag][1] + MAX_DELIVERY_DELAY_S:
                overdue[tag] = queue_state(cluster, client.accepted[tag][0])
        if not waiting and time.time() > worker_kill.at + DUPLICATE_WATCH_S:
            break
        time.sleep(1.0)
    copies: dict[str, list[Delivery]] = collections.defaultdict(list)
    for delivery in deliveries():
        copies[delivery.tag].append(delivery)
    failures = []
    if lost := sorted(accepted - copies.keys()):
        failures.append(
            f"{len(lost)} of {len(accepted)} messages answered 250 not delivered after "
            f"{DELIVERY_TIMEOUT_S:.0f} s (worker {worker_kill.pod} killed "
            f"{time.strftime('%H:%M:%S', time.gmtime(worker_kill.at))}): "
            f"{[queue_state(cluster, client.accepted[tag][0]) for tag in lost[:3]]}"
        )
    delays = {tag: copies[tag][0].at - client.accepted[tag][1] for tag in accepted & copies.keys()}
    late = sorted((t for t in delays if delays[t] > MAX_DELIVERY_DELAY_S), key=delays.__getitem__)
    if late:
        details = [
            f"{tag} after {delays[tag]:.0f} s (answered "
            f"{client.accepted[tag][1] - worker_kill.at:+.1f} s from the kills, delivered by "
            f"{pod_at(copies[tag][0].peer)}; when late: {overdue.get(tag, '-')})"
            for tag in reversed(late[-3:])
        ]
        failures.append(
            f"{len(late)} messages delivered more than {MAX_DELIVERY_DELAY_S:.0f} s after their "
            f"250: {'; '.join(details)}"
        )
    explained: list[str] = []
    unexplained: list[str] = []
    for tag, found in copies.items():
        if len(found) > 1:
            first = found[0]
            before_kill = worker_kill.at - first.at
            if first.peer == ADDRESSES[worker_kill.pod] and 0 <= before_kill <= CRASH_WINDOW_S:
                explained.append(f"{tag} ({before_kill:.1f} s before)")
            else:
                unexplained.append(tag)
    if explained:
        print(
            f"deploy: note: {len(explained)} duplicates whose first copy the killed worker "
            f"delivered shortly before its kill, between the remote 250 and its record: "
            f"{explained}"
        )
    if unexplained:
        failures.append(f"{len(unexplained)} messages delivered more than once: {unexplained[:5]}")
    if refused := sorted(set(client.refused_after_data) & copies.keys()):
        replies = [(tag, client.refused_after_data[tag]) for tag in refused[:3]]
        failures.append(
            f"{len(refused)} messages refused after DATA were delivered (a client sends them "
            f"again: duplicates): {replies}"
        )
    if client.unsent:
        failures.append(
            f"{len(client.unsent)} messages without a 250 within {SEND_DEADLINE_S:.0f} s: "
            f"{list(client.unsent.items())[:2]}"
        )
    resent = len(client.lost_in_data & copies.keys())
    print(
        f"deploy: {len(accepted)} messages answered 250, {sum(map(len, copies.values()))} "
        f"deliveries; {len(client.lost_in_data)} attempts lost their connection during DATA, "
        f"{resent} of them delivered as well (the client had sent the message again); "
        f"attempts retried: {dict(client.retried) or 'none'}",
        flush=True,
    )
    return failures


# ---- the whole run ------------------------------------------------------------------------


def deploy_and_check(failures: list[str]) -> None:
    """Steps 2 to 5. Checks that fail are appended to ``failures`` and the run goes on.

    Raises:
        DeployError: a step cannot go on.
    """
    with step("base image") as note:
        note.append(base_image())
    with step("build image"):
        build_image()
    with step("render k8s/, kube play") as note:
        # As k8s/README.md makes it (openssl rand -base64 32): NATS parses the password.
        password = base64.b64encode(os.urandom(32)).decode()
        objects, secrets, skipped = objects_to_play(password)
        cluster = Cluster.of(objects)
        play(objects, secrets)
        note.append(f"{len(cluster.pods)} pods")
        print(f"deploy: not played by podman, schema-checked only: {', '.join(skipped)}")
    frontends, workers = cluster.frontends, cluster.workers
    with step("start pods until every endpoint answers"):
        podman("pod", "start", *NATS_PODS, SINK_POD)
        check_route_to_pods()
        wait_until("NATS /healthz", lambda: not silent(list(NATS_PODS)), READY_TIMEOUT_S)
        wait_until("sink MX", sink_listens, READY_TIMEOUT_S)
        podman("pod", "start", *frontends, *workers)
        wait_until("jsqueue /readyz", lambda: not silent(frontends + workers), READY_TIMEOUT_S)
    client = Client(frontends)
    before, during, after = BATCHES
    with step(f"send {before} messages"):
        join(client.send_all(range(before)))
    leaders = stream_leaders()
    if not leaders:
        raise DeployError("no stream leader in the NATS servers' /jsz")
    nats, count = leaders.most_common(1)[0]
    with step(f"kill -9 {nats} (leads {count} streams), {workers[0]}, {frontends[0]}") as note:
        sending = client.send_all(range(before, before + during))
        time.sleep(1.0)
        kills = [kill9(cluster, pod) for pod in (nats, workers[0], frontends[0])]
        killed = {kill.pod for kill in kills}
        # Alive whatever NATS does: the others' /healthz answers through the election.
        others = [pod for pod in frontends + workers if pod not in killed]
        if dead := [url for url in silent(others) if url.endswith("/healthz")]:
            failures.append(f"/healthz silent right after the kills: {dead}")
        join(sending)
        note.append(f"{during} messages sent meanwhile")
    with step("killed containers restarted, answering"):
        for kill in kills:
            try:
                back = functools.partial(came_back, cluster, kill)
                wait_until(f"{kill.pod} back after kill -9", back, RECOVERY_TIMEOUT_S)
            except DeployError as e:
                failures.append(str(e))
    with step(f"send {after} messages through every front end"):
        join(client.send_all(range(before + during, before + during + after)))
    with step("deliveries: each 250 once and in time"):
        failures.extend(check_deliveries(cluster, client, kills[1]))
    with step("probe endpoints"):
        if dead := silent(cluster.pods):
            failures.append(f"endpoints not answering 200: {dead}")


def main() -> int:
    if os.environ.get("JSQUEUE_DEPLOY_TEST") == "skip":
        print("deploy: skipped (JSQUEUE_DEPLOY_TEST=skip)")
        return 0
    if os.geteuid() != 0:
        print("deploy: FAIL needs root for rootful podman (JSQUEUE_DEPLOY_TEST=skip skips it)")
        return 1
    failures: list[str] = []
    try:
        with step("packages, podman configuration"):
            install_packages()
            write_podman_config()
        with step("clean up a previous run"):
            cleanup(list(ADDRESSES))
        SINK_MAIL.mkdir(parents=True)
        os.chown(SINK_MAIL, IMAGE_USER, IMAGE_USER)  # the sink runs as the image's user
        deploy_and_check(failures)
    except DeployError as e:
        failures.append(str(e))
    finally:
        if failures:
            logs_tail()
        with step("clean up"):
            cleanup(list(ADDRESSES))
    for failure in failures:
        print(f"deploy: FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
