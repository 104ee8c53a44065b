"""Smoke run: save a small state dict to S3, load it back, compare, verify.

    python examples/smoke.py [--bucket NAME] [--url s3://bucket/prefix]

Where it saves, in this order:
- ``--url``: that URL, with the standard AWS configuration (endpoint, credentials, region);
- ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) set, e.g. by the ``export`` lines of
  ``python -m cloudckpt.testing.servers.seaweed``: that endpoint, bucket ``--bucket``, under a fresh
  ``smoke/<time>-<random>`` prefix, left in place afterwards (the script says how to remove it);
- otherwise: a private local SeaweedFS started for this run and removed with its data at the end.

It says which one it used. Exit status 0 when everything matched, 1 otherwise (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import secrets
import time

import torch

import cloudckpt
from cloudckpt.errors import CloudCkptError
from cloudckpt.testing.servers.endpoint import DEFAULT_BUCKET
from cloudckpt.testing.servers.seaweed.server import S3Server


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="s3://bucket/prefix to save to (any configured endpoint)")
    parser.add_argument(
        "--bucket",
        default=DEFAULT_BUCKET,
        help=f"bucket used with AWS_ENDPOINT_URL or the private server (default: {DEFAULT_BUCKET})",
    )
    args = parser.parse_args()
    prefix = f"smoke/{int(time.time())}-{secrets.token_hex(3)}"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    try:
        if args.url:
            print(f"smoke: saving to {args.url} (the URL given)", flush=True)
            run(args.url)
            return
        if endpoint:
            url = f"s3://{args.bucket}/{prefix}"
            print(
                f"smoke: using the S3 endpoint in AWS_ENDPOINT_URL ({endpoint}), "
                f"bucket {args.bucket}",
                flush=True,
            )
            run(url)
            print(f"smoke: the checkpoint stays at {url}; remove it with: cloudckpt rm {url}")
            return
        print(
            "smoke: AWS_ENDPOINT_URL is not set: starting a private local S3 server "
            "(SeaweedFS) for this run",
            flush=True,
        )
        with S3Server(bucket=args.bucket) as info:
            os.environ.update(info.env())
            print(f"smoke: private server at {info.endpoint_url}, bucket {info.bucket}", flush=True)
            url = info.url(prefix)
            run(url)
        print(
            f"smoke: the private server and its data ({url}) are gone now; to keep a "
            "checkpoint, start `python -m cloudckpt.testing.servers.seaweed`, eval its export "
            "lines, and run this again"
        )
    except CloudCkptError as exc:
        raise SystemExit(f"smoke: FAILED: {exc}") from exc


def run(url: str) -> None:
    state = {
        "model": {f"layer{i}.weight": torch.randn(512, 512) for i in range(4)},
        "step": 100,
        "config": {"lr": 3e-4, "betas": (0.9, 0.95)},
    }
    saved = cloudckpt.save(state, url)
    print(
        f"saved {saved.bytes_written / 2**20:.1f} MiB in {saved.objects} object(s) to {url} "
        f"in {saved.seconds:.2f} s",
        flush=True,
    )
    blank = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "config": {"lr": 0.0, "betas": (0.0, 0.0)},
    }
    loaded = cloudckpt.load(blank, url)
    same = all(torch.equal(blank["model"][k], v) for k, v in state["model"].items())
    if not same or blank["step"] != 100 or blank["config"] != state["config"]:
        raise SystemExit("smoke: FAILED: the loaded state differs from the saved one")
    print(
        f"loaded {loaded.bytes_fetched / 2**20:.1f} MiB in {loaded.seconds:.2f} s: identical",
        flush=True,
    )
    report = cloudckpt.verify(url)
    if not report.ok:
        raise SystemExit(f"smoke: FAILED: verify found {report.problems}")
    print("verify: ok", flush=True)


if __name__ == "__main__":
    main()
