"""A simulated cluster on one machine: nodes as network namespaces with shaped links to one store.

    with Cluster(nodes=4, frontend_mbit=100) as cluster:      # backend: 10x the frontend
        results = cluster.run(module.fn, arg)                 # fn(arg) on every rank
        cluster.set_link(2, down=True)                        # pull node 2's frontend cable

On a real cluster each node's path to the object store is the bottleneck (10-100 Gbit/s per
node), while the links between nodes (NVLink / InfiniBand) are much faster. This builds that
shape at a small scale, so benchmarks measure links instead of the machine's CPUs:

- N nodes, each a network namespace with a *frontend* link to the store's namespace and a
  *backend* link to the other nodes, both through a switch namespace (the layout and addresses:
  :mod:`cloudckpt.testing.cluster.net`). Each link is shaped each way with ``tc`` (token bucket)
  at the node's rate: `frontend_mbit` (`slow_nodes` {node: factor} scales it per node) and
  `backend_mbit` (default 10x the frontend).
- The store is one SeaweedFS with credentials, in its own namespace, listening on that
  namespace's private address (:mod:`cloudckpt.testing.cluster.s3`); `info` is its
  `S3ServerInfo` (reachable from the ranks only, not from the process that built the cluster).
- `ranks_per_node` gloo ranks per node, a persistent
  :class:`cloudckpt.testing.ranks.world.ProcessWorld` whose workers enter their node's namespace
  before initialising torch.distributed: the rendezvous is node 0's backend address, gloo is
  bound to the backend link
  (``GLOO_SOCKET_IFNAME=be0``), and the standard AWS variables point at the store, so
  ``cloudckpt.save(state, "s3://...")`` in a rank uses the frontend link. Ranks of one node talk
  to each other through the node's loopback (fast, like NVLink). Rank r runs on node
  ``r // ranks_per_node``; LOCAL_RANK / LOCAL_WORLD_SIZE are per node.
- `run(fn, *args, **kwargs)` is `ProcessWorld.run` (per-rank results, rank order;
  RankFailedError / WorldTimeoutError). `set_link(node, down=True)` pulls a cable,
  `set_link(node, loss=100)` drops every packet silently, `set_link(node, mbit=...)` changes a
  rate; `link_bytes()` reads each link's byte counters.

Clean-up, whatever happens: every namespace (and so every link and bridge, which live inside
them) is named with the run's prefix ``ckc<pid>x<token>``. `close()` (also ``__exit__`` and at
interpreter exit) stops the ranks and the store and deletes the namespaces. A watchdog process
(:mod:`cloudckpt.testing.cluster.watchdog`), started before anything is created, does the same if
the owning process dies, even by SIGKILL; each start also sweeps the leftovers of runs whose
owner is gone.

Where namespaces cannot be made (not root, no iproute2), `start()` raises `ClusterUnavailable`
before creating anything; `unavailable_reason()` says why without trying. Test infrastructure:
never imported by library code.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import selectors
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cloudckpt.testing.cluster import net
from cloudckpt.testing.cluster.watchdog import destroy, run_dir, run_namespaces, sweep_stale
from cloudckpt.testing.ranks.world import ProcessWorld
from cloudckpt.testing.servers.endpoint import DEFAULT_BUCKET, S3ServerInfo
from cloudckpt.testing.servers.seaweed.host import check_bucket_name

__all__ = ["Cluster", "ClusterUnavailable", "unavailable_reason"]

_WATCHDOG_SCRIPT = str(Path(__file__).with_name("watchdog.py"))
_REPO_ROOT = str(Path(__file__).resolve().parents[3])
SERVER_START_TIMEOUT_S = 90.0
SERVER_STOP_TIMEOUT_S = 20.0
BACKEND_FACTOR = 10.0


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be created on this machine (the message says why)."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here (None: it can, as far as can be told without trying)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()


@atexit.register
def _close_live_clusters() -> None:
    for cluster in list(_LIVE):
        cluster.close()


class Cluster:
    """N simulated nodes with shaped links to one S3 store (see the module's contract).

    Options (keyword-only): `nodes`, `ranks_per_node` (1 or more), `frontend_mbit` (each node's
    link to the store, Mbit/s each way), `backend_mbit` (node to node; default 10x frontend),
    `slow_nodes` ({node: factor}: that node's frontend runs at factor x the rate), `bucket`,
    `timeout` (seconds per `run` and for starting), `env` (extra environment of every rank),
    `mtu` (of every link; 9000 by default, see `cluster_net.Topology`)."""

    def __init__(
        self,
        *,
        nodes: int,
        ranks_per_node: int = 1,
        frontend_mbit: float = 100.0,
        backend_mbit: float | None = None,
        slow_nodes: Mapping[int, float] | None = None,
        bucket: str = DEFAULT_BUCKET,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        mtu: int = 9000,
    ) -> None:
        if ranks_per_node < 1:
            raise ValueError("ranks_per_node must be >= 1")
        slow = dict(slow_nodes or {})
        if any(not 0 <= n < nodes for n in slow) or any(f <= 0 for f in slow.values()):
            raise ValueError(f"slow_nodes maps nodes 0..{nodes - 1} to factors > 0")
        backend = frontend_mbit * BACKEND_FACTOR if backend_mbit is None else backend_mbit
        self.ranks_per_node = ranks_per_node
        self.frontend_mbit = float(frontend_mbit)
        self.backend_mbit = float(backend)
        self.slow_nodes = slow
        self.bucket = check_bucket_name(bucket)
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.prefix = f"ckc{os.getpid()}x{secrets.token_hex(3)}"
        self.topology = net.Topology(
            prefix=self.prefix,
            frontend_mbit=tuple(frontend_mbit * slow.get(i, 1.0) for i in range(nodes)),
            backend_mbit=(float(backend),) * nodes,
            mtu=mtu,
        )
        self._info: S3ServerInfo | None = None
        self._server: subprocess.Popen | None = None
        self._server_pid: int | None = None
        self._watchdog: subprocess.Popen | None = None
        self._world: ProcessWorld | None = None
        self._rates = {
            (i, link): rates[i]
            for link, rates in (
                ("frontend", self.topology.frontend_mbit),
                ("backend", self.topology.backend_mbit),
            )
            for i in range(nodes)
        }

    def __repr__(self) -> str:
        return (
            f"<Cluster {self.prefix} nodes={self.nodes} ranks={self.world_size} "
            f"frontend={self.frontend_mbit:g} Mbit/s backend={self.backend_mbit:g} Mbit/s>"
        )

    # -- shape --------------------------------------------------------------------------------

    @property
    def nodes(self) -> int:
        return self.topology.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def info(self) -> S3ServerInfo:
        """The store (its endpoint is reachable from the ranks only)."""
        if self._info is None:
            raise RuntimeError("the cluster is not running")
        return self._info

    @property
    def server_pid(self) -> int | None:
        """PID of the store's weed process (to read its CPU time)."""
        return self._server_pid

    @property
    def world(self) -> ProcessWorld:
        if self._world is None:
            raise RuntimeError("the cluster is not running")
        return self._world

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Build the network, start the store and the ranks; ClusterUnavailable where namespaces
        cannot be made. On any failure everything created so far is removed."""
        if self._world is not None:
            return self
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        sweep_stale()
        os.mkdir(run_dir(self.prefix), 0o700)
        _LIVE.add(self)
        # The watchdog first: from the moment a namespace exists, someone will remove it.
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", _WATCHDOG_SCRIPT, str(os.getpid()), self.prefix],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        try:
            try:
                net.build_network(self.topology)
            except net.NetworkError as exc:
                if not run_namespaces(self.prefix):
                    raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from exc
                raise
            info = self._start_server()
            self._world = ProcessWorld(
                self.world_size,
                timeout=self.timeout,
                env={**info.env(), **self.env},
                rank_env=[self._rank_env(r) for r in range(self.world_size)],
                netns=[self.topology.node_ns(self.node_of(r)) for r in range(self.world_size)],
                master_addr=self.topology.backend_addr(0),
            )
            self._world.start()
        except BaseException:
            self.close()
            raise
        return self

    def _rank_env(self, rank: int) -> dict[str, str]:
        node = self.node_of(rank)
        return {
            "GLOO_SOCKET_IFNAME": net.BACKEND_IF,
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node),
            "CLOUDCKPT_CLUSTER_NODE": str(node),
            # a proxy of the host's environment cannot reach the namespaces
            "NO_PROXY": self.topology.server_addr,
            "no_proxy": self.topology.server_addr,
        }

    def _start_server(self) -> S3ServerInfo:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        log = open(os.path.join(run_dir(self.prefix), "cluster_s3.log"), "wb")
        with log:
            server = self._server = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.topology.server_ns,
                    sys.executable,
                    "-m",
                    "cloudckpt.testing.cluster.s3",
                    "--host",
                    self.topology.server_addr,
                    "--bucket",
                    self.bucket,
                    "--workdir",
                    run_dir(self.prefix),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=_REPO_ROOT,
                env=env,
                close_fds=True,
            )
        stdout = server.stdout
        assert stdout is not None  # (stdout=PIPE)
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    chunk = os.read(stdout.fileno(), 1 << 16)
                    if not chunk:
                        break
                    line += chunk
        try:
            reply: dict[str, Any] = json.loads(line) if line.strip() else {"error": "no answer"}
        except ValueError:
            reply = {"error": f"unreadable answer {line[:200]!r}"}
        if "error" in reply:
            raise RuntimeError(
                f"the cluster's store did not start: {reply['error']} (log: "
                f"{self._server_log_tail()})"
            )
        self._server_pid = reply.pop("pid")
        self._info = S3ServerInfo(**reply)
        return self._info

    def _server_log_tail(self) -> str:
        try:
            return Path(run_dir(self.prefix), "cluster_s3.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the ranks and the store, delete every namespace and link of the run. Idempotent."""
        world, self._world = self._world, None
        if world is not None:
            world.close()
        server, self._server = self._server, None
        if server is not None:
            try:
                if server.stdin is not None:
                    server.stdin.close()  # EOF: the helper stops weed cleanly
                server.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                server.kill()
                server.wait()
            if server.stdout is not None:
                server.stdout.close()
        self._info = self._server_pid = None
        destroy(self.prefix, grace=2.0)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            if watchdog.poll() is None:
                watchdog.kill()
            watchdog.wait()
        _LIVE.discard(self)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- use ----------------------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank (see `ProcessWorld.run`)."""
        return self.world.run(fn, *args, timeout=timeout, **kwargs)

    def set_link(
        self,
        node: int,
        *,
        link: str = "frontend",
        down: bool | None = None,
        loss: int | None = None,
        mbit: float | None = None,
    ) -> None:
        """Change node's `link` ("frontend" / "backend"): `down=True` pulls the cable (both ends
        down: the node's sockets see the route vanish), `down=False` plugs it back; `loss=100`
        silently drops every packet (the link stays up: senders notice by timeouts only),
        `loss=0` restores the rate; `mbit` sets a new rate, each way."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be 0..{self.nodes - 1}")
        if loss not in (None, 0, 100):
            raise ValueError("loss is 0 or 100 (percent)")
        if mbit is not None:
            self._rates[(node, link)] = float(mbit)
        if loss == 100:
            net.drop_everything(self.topology, node, link)
        elif loss == 0 or mbit is not None:
            net.shape(self.topology, node, link, self._rates[(node, link)])
        if down is not None:
            net.set_link_state(self.topology, node, link, up=not down)

    def link_bytes(self) -> list[dict[str, dict[str, int]]]:
        """Per node: {"frontend": {"tx", "rx"}, "backend": {...}}, bytes so far (node side:
        tx = sent by the node)."""
        return [
            {link: net.link_counters(self.topology, i, link) for link in ("frontend", "backend")}
            for i in range(self.nodes)
        ]

    def routes(self) -> dict[str, list[str]]:
        """IPv4 routes of every namespace of the run."""
        return {ns: net.routes(ns) for ns in self.topology.namespaces()}
