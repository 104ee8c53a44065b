"""The watchdog of a local SeaweedFS.

`python watchdog.py OWNER_PID WEED_BIN WORKDIR [SOCKET]...`

Started by `S3Server` *before* weed, in a session of its own (so Ctrl-C or a group kill of the
owner does not take it down first). It polls its parent; once the parent is no longer OWNER_PID
(the owner died, even by SIGKILL), it stops every process running WEED_BIN whose command line
names WORKDIR (SIGTERM, then SIGKILL after 5 s), so a weed started at the very moment the owner
died is found too, then removes WORKDIR and each SOCKET path that is a socket (weed puts its gRPC
sockets in /tmp whatever the flags say, and removes them only on a graceful stop). The owner kills
the watchdog on a normal stop. Standard library only: it runs as a plain script.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import time

POLL_S = 0.2
LATE_START_S = 2.0  # how long a weed exec'd as the owner died is looked for
TERM_GRACE_S = 5.0
KILL_WAIT_S = 10.0


def remove_sockets(paths) -> None:
    """Unlink each of `paths` that is a socket (anything else is left alone)."""
    for path in paths:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass


def find_weeds(weed_bin: str, workdir: str) -> list[int]:
    """PIDs of live processes running `weed_bin` with `workdir` in their arguments."""
    me, binary, marker = os.getpid(), weed_bin.encode(), workdir.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0] == binary and any(marker in arg for arg in argv[1:]):
            found.append(int(name))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def clean_up(weed_bin: str, workdir: str, sockets: list[str]) -> None:
    """Stop every weed of `workdir`, then remove `workdir` and `sockets`."""
    termed: set[int] = set()
    deadline = time.monotonic() + LATE_START_S
    while time.monotonic() < deadline:
        fresh = [pid for pid in find_weeds(weed_bin, workdir) if pid not in termed]
        _signal_all(fresh, signal.SIGTERM)
        termed.update(fresh)
        time.sleep(0.1)
    deadline = time.monotonic() + TERM_GRACE_S
    while find_weeds(weed_bin, workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + KILL_WAIT_S
    while (pids := find_weeds(weed_bin, workdir)) and time.monotonic() < deadline:
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)
    shutil.rmtree(workdir, ignore_errors=True)
    remove_sockets(sockets)


def main(argv: list[str]) -> int:
    owner, weed_bin, workdir, sockets = int(argv[0]), argv[1], argv[2], argv[3:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.getppid() == owner:
        time.sleep(POLL_S)
    clean_up(weed_bin, workdir, sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
