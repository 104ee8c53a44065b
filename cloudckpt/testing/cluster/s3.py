"""The store of a simulated cluster: `python -m cloudckpt.testing.cluster.s3 --host ADDR ...`,
run by `Cluster` inside the server's network namespace (``ip netns exec``).

It starts one SeaweedFS (`S3Server(host=ADDR)`: weed listens on the namespace's private address,
reachable from the cluster's nodes only), writes one JSON line to stdout (the `S3ServerInfo`
fields and weed's pid), then waits for EOF on stdin: its owner closes the pipe, or dies, and the
server is stopped (weed, its watchdog, its work directory). SIGTERM stops it too. Exit 1 (and a
JSON line with "error") when weed cannot start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading

from cloudckpt.testing.servers.endpoint import S3ServerError
from cloudckpt.testing.servers.seaweed.server import S3Server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloudckpt.testing.cluster.s3")
    parser.add_argument("--host", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = S3Server(bucket=args.bucket, workdir=args.workdir, host=args.host)
    try:
        info = server.start()
    except (S3ServerError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    try:
        print(json.dumps({**dataclasses.asdict(info), "pid": server.pid}), flush=True)

        def wait_eof() -> None:
            sys.stdin.buffer.read()
            done.set()

        threading.Thread(target=wait_eof, daemon=True).start()
        while not done.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
