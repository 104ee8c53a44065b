"""Removal of a simulated cluster's namespaces, and its watchdog:
`python cluster_watchdog.py OWNER_PID PREFIX`.

Every network namespace of one cluster run is named ``PREFIX-<role>`` with
``PREFIX = "ckc<owner pid>x<token>"`` (see :mod:`cloudckpt.testing.cluster.net`); every link
and bridge of the run lives inside those namespaces, so deleting them deletes the links too.

- `destroy(prefix, grace)`: waits up to `grace` seconds for the processes inside the
  run's namespaces to leave on their own (the S3 helper stops weed cleanly when its owner is
  gone, rank workers exit when their owner dies), SIGKILLs whatever is left, deletes the
  namespaces (``ip netns del``) and removes the run's directory (`run_dir`). Idempotent.
- `sweep_stale()`: `destroy` for the runs whose owner process no longer exists (a driver killed
  before its watchdog could finish, or a watchdog killed too).
- As a script, started by `Cluster` before it creates anything, in a session of its own: it
  polls its parent; once the parent is no longer OWNER_PID (the owner died, even by SIGKILL) it
  destroys the run. The owner kills it after a normal close.

Standard library only: it runs as a plain script (``python -I``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NETNS_DIR = "/run/netns"
PREFIX_RE = re.compile(r"^ckc(\d+)x[0-9a-f]+-")
POLL_S = 0.2
OWNER_GONE_GRACE_S = 20.0
KILL_WAIT_S = 10.0


def run_dir(prefix: str) -> str:
    """The run's private directory (weed's data, logs): ``<tmp>/PREFIX``."""
    return os.path.join(tempfile.gettempdir(), prefix)


def run_namespaces(prefix: str) -> list[str]:
    """Names of the namespaces of run `prefix` (``PREFIX-*``)."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix + "-"))


def _ns_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_dev


def namespace_pids(names: list[str]) -> list[int]:
    """PIDs of the processes whose network namespace is one of `names` (any thread)."""
    keys = {k for k in (_ns_key(os.path.join(NETNS_DIR, n)) for n in names) if k}
    if not keys:
        return []
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            tasks = os.listdir(f"/proc/{entry}/task")
        except OSError:
            continue
        for tid in tasks:
            if _ns_key(f"/proc/{entry}/task/{tid}/ns/net") in keys:
                found.append(int(entry))
                break
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def destroy(prefix: str, grace: float = 0.0) -> None:
    """Stop the processes in run `prefix`'s namespaces (after `grace` seconds of waiting for
    them to leave by themselves), delete the namespaces and remove the run's directory."""
    names = run_namespaces(prefix)
    deadline = time.monotonic() + grace
    while names and time.monotonic() < deadline:
        if not [p for p in namespace_pids(names) if _alive(p)]:
            break
        time.sleep(POLL_S)
    deadline = time.monotonic() + KILL_WAIT_S
    while names and time.monotonic() < deadline:
        pids = [p for p in namespace_pids(names) if _alive(p)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    for name in names:
        subprocess.run(
            ["ip", "netns", "del", name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    shutil.rmtree(run_dir(prefix), ignore_errors=True)


def stale_prefixes() -> list[str]:
    """Prefixes of runs whose owner process is gone but whose namespaces or run directory are
    still there."""
    names = []
    for parent in (NETNS_DIR, tempfile.gettempdir()):
        try:
            names += os.listdir(parent)
        except OSError:
            pass
    prefixes = set()
    for name in names:
        m = PREFIX_RE.match(name + "-")
        if m and not _alive(int(m.group(1))):
            prefixes.add(name[: m.end() - 1])
    return sorted(prefixes)


def sweep_stale() -> list[str]:
    """Destroy the runs whose owner is gone; returns their prefixes."""
    prefixes = stale_prefixes()
    for prefix in prefixes:
        destroy(prefix)
    return prefixes


def main(argv: list[str]) -> int:
    owner, prefix = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.getppid() == owner:
        time.sleep(POLL_S)
    destroy(prefix, grace=OWNER_GONE_GRACE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
