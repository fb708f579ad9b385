"""Hosts apart on one machine: network namespaces joined by a Linux bridge.

``Network`` owns a set of namespaces named ``<prefix><name>``: one ``switch`` namespace
holding the bridge, and one per host, each joined to the bridge by a veth pair (``eth0``
inside the host, ``p-<name>`` on the switch) with its own address in ``subnet``. Nothing
is added to the root namespace, so the machine's own interfaces, routes and firewall are
untouched, and two networks (two test runs) share nothing but the prefix's uniqueness.

Needs root (``ip netns add``); ``Network.create`` raises ``NamespacesUnavailable`` where
the machine forbids it. ``destroy`` deletes every namespace of the prefix, which takes
their interfaces and the bridge with them.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

_IP_TIMEOUT_S = 10.0
_BRIDGE = "br0"
_HOST_IF = "eth0"


class NamespacesUnavailable(Exception):
    """This process may not create network namespaces (not root, or forbidden here)."""


def ip(*args: str, timeout_s: float = _IP_TIMEOUT_S) -> str:
    """Run ``ip args`` and return its stdout; ``RuntimeError`` with its stderr on failure."""
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def namespaces(prefix: str) -> list[str]:
    """The network namespaces whose names start with ``prefix``."""
    return [line.split()[0] for line in ip("netns", "list").splitlines()
            if line.split() and line.split()[0].startswith(prefix)]  # fmt: skip


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge: ``address`` is what its peers dial."""

    name: str
    namespace: str
    address: str
    interface: str = _HOST_IF

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it, so the
        process it starts is the command itself: signals reach it directly)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, argv: Sequence[str], timeout_s: float = _IP_TIMEOUT_S) -> str:
        """Run ``argv`` inside this host and return its stdout; ``RuntimeError`` on failure."""
        done = subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} failed: {done.stderr[-2000:]}")
        return done.stdout

    def set_link(self, up: bool) -> None:
        """Bring this host's interface up or down: down, the host is cut from every peer
        (its connected route goes with it) while its processes run on."""
        ip("-n", self.namespace, "link", "set", self.interface, "up" if up else "down")

    def counters(self) -> dict[str, int]:
        """Bytes this host's interface has sent (``tx``) and received (``rx``)."""
        out = ip("-n", self.namespace, "-j", "-s", "link", "show", "dev", self.interface)
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


@dataclass
class Network:
    """A bridge in its own namespace and the hosts attached to it."""

    prefix: str
    subnet: ipaddress.IPv4Network
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"{self.prefix}switch"

    @classmethod
    def create(cls, prefix: str, subnet: str) -> Network:
        """The switch namespace with its bridge up; ``NamespacesUnavailable`` when the
        machine does not allow namespaces (nothing is left behind then)."""
        net = cls(prefix, ipaddress.IPv4Network(subnet))
        try:
            ip("netns", "add", net.switch)
        except (RuntimeError, OSError) as e:  # refused, or no iproute2 at all
            raise NamespacesUnavailable(str(e)) from None
        try:
            ip("-n", net.switch, "link", "add", _BRIDGE, "type", "bridge")
            ip("-n", net.switch, "link", "set", _BRIDGE, "up")
        except BaseException:
            net.destroy()
            raise
        return net

    def add_host(self, name: str) -> Host:
        """A new namespace ``<prefix><name>`` on the bridge, loopback and ``eth0`` up, with
        the next address of the subnet."""
        assert name not in self.hosts and name != "switch", name
        # interface names are at most 15 characters: the switch side is named after the host
        port = f"p-{name}"[:15]
        address = str(self.subnet.network_address + len(self.hosts) + 1)
        host = Host(name, f"{self.prefix}{name}", address)
        ip("netns", "add", host.namespace)
        self.hosts[name] = host
        ip("-n", self.switch, "link", "add", port, "type", "veth",
           "peer", "name", host.interface, "netns", host.namespace)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "master", _BRIDGE, "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}",
           "dev", host.interface)  # fmt: skip
        host.set_link(True)
        return host

    def destroy(self) -> list[str]:
        """Delete every namespace of the prefix (their interfaces and the bridge go with
        them); returns those still there afterwards (none, unless deletion failed)."""
        for ns in namespaces(self.prefix):
            try:
                ip("netns", "delete", ns)
            except RuntimeError:
                pass  # reported by the list returned below
        self.hosts.clear()
        return namespaces(self.prefix)
