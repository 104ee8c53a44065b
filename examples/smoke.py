"""Smoke run: start a local SeaweedFS, save a small state dict to it, load it back, compare.

    python examples/smoke.py

Uses the S3 endpoint in AWS_ENDPOINT_URL (with the standard AWS credentials) when one is set and
``--url`` names a bucket there; otherwise starts a private local SeaweedFS for the run.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import cloudckpt
from cloudckpt.testing.s3server import S3Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="s3://bucket/prefix of an existing store (optional)")
    args = parser.parse_args()
    if args.url:
        run(args.url)
        return
    with S3Server() as info:
        os.environ.update(info.env())
        run(info.url(f"smoke/{int(time.time())}"))


def run(url: str) -> None:
    state = {
        "model": {f"layer{i}.weight": torch.randn(512, 512) for i in range(4)},
        "step": 100,
        "config": {"lr": 3e-4, "betas": (0.9, 0.95)},
    }
    saved = cloudckpt.save(state, url)
    print(f"saved {saved.bytes_written / 1e6:.1f} MB in {saved.objects} object(s) to {url} "
          f"in {saved.seconds:.2f} s")
    blank = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
             "step": 0, "config": {"lr": 0.0, "betas": (0.0, 0.0)}}
    loaded = cloudckpt.load(blank, url)
    same = all(torch.equal(blank["model"][k], v) for k, v in state["model"].items())
    if not same or blank["step"] != 100 or blank["config"] != state["config"]:
        raise SystemExit("smoke: loaded state differs from the saved one")
    print(f"loaded {loaded.bytes_fetched / 1e6:.1f} MB in {loaded.seconds:.2f} s: identical")
    report = cloudckpt.verify(url)
    print(f"verify: {'ok' if report.ok else report.problems}")


if __name__ == "__main__":
    main()
