"""``cloudckpt convert SRC DST --to dcp|cloudckpt [--trust]``: a checkpoint in the other format.

```
cloudckpt convert s3://bucket/run/step-100 s3://bucket/dcp/step-100 --to dcp
cloudckpt convert s3://bucket/dcp/step-7 /data/ckpt/step-7 --to cloudckpt --trust
```

``--to dcp`` reads a cloudckpt checkpoint (``SRC`` holds ``manifest.msgpack``) and writes DCP's
layout; ``--to cloudckpt`` reads a DCP checkpoint (``SRC`` holds ``.metadata``) and writes a
committed cloudckpt checkpoint. See :mod:`cloudckpt.dcp.convert`. A DCP ``.metadata`` is a
pickle: reading one needs ``--trust``, and without it the command refuses (exit 2) and says why.
``--trust`` also lets ``--to dcp`` read pickled values of a cloudckpt checkpoint. Names left out
(values msgpack cannot hold, say) are listed on stderr, and so are names the other format keeps
differently (int keys that DCP names as str, say). An existing checkpoint at ``DST`` is
refused (exit 1), nothing changed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cloudckpt.cli.options import UsageError, global_options
from cloudckpt.cli.store import CommandStorage
from cloudckpt.cli.urls import check_local_destination
from cloudckpt.wording import plural


def cmd_convert(args: Any, storage: CommandStorage) -> int:
    from cloudckpt.dcp.convert import TRUST_MESSAGE, convert
    from cloudckpt.storage.urls import parse_store_url

    try:
        parse_store_url(args.dst)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    check_local_destination(args.dst, "DST")
    if args.to == "cloudckpt" and not args.trust:
        raise UsageError(
            TRUST_MESSAGE.replace("pass allow_pickle=True (command line: --trust)", "add --trust")
        )
    result = convert(
        args.url, args.dst, to=args.to, allow_pickle=args.trust, storage=storage.options
    )
    if result.skipped:
        print(
            f"warning: {plural(len(result.skipped), 'name')} left out: "
            f"{'; '.join(result.skipped[:5])}" + (" ..." if len(result.skipped) > 5 else ""),
            file=sys.stderr,
        )
    if result.changed:
        print(
            f"note: {plural(len(result.changed), 'name')} kept differently: "
            f"{'; '.join(result.changed[:5])}" + (" ..." if len(result.changed) > 5 else ""),
            file=sys.stderr,
        )
    print(
        f"converted {result.src} -> {result.dst} ({result.to}): "
        f"{plural(result.tensors, 'tensor')} in {plural(result.chunks, 'chunk')}, "
        f"{plural(result.values, 'value')}, {result.bytes / 2**20:.1f} MiB in "
        f"{result.seconds:.1f} s"
    )
    return 0


def register(sub: Any) -> None:
    """Add ``convert`` to the command line's subcommands (``sub``: argparse's subparsers)."""
    help_ = "convert a checkpoint between cloudckpt and torch DCP formats"
    sp = sub.add_parser("convert", help=help_, description=help_)
    sp.add_argument(
        "url",
        metavar="SRC",
        help="the checkpoint to read (s3://BUCKET/PATH, file:///PATH or a path)",
    )
    sp.add_argument(
        "dst",
        metavar="DST",
        help="where to write the converted checkpoint (no checkpoint there yet)",
    )
    sp.add_argument(
        "--to",
        required=True,
        choices=("dcp", "cloudckpt"),
        help="the format to write: dcp (SRC is a cloudckpt checkpoint) or cloudckpt "
        "(SRC is a DCP checkpoint)",
    )
    sp.add_argument(
        "--trust",
        action="store_true",
        help="trust SRC: needed to read a DCP .metadata (a pickle) and pickled cloudckpt values",
    )
    global_options(sp, default=argparse.SUPPRESS)
    sp.set_defaults(fn=cmd_convert)
