"""``cloudckpt export URL OUT``: one consolidated ``.safetensors`` or ``.pt`` file
(:mod:`cloudckpt.export.file`: a fresh, exclusively created temporary file renamed onto OUT;
nothing left behind on failure), or with ``--format safetensors`` the Hugging Face layout (see
:mod:`cloudckpt.export.folder`). Without ``--format``, the folder's options are usage errors."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from cloudckpt.cli.options import EXIT_OK, UsageError
from cloudckpt.cli.store import CommandStorage, progress
from cloudckpt.cli.urls import check_local_destination, resolve_checkpoint
from cloudckpt.wording import plural

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_OPTIONS = ("prefix", "dtype", "max_shard_size")


def byte_size(text: str) -> int:
    """``5GB`` (10**9, as huggingface_hub counts), ``500MiB`` (2**20), ``1000000`` -> bytes."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def add_options(sp: argparse.ArgumentParser) -> None:
    """The Hugging Face options of ``export``."""
    sp.add_argument(
        "--format",
        choices=("safetensors",),
        default=None,
        help="safetensors: write OUT as a Hugging Face folder (model.safetensors, or "
        "shards plus model.safetensors.index.json); OUT is a local folder "
        "(created if missing) or an s3:// prefix",
    )
    sp.add_argument(
        "--prefix",
        default=None,
        metavar="PREFIX",
        help="with --format: export only tensors whose names start with PREFIX, "
        "and strip it (e.g. model.)",
    )
    sp.add_argument(
        "--dtype",
        default=None,
        metavar="DTYPE",
        help="with --format: cast floating tensors to DTYPE (e.g. bfloat16); "
        "others keep their dtype",
    )
    sp.add_argument(
        "--max-shard-size",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="with --format: most tensor bytes per file (default 5GB)",
    )


def wants_folder(args) -> bool:
    """Whether ``args`` ask for the Hugging Face layout; a ``UsageError`` when its options
    come without ``--format``."""
    if args.format is not None:
        return True
    given = [f"--{o.replace('_', '-')}" for o in _OPTIONS if getattr(args, o) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} needs --format safetensors (a Hugging Face folder)")
    return False


def cmd_export(args: Any, storage: CommandStorage) -> int:
    """Write the checkpoint as one file, or as a folder with ``--format``."""
    from cloudckpt.export.file import export, export_kind

    if wants_folder(args):
        check_local_destination(args.out, "OUT")
        url = resolve_checkpoint(storage, args.url, args.step, "export")
        return _export_folder(args, url, storage)
    out = args.out
    if export_kind(out) is None:
        raise UsageError(f"OUT must end with .safetensors or .pt, got {out!r}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {out}: the folder {folder} does not exist; create it first")
    if os.path.isdir(out):
        raise UsageError(f"cannot write {out}: it is a folder; give a file name")
    url = resolve_checkpoint(storage, args.url, args.step, "export")
    skipped = export(url, out, allow_pickle=args.allow_pickle, storage=storage.options)
    if skipped:
        print(
            f"warning: {plural(len(skipped), 'non-tensor value')} not representable in "
            f"JSON {'was' if len(skipped) == 1 else 'were'} "
            f"left out: {', '.join(skipped[:5])}",
            file=sys.stderr,
        )
    print(f"exported {url} -> {out}")
    return EXIT_OK


def _export_folder(args: Any, url: str, storage: CommandStorage) -> int:
    """Run the export of ``url`` into the folder ``args.out``; prints what was written."""
    from cloudckpt.errors import ExportTargetNotEmpty
    from cloudckpt.export.folder import DEFAULT_MAX_SHARD_BYTES, export_safetensors

    shard = args.max_shard_size or DEFAULT_MAX_SHARD_BYTES
    with progress(None, "exporting", unit="B") as bar:
        try:
            result = export_safetensors(
                url,
                args.out,
                prefix=args.prefix,
                dtype=args.dtype,
                max_shard_bytes=shard,
                storage=storage.options,
                progress=bar.update,
            )
        except ExportTargetNotEmpty as exc:
            raise UsageError(str(exc)) from exc
    for what, names in (
        ("non-tensor value", result.skipped_values),
        ("tensor", result.skipped_tensors),
    ):
        if names:
            why = " (a dtype safetensors cannot hold)" if what == "tensor" else ""
            print(
                f"warning: {plural(len(names), what)}{why} left out: {', '.join(names[:5])}"
                f"{' ...' if len(names) > 5 else ''}",
                file=sys.stderr,
            )
    print(
        f"exported {url} -> {args.out} ({plural(result.tensors, 'tensor')}, "
        f"{plural(len(result.files), 'file')}: {', '.join(result.files)})"
    )
    return 0
