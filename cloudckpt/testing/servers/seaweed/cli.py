"""The command line of the local SeaweedFS: ``python -m cloudckpt.testing.servers.seaweed``.

`python -m cloudckpt.testing.servers.seaweed [--bucket B]...` runs a server in the foreground,
creates the buckets named (default `cloudckpt-test`), prints the endpoint and `export AWS_...`
lines, and stops cleanly on Ctrl-C or SIGTERM. It exits 1 with a one-line reason when weed cannot
be found or started, 2 on a bad bucket name.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from cloudckpt.testing.servers.endpoint import DEFAULT_BUCKET, S3ServerError
from cloudckpt.testing.servers.seaweed.host import check_bucket_name
from cloudckpt.testing.servers.seaweed.server import S3Server


def _bucket_arg(text: str) -> str:
    try:
        return check_bucket_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cloudckpt.testing.servers.seaweed",
        description="Run a local SeaweedFS S3 endpoint in the foreground (Ctrl-C stops it). "
        "Only the buckets named exist: a PUT into any other gets NoSuchBucket, as on S3.",
    )
    parser.add_argument(
        "--bucket",
        action="append",
        type=_bucket_arg,
        metavar="NAME",
        help=f"bucket created at start; repeat for more (default: {DEFAULT_BUCKET})",
    )
    parser.add_argument("--workdir", default=None, help="parent of the private work directory")
    parser.add_argument(
        "--tls", action="store_true", help="also serve https, with a certificate from a private CA"
    )
    args = parser.parse_args(argv)
    buckets = list(dict.fromkeys(args.bucket or [DEFAULT_BUCKET]))

    stop_requested = threading.Event()

    def _on_signal(signum, frame):
        stop_requested.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server = S3Server(
        bucket=buckets[0], buckets=tuple(buckets[1:]), workdir=args.workdir, tls=args.tls
    )
    try:
        info = server.start()
    except S3ServerError as exc:
        summary, _, details = str(exc).partition("\n")
        print(f"s3server: {summary}", file=sys.stderr, flush=True)
        if details.strip():
            print(
                "  weed's output:\n" + "\n".join("    " + line for line in details.splitlines()),
                file=sys.stderr,
                flush=True,
            )
        return 1
    try:
        print(f"S3 endpoint: {info.endpoint_url}  buckets: {', '.join(buckets)}", flush=True)
        if info.https_endpoint_url:
            print(
                f"https endpoint: {info.https_endpoint_url}  (trust it with "
                f"AWS_CA_BUNDLE={info.ca_file})",
                flush=True,
            )
        for key, value in info.env().items():
            print(f"export {key}={value}", flush=True)
        print("Press Ctrl-C to stop.", file=sys.stderr, flush=True)
        while not stop_requested.wait(0.5):
            pass
    finally:
        server.stop()
    print("stopped", file=sys.stderr, flush=True)
    return 0
