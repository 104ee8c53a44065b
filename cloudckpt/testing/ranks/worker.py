"""The worker side of the multi-rank harness (:mod:`cloudckpt.testing.ranks.world`): what a rank
process forked by the zygote (:mod:`cloudckpt.testing.ranks.zygote`) runs.

`worker_main(conn)` reads its start message from `conn` (rank, world size, environment,
placement...), enters its network namespace if told, joins the gloo world, then answers
("call", id, sys_path, pickled (fn, args, kwargs)) messages until "close" or EOF. A watcher thread
exits the process when the owner or the zygote is gone.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback


def _enter_netns(name: str) -> None:
    """Move this (just forked, single-threaded) process into network namespace `name` (an
    ``ip netns`` name or a path): every socket it opens from now on lives there."""
    import ctypes

    path = name if "/" in name else f"/run/netns/{name}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _watch_owner(owner_pid: int, zygote_pid: int) -> None:
    """Exit the worker as soon as the owning process or the zygote is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != zygote_pid:
            os._exit(70)
        try:
            with open(f"/proc/{owner_pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            os._exit(70)
        if state in (b"Z", b"X"):
            os._exit(70)


def worker_main(conn: multiprocessing.connection.Connection) -> None:
    init = conn.recv()
    rank, world_size = init["rank"], init["world_size"]
    if init.get("netns"):
        try:
            _enter_netns(init["netns"])
        except OSError:
            conn.send(("error", None, f"rank {rank}: " + traceback.format_exc()))
            return
    threading.Thread(
        target=_watch_owner,
        args=(init["owner_pid"], os.getppid()),
        daemon=True,
        name="cloudckpt-owner-watch",
    ).start()
    import faulthandler
    import random

    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # (io.TextIOWrapper's; not TextIO's)
        try:
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        except ValueError:
            pass

    random.seed()  # forked from one zygote: do not share its random state
    stacks = open(init["stack_file"], "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    try:
        for entry in init["sys_path"]:
            if entry not in sys.path:
                sys.path.append(entry)
        os.environ.clear()
        os.environ.update(init["env"])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": init["master_addr"],
            }
        )
        os.environ.update(init["rank_env"])
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        timeout = timedelta(seconds=max(init["pg_timeout"], 30.0))
        if rank == 0:
            store = dist.TCPStore(
                init["master_addr"],
                0,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
            port = store.port
            conn.send(("port", None, port))
        else:
            port = conn.recv()[1]
            store = dist.TCPStore(
                init["master_addr"], port, world_size, is_master=False, timeout=timeout
            )
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", None, f"rank {rank}: " + traceback.format_exc()))
        return

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            break
        _, call_id, caller_path, payload = msg
        for entry in caller_path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            conn.send(("error", call_id, f"rank {rank}: " + traceback.format_exc()))
            continue
        conn.send(("result", call_id, data))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
