"""cloudckpt -> DCP, streaming, for :func:`cloudckpt.dcp.convert.convert` (``to="dcp"``; the
contract is in that module's doc)."""

from __future__ import annotations

import io
import math
import uuid

import torch

from cloudckpt.api.read_tensors import TensorReader
from cloudckpt.dcp.nesting import dcp_items, dcp_name, materialize
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.writes import DCP_VERSION, FileOptions, commit, refuse_existing, write_files
from cloudckpt.errors import DuplicateKeyError
from cloudckpt.options import LoadOptions
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.statedict.flatten import unflatten_state_dict


def to_dcp(src: str, dst: str, allow_pickle: bool, storage, options: DCPOptions) -> dict:
    """The cloudckpt checkpoint at ``src`` as a new DCP checkpoint at ``dst``
    (:mod:`cloudckpt.dcp.convert`); returns :class:`~cloudckpt.dcp.convert.ConvertResult`'s
    counts."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    reader = TensorReader(
        src,
        storage=storage,
        allow_pickle=allow_pickle,
        options=LoadOptions(max_read_bytes=options.max_read_bytes),
    )
    manifest = reader.manifest
    store = shared_store(dst, storage)
    run_coroutine(refuse_existing(store, dst))
    # the nesting load_full gives, tensors as meta placeholders, split as DCP's planner splits it
    stored = {
        name: torch.empty(tuple(r.shape), dtype=torch_dtype(r.dtype), device="meta")
        for name, r in manifest.tensors.items()
    }
    names_of = {id(t): name for name, t in stored.items()}
    items, changed = dcp_items(
        unflatten_state_dict(manifest.structure, {**manifest.values, **stored})
    )
    reached = set(_leaf_names(manifest.structure))
    skipped = [
        f"{name}: not in the checkpoint's nesting (load_full does not return it either)"
        for name in list(manifest.tensors) + list(manifest.values)
        if name not in reached
    ]
    seen: dict[str, tuple] = {}
    for path, _ in items:
        if seen.setdefault(dcp_name(path), path) != path:
            raise DuplicateKeyError(
                f"paths {seen[dcp_name(path)]!r} and {path!r} both make DCP's name "
                f"{dcp_name(path)!r}: DCP cannot hold both; rename one key and save again"
            )
    tensor_items = [
        (dcp_name(p), names_of[id(leaf)])
        for p, leaf in items
        if isinstance(leaf, torch.Tensor) and id(leaf) in names_of
    ]
    state_md: dict = {}
    boxes: list[tuple[str, tuple, tuple, int]] = []  # name, offsets, sizes, bytes
    fqn_of: dict[str, str] = {}
    for fqn, name in tensor_items:
        record = manifest.tensors[name]
        fqn_of[name] = fqn
        chunks = [(c.offsets, c.sizes) for c in record.chunks if math.prod(c.sizes)]
        if not chunks:  # a tensor without elements: one empty chunk, as DCP writes it
            chunks = [((0,) * len(record.shape), tuple(record.shape))]
        state_md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=stored[name].dtype),
            torch.Size(record.shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
        )
        boxes += [(name, o, s, math.prod(s) * record.itemsize) for o, s in chunks]
    bytes_items = [(p, leaf) for p, leaf in items if dcp_name(p) not in state_md]

    file_opts = FileOptions(
        object_size=options.object_size,
        checksum_block_size=options.checksum_block_size,
        max_staging_bytes=options.max_staging_bytes,
    )
    storage_data, checks, files, moved = {}, {}, 0, 0

    def put(items: list, keys: list) -> None:
        nonlocal files
        written = run_coroutine(
            write_files(
                store,
                [0] * len(items),
                lambda i: items[i],
                prefix="__0_",
                options=file_opts,
                first_file=files,
            )
        )
        files += len({w.info.relative_path for w in written})
        for key, w in zip(keys, written):
            storage_data[key] = w.info
            checks[(w.info.relative_path, w.info.offset)] = w.checks

    for group in pack_in_order([b[3] for b in boxes], options.object_size):
        batch = [boxes[i] for i in group]
        wanted = [(n, o, s) for n, o, s, nbytes in batch if nbytes]
        fetched = iter(reader.read_boxes(wanted))
        tensors = [
            next(fetched) if nbytes else torch.empty(s, dtype=stored[n].dtype)
            for n, o, s, nbytes in batch
        ]
        put(tensors, [MetadataIndex(fqn_of[n], o) for n, o, _, _ in batch])
        moved += sum(b[3] for b in batch)
        del tensors, fetched
    moved += _write_values(bytes_items, names_of, reader, put, state_md, options.object_size)

    save_id = str(uuid.uuid4())
    planner_data = {dcp_name(path): path for path, _ in items}
    metadata = Metadata(
        state_dict_metadata={name: state_md[name] for name in planner_data},
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=dst, save_id=save_id),
        version=DCP_VERSION,
    )
    run_coroutine(
        commit(
            store, dst, metadata, checks, save_id=save_id, block_size=options.checksum_block_size
        )
    )
    return dict(
        tensors=len(tensor_items),
        chunks=len(boxes),
        values=len(planner_data) - len(tensor_items),
        bytes=moved,
        skipped=tuple(skipped),
        changed=tuple(changed),
    )


def _write_values(items, names_of: dict, reader, put, state_md: dict, batch: int) -> int:
    """Each bytes item as ``torch.save`` of its value, tensors inside read whole (a tuple of
    tensors is one item, as DCP stores it), uploaded in batches of about ``batch`` bytes.
    Returns the tensor bytes read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    moved = 0
    blobs, keys, waiting = [], [], 0

    def full(t: torch.Tensor) -> torch.Tensor:
        nonlocal moved
        name = names_of.get(id(t))
        if name is None:  # a tensor inside a pickled value: it is one already
            return t
        moved += t.numel() * t.element_size()
        if not t.numel():
            return torch.empty(t.shape, dtype=t.dtype)
        return reader.read_boxes([(name, (0,) * t.dim(), tuple(t.shape))])[0]

    for path, leaf in items:
        fqn = dcp_name(path)
        state_md[fqn] = BytesStorageMetadata()
        buf = io.BytesIO()
        torch.save(materialize(leaf, full), buf)
        blobs.append(buf)
        keys.append(MetadataIndex(fqn))
        waiting += buf.tell()
        if waiting >= batch:
            put(blobs, keys)
            blobs, keys, waiting = [], [], 0
    if blobs:
        put(blobs, keys)
    return moved


def _leaf_names(structure) -> list[str]:
    """The names of the leaves a structure reaches."""
    names, stack = [], [structure]
    while stack:
        node = stack.pop()
        if not isinstance(node, (list, tuple)) or len(node) != 2:
            continue
        tag, body = node
        if tag in ("x", "v"):
            names.append(body)
        elif tag in ("d", "o"):
            stack.extend(child for _, child in reversed(body))
        elif tag in ("l", "t"):
            stack.extend(reversed(body))
    return names
