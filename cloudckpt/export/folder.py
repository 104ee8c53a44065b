"""Export a checkpoint in the Hugging Face safetensors layout, streaming, with bounded memory.

:func:`export_safetensors` writes ``model.safetensors`` (one file) or
``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` of tensor data each
plus ``model.safetensors.index.json``, the layout ``transformers``' ``from_pretrained`` and
``safetensors`` read.

Contract:
- Every file, header included, is planned from the manifest before any data is read
  (:mod:`cloudckpt.export.shards`); tensors keep the checkpoint's order. ``prefix`` keeps the
  tensors whose names start with it and strips it (``"model."``: a ``{"model": ..., "optim":
  ...}`` checkpoint's model); ``dtype`` casts floating tensors (float64/32/16, bfloat16, float8)
  and leaves the others as they are. Non-tensor values, and tensors of a dtype safetensors
  cannot hold (complex128), are left out and named in the result. Pickled values are never
  unpickled (they are left out like the other values).
- Memory: data moves through one window buffer of ``window_bytes`` (tensors larger than it are
  read in contiguous row slices) plus the load's read buffers (``LoadOptions.max_read_bytes``);
  every file is streamed: to disk, or to S3 in parts, the destination store holding about
  ``part_size x (concurrency + 1)`` of it (its ``StorageOptions``; within its
  ``max_buffer_bytes`` but one part), whatever the file's size.
- The destination is refused (:class:`~cloudckpt.errors.ExportTargetNotEmpty`, a
  ``FileExistsError``) when it already holds ``*.safetensors`` files or an index; other files
  (``config.json``, a tokenizer) are fine. Files are never written over
  (:mod:`cloudckpt.export.destinations`); the index is written last, after the shards are on disk
  (folder fsynced) or stored, so a folder with an index is complete. On any failure,
  ``KeyboardInterrupt`` included, the files this export wrote are removed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cloudckpt.api.read_tensors import TensorReader
from cloudckpt.errors import ConfigError, ExportTargetNotEmpty, SafetensorsError
from cloudckpt.export.destinations import ExportFolder, open_folder
from cloudckpt.export.shards import (
    INDEX_FILE,
    ExportTensor,
    ShardFile,
    ShardPlan,
    plan_shards,
    plan_windows,
)
from cloudckpt.hf.header import DTYPES, FLOATING, torch_dtype_name
from cloudckpt.options import LoadOptions
from cloudckpt.storage.urls import parse_store_url
from cloudckpt.stored import decode_manifest_without_pickle, read_manifest_bytes

#: ``huggingface_hub``'s default, "5GB".
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_WINDOW_BYTES = 64 << 20
#: Read buffers of an export's loads (``LoadOptions.max_read_bytes``) unless options are given.
DEFAULT_READ_BYTES = 64 << 20
METADATA = {"format": "pt"}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_safetensors` wrote: ``files`` in the order written (the index last
    when there is one), ``tensors`` and ``total_size`` (bytes of tensor data); the names (as
    stored in the checkpoint) left out: ``skipped_values`` (non-tensor values) and
    ``skipped_tensors`` (dtypes safetensors cannot hold)."""

    dst: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    skipped_values: tuple[str, ...]
    skipped_tensors: tuple[str, ...]
    seconds: float


def export_safetensors(
    url: str,
    dst: str,
    prefix: str | None = None,
    dtype=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    storage=None,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    options: LoadOptions | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write the checkpoint at ``url`` to ``dst`` (a local folder, created if missing, or an
    ``s3://`` prefix) in the Hugging Face safetensors layout; see the module doc.

    ``dtype``: a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``, ``"BF16"``),
    floating only. ``progress(n)`` is called with the bytes of each window written.
    Raises ``ConfigError`` for bad arguments or a prefix that selects no tensor,
    ``ExportTargetNotEmpty`` as above, and the load's errors as they are.
    """
    started = time.perf_counter()
    cast = _cast_dtype(dtype)
    if type(max_shard_bytes) is not int or max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if type(window_bytes) is not int or window_bytes < 4096:
        raise ConfigError(f"window_bytes must be an integer of at least 4096, got {window_bytes!r}")
    if prefix is not None and (type(prefix) is not str or not prefix):
        raise ConfigError(f"prefix must be a non-empty string, got {prefix!r}")
    dst_url = parse_store_url(dst)
    manifest, _ = decode_manifest_without_pickle(read_manifest_bytes(url, storage))
    tensors, skipped_tensors = _select(manifest, prefix, cast, url)
    skipped_values = tuple(n for n in manifest.values if prefix is None or n.startswith(prefix))
    plan = plan_shards(tensors, max_shard_bytes, METADATA)

    reader = TensorReader(
        url,
        manifest=manifest,
        storage=storage,
        options=options or LoadOptions(max_read_bytes=DEFAULT_READ_BYTES),
    )
    folder = open_folder(dst_url, storage)
    try:
        found = folder.existing()
        if found:
            raise ExportTargetNotEmpty(
                f"{folder.where} already holds {', '.join(found[:3])}"
                f"{' ...' if len(found) > 3 else ''}; export into an empty folder or remove "
                "those files first (nothing was written)",
                names=tuple(found),
            )
        written = _write_all(folder, plan, reader, window_bytes, progress)
    finally:
        folder.close()
    return ExportResult(
        dst=os.fspath(dst),
        files=tuple(written),
        tensors=len(tensors),
        total_size=plan.total_size,
        skipped_values=skipped_values,
        skipped_tensors=skipped_tensors,
        seconds=time.perf_counter() - started,
    )


def _cast_dtype(dtype) -> str | None:
    if dtype is None:
        return None
    try:
        name = torch_dtype_name(dtype)
    except SafetensorsError as exc:
        raise ConfigError(
            f"dtype {dtype!r} is not one safetensors holds; give a floating "
            f"dtype: {', '.join(sorted(FLOATING))}"
        ) from exc
    if name not in FLOATING:
        raise ConfigError(
            f"dtype {dtype!r} is not floating: the cast applies to floating "
            f"tensors only; give one of {', '.join(sorted(FLOATING))}"
        )
    return name


def _select(manifest, prefix: str | None, cast: str | None, url: str):
    """The tensors to export, in the checkpoint's order, and the names left out for their
    dtype."""
    held = set(DTYPES.values())
    tensors, skipped = [], []
    for name, record in manifest.tensors.items():
        if prefix is not None and not (name.startswith(prefix) and len(name) > len(prefix)):
            continue
        if record.dtype not in held:
            skipped.append(name)
            continue
        out = cast if cast is not None and record.dtype in FLOATING else record.dtype
        tensors.append(ExportTensor(name[len(prefix or "") :], name, out, tuple(record.shape)))
    if not tensors:
        sample = ", ".join(list(manifest.tensors)[:5]) or "none"
        where = f" whose name starts with {prefix!r}" if prefix is not None else ""
        raise ConfigError(
            f"nothing to export from {url}: no tensor{where} of a dtype "
            f"safetensors holds (tensors: {sample}); check the prefix"
        )
    return tensors, tuple(skipped)


def _write_all(
    folder: ExportFolder,
    plan: ShardPlan,
    reader: TensorReader,
    window_bytes: int,
    progress: Callable[[int], None] | None,
) -> list[str]:
    """Write every file, then the index; on any failure remove what was written."""
    written: list[str] = []
    window = torch.empty(window_bytes, dtype=torch.uint8)
    try:
        for shard in plan.files:
            _write_file(folder, shard, reader, window, progress)
            written.append(shard.name)
        if len(plan.files) > 1:
            index = json.dumps(plan.index(), indent=2, sort_keys=True).encode() + b"\n"
            folder.sync()  # the shards' names are on disk before the index names them
            f = folder.open(INDEX_FILE, len(index))
            try:
                f.write(index)
                f.commit()
            except BaseException:
                f.discard()
                raise
            written.append(INDEX_FILE)
        folder.sync()
    except BaseException:
        folder.remove(written)
        raise
    return written


def _write_file(
    folder: ExportFolder,
    shard: ShardFile,
    reader: TensorReader,
    window: torch.Tensor,
    progress: Callable[[int], None] | None,
) -> None:
    f = folder.open(shard.name, shard.size)
    try:
        f.write(shard.header_bytes)
        raw = window.numpy().data
        for pieces in plan_windows(shard, window.numel()):
            views = []
            for p in pieces:
                t = shard.tensors[p.tensor]
                dest = (
                    window[p.slot : p.slot + p.nbytes].view(getattr(torch, t.dtype)).view(p.sizes)
                )
                views.append((t.source, p.offsets, dest))
            reader.read_into(views)
            for p in pieces:
                f.write(raw[p.slot : p.slot + p.nbytes])
            if progress is not None:
                progress(sum(p.nbytes for p in pieces))
        f.commit()
    except BaseException:
        f.discard()
        raise
