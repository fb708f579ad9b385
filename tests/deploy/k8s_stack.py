"""Reading rendered Kubernetes objects the way the kubelet and the services would: the argv
a container runs (``$(VAR)`` expanded), its environment, ports, quantities and selectors."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

from tests.service_argv import Problem, parse_service

# What the downward API gives a pod in the check: any address will do, as long as the
# parsed config shows it came from there.
POD_FIELDS = {
    "status.podIP": "10.244.7.23",
    "metadata.name": "pod-0",
    "metadata.namespace": "pdserve",
}
POD_IP = POD_FIELDS["status.podIP"]
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Settings a manifest may give through the environment: secrets, which on a command line
# would be visible in `ps` and the pod spec. Only from a Secret.
SECRET_SETTINGS = ("PDSERVE_GATEWAY_API_KEYS", "PDSERVE_CLUSTER_TOKEN")


class Stack:
    """The rendered objects, looked up by kind and name."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.of(kind) if o["metadata"]["name"] == name), None)

    def secret_value(self, name: str, key: str) -> str | None:
        secret = self.get("Secret", name)
        if secret is None:
            return None
        if key in (secret.get("stringData") or {}):
            return str(secret["stringData"][key])
        if key in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][key]).decode()
        return None


def name_of(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels") or {}


def selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    """Whether an equality selector (a Service's, or ``matchLabels``) picks ``labels``; an
    empty selector picks nothing here (the manifests never mean "everything")."""
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def match_labels(selector: dict[str, Any]) -> dict[str, str]:
    """A ``LabelSelector``'s ``matchLabels``; expressions are not used and are refused."""
    if selector.get("matchExpressions"):
        raise Problem(f"matchExpressions are not modelled by the check: {selector}")
    return selector.get("matchLabels") or {}


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload).get("containers") or []
    if len(containers) != 1 or pod_spec(workload).get("initContainers"):
        raise Problem(f"{name_of(workload)}: one container per pod, got {len(containers)}")
    return containers[0]


def argv_of(container: dict[str, Any]) -> list[str]:
    """The container's command and args, unexpanded."""
    return [str(a) for a in [*container.get("command", []), *container.get("args", [])]]


def declared_ports(container: dict[str, Any]) -> dict[str | None, int]:
    """The container's ports by name (None for unnamed ones)."""
    return {p.get("name"): p["containerPort"] for p in container.get("ports") or []}


def container_env(container: dict[str, Any], stack: Stack, where: str) -> dict[str, str]:
    """The container's variables as the kubelet would set them (values of the pod fields
    in ``POD_FIELDS`` and of the stack's Secrets)."""
    if container.get("envFrom"):
        raise Problem(f"{where}: envFrom hides which variables the service reads")
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand(str(var.get("value", "")), env)
        elif "fieldRef" in source and source["fieldRef"]["fieldPath"] in POD_FIELDS:
            env[name] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = stack.secret_value(ref["name"], ref["key"])
            if value is None:
                raise Problem(f"{where}: {name} names Secret {ref['name']} key {ref['key']}: none")
            env[name] = value
        else:
            raise Problem(f"{where}: {name} comes from {source}, which the check does not model")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values: ``$(VAR)`` of a defined
    variable is its value, ``$$`` a literal ``$``; any other reference stays as written."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


@dataclass(frozen=True)
class Service:
    """A pdserve container: its workload, argv, environment and parsed config."""

    workload: dict[str, Any]
    container: dict[str, Any]
    module: str
    cfg: Any
    env: dict[str, str]

    @property
    def name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def ports(self) -> dict[str, int]:
        """Declared container ports by name (unnamed ones by their number)."""
        return {str(p.get("name", p["containerPort"])): p["containerPort"]
                for p in self.container.get("ports") or []}  # fmt: skip

    def port(self, ref: int | str) -> int | None:
        """A probe's or Service's port reference (number or name) as a number."""
        return ref if isinstance(ref, int) else self.ports.get(ref)


def parse_container(workload: dict[str, Any], stack: Stack) -> Service:
    """The container's argv, expanded as the kubelet does, parsed by its service's parser
    over the PDSERVE_ variables it gets (secrets only)."""
    where = name_of(workload)
    container = the_container(workload)
    env = container_env(container, stack, where)
    argv = [expand(a, env) for a in argv_of(container)]
    if unresolved := [a for a in argv if "$(" in a]:
        raise Problem(f"{where}: {unresolved} refer to variables the container does not have")
    settings = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
    for var in settings:
        source = next(e for e in container["env"] if e["name"] == var).get("valueFrom") or {}
        if var not in SECRET_SETTINGS or "secretKeyRef" not in source:
            raise Problem(f"{where}: {var} in the environment hides a setting from the args")
    module, cfg = parse_service(where, argv, settings)
    return Service(workload, container, module, cfg, env)


_SUFFIXES = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def quantity(value: Any) -> float:
    """A Kubernetes quantity (``500m``, ``2``, ``3Gi``) as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|Ki|Mi|Gi|Ti|)", str(value))
    if m is None:
        raise Problem(f"not a quantity: {value!r}")
    return float(m.group(1)) * _SUFFIXES[m.group(2)]
