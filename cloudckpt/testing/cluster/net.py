"""The network of a simulated cluster: Linux network namespaces, veth links, bridges, `tc` shaping.

Layout of one run (every name starts with the run's prefix ``ckc<owner pid>x<token>``):

- ``PREFIX-br``: the switch: two bridges, ``brfe`` (frontend: the path to the store) and
  ``brbe`` (backend: node to node, for collectives), and the bridge-side end of every link.
- ``PREFIX-s3``: the store's namespace; ``fe0`` = ``FRONTEND.254``, not shaped (the store's own
  bandwidth is not what is simulated).
- ``PREFIX-n<i>``: node i; ``fe0`` = ``FRONTEND.<i+1>`` (to the store) and ``be0`` =
  ``BACKEND.<i+1>`` (to the other nodes). Each link is shaped with a token bucket (``tbf``) on
  both of its ends, so each way runs at the node's rate.

Addresses are 10.213.1.0/24 (frontend) and 10.213.2.0/24 (backend), and they exist only inside
the run's namespaces: every link is created with both ends already inside them (nothing is ever
added to the machine's own namespace), there is no default route anywhere, and the namespaces
are not connected to the machine's network at all. Two runs at once do not see each other.

Everything here shells out to ``ip`` and ``tc`` (iproute2) and needs root; `NetworkError` says
which command failed and why. Removal is `watchdog.destroy` (namespaces take their links
with them).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

__all__ = [
    "NetworkError",
    "Topology",
    "build_network",
    "shape",
    "drop_everything",
    "set_link_state",
    "link_counters",
    "routes",
]

FRONTEND_NET = "10.213.1"
BACKEND_NET = "10.213.2"
SERVER_HOST = 254
MAX_NODES = 200
FRONTEND_IF = "fe0"
BACKEND_IF = "be0"
# Token bucket: the burst lets a 64 KiB GSO packet through whole, the queue holds about this
# much time at the rate before dropping (TCP then backs off as on a congested link).
TBF_BURST = "256kb"
TBF_LATENCY = "100ms"


class NetworkError(RuntimeError):
    """An ``ip`` / ``tc`` command failed (message: the command and its stderr)."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Names, addresses and rates of one run (pure: computes, creates nothing).

    `frontend_mbit[i]` / `backend_mbit[i]`: node i's link rates, each way, in Mbit/s (10^6);
    `mtu`: of every link (default 9000: jumbo frames, as on cluster networks; it also keeps the
    per-packet CPU cost of the simulation low)."""

    prefix: str
    frontend_mbit: tuple[float, ...]
    backend_mbit: tuple[float, ...]
    mtu: int = 9000
    nodes: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.frontend_mbit) != len(self.backend_mbit):
            raise ValueError("one frontend and one backend rate per node")
        n = len(self.frontend_mbit)
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}")
        if min(self.frontend_mbit + self.backend_mbit) <= 0:
            raise ValueError("link rates must be > 0")
        if not 576 <= self.mtu <= 65535:
            raise ValueError("mtu must be 576..65535")
        object.__setattr__(self, "nodes", n)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @property
    def server_ns(self) -> str:
        return f"{self.prefix}-s3"

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def server_addr(self) -> str:
        return f"{FRONTEND_NET}.{SERVER_HOST}"

    def frontend_addr(self, node: int) -> str:
        return f"{FRONTEND_NET}.{node + 1}"

    def backend_addr(self, node: int) -> str:
        return f"{BACKEND_NET}.{node + 1}"

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, self.server_ns] + [self.node_ns(i) for i in range(self.nodes)]

    def bridge_port(self, node: int, link: str) -> str:
        """Name of the bridge-side end of node's `link` ("frontend" / "backend")."""
        return f"{'fe' if link == 'frontend' else 'be'}-n{node}"


def _run(argv: list[str]) -> str:
    proc = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _ip(ns: str, *args: str) -> str:
    return _run(["ip", "-n", ns, *args])


def build_network(topo: Topology) -> None:
    """Create the namespaces, bridges, links, addresses and shaping of `topo`. On failure the
    caller removes what exists (`watchdog.destroy(topo.prefix)`)."""
    for ns in topo.namespaces():
        _run(["ip", "netns", "add", ns])
        _ip(ns, "link", "set", "lo", "up")
    br = topo.bridge_ns
    for bridge in ("brfe", "brbe"):
        _ip(br, "link", "add", bridge, "mtu", str(topo.mtu), "type", "bridge")
        _ip(br, "link", "set", bridge, "up")
    _connect(br, "fe-s3", "brfe", topo.server_ns, FRONTEND_IF, f"{topo.server_addr}/24", topo.mtu)
    for i in range(topo.nodes):
        ns = topo.node_ns(i)
        _connect(
            br,
            topo.bridge_port(i, "frontend"),
            "brfe",
            ns,
            FRONTEND_IF,
            f"{topo.frontend_addr(i)}/24",
            topo.mtu,
        )
        _connect(
            br,
            topo.bridge_port(i, "backend"),
            "brbe",
            ns,
            BACKEND_IF,
            f"{topo.backend_addr(i)}/24",
            topo.mtu,
        )
        shape(topo, i, "frontend", topo.frontend_mbit[i])
        shape(topo, i, "backend", topo.backend_mbit[i])


def _connect(br: str, port: str, bridge: str, ns: str, ifname: str, cidr: str, mtu: int) -> None:
    """A veth pair created with its ends already in `br` (`port`, enslaved to `bridge`) and in
    `ns` (`ifname` with address `cidr`): it never exists in the caller's namespace."""
    _ip(
        br,
        "link",
        "add",
        port,
        "mtu",
        str(mtu),
        "type",
        "veth",
        "peer",
        "name",
        ifname,
        "mtu",
        str(mtu),
        "netns",
        ns,
    )
    _ip(br, "link", "set", port, "master", bridge)
    _ip(br, "link", "set", port, "up")
    _ip(ns, "addr", "add", cidr, "dev", ifname)
    _ip(ns, "link", "set", ifname, "up")


def _ends(topo: Topology, node: int, link: str) -> list[tuple[str, str]]:
    ifname = FRONTEND_IF if link == "frontend" else BACKEND_IF
    return [(topo.node_ns(node), ifname), (topo.bridge_ns, topo.bridge_port(node, link))]


def shape(topo: Topology, node: int, link: str, mbit: float) -> None:
    """Set node's `link` ("frontend" / "backend") to `mbit` Mbit/s each way (tbf on both ends)."""
    if link not in ("frontend", "backend"):
        raise ValueError(f"link must be 'frontend' or 'backend', not {link!r}")
    rate = f"{int(mbit * 1_000_000)}bit"
    for ns, dev in _ends(topo, node, link):
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                TBF_BURST,
                "latency",
                TBF_LATENCY,
            ]
        )


def drop_everything(topo: Topology, node: int, link: str) -> None:
    """Silently drop every packet on both ends of node's `link` (100% loss; the link stays up,
    so senders notice only by timeouts). `shape` restores a rate. (``netem`` is not available
    on every kernel: a token bucket whose burst is smaller than any packet drops them all.)"""
    for ns, dev in _ends(topo, node, link):
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                "8kbit",
                "burst",
                "64",
                "limit",
                "1",
            ]
        )


def set_link_state(topo: Topology, node: int, link: str, up: bool) -> None:
    """Take both ends of node's `link` down (a pulled cable: packets vanish) or up again."""
    for ns, dev in _ends(topo, node, link):
        _ip(ns, "link", "set", dev, "up" if up else "down")


def link_counters(topo: Topology, node: int, link: str) -> dict[str, int]:
    """Bytes the node sent (``tx``) and received (``rx``) on `link` so far (node side)."""
    ns, dev = _ends(topo, node, link)[0]
    stats = json.loads(_ip(ns, "-s", "-j", "link", "show", "dev", dev))[0]["stats64"]
    return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


def routes(ns: str) -> list[str]:
    """The IPv4 routes of namespace `ns`, one line each (to check: no default route)."""
    return [
        line for line in _ip(ns, "-4", "route", "show", "table", "all").splitlines() if line.strip()
    ]
