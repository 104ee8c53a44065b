"""A training script that ends right after starting an asynchronous save (run by test_exit.py).

    python exit_script.py ENTRY URL [--gloo DIR] [--end normal|raise|exit3]

ENTRY is ``async_save`` (``cloudckpt.async_save(state, URL)``) or ``manager``
(``CheckpointManager(URL, keep_last=2).save(7, state, blocking=False)``). ``--gloo DIR`` first
initialises a 1-rank gloo group (file store in DIR) and never destroys it. The script prints
whether the save was still running as it ended.
"""

from __future__ import annotations

import argparse
import sys

import torch

import cloudckpt


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4 << 20, generator=g), "b": torch.arange(10.0) + step, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("entry", choices=["async_save", "manager"])
    parser.add_argument("url")
    parser.add_argument("--gloo")
    parser.add_argument("--end", choices=["normal", "raise", "exit3"], default="normal")
    args = parser.parse_args()
    if args.gloo:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{args.gloo}/store", rank=0, world_size=1
        )
    if args.entry == "async_save":
        handle = cloudckpt.async_save(state(7), args.url)
    else:
        handle = cloudckpt.CheckpointManager(args.url, keep_last=2).save(
            7, state(7), blocking=False
        )
    print(f"running at the end: {not handle.done()}", flush=True)
    if args.end == "raise":
        raise RuntimeError("the training step failed")
    if args.end == "exit3":
        sys.exit(3)


if __name__ == "__main__":
    main()
