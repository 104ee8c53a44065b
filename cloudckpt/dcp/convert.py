"""``cloudckpt.convert``: a cloudckpt checkpoint to a DCP checkpoint and back, streaming.

```python
cloudckpt.convert("s3://bucket/run/step-100", "s3://bucket/dcp/step-100", to="dcp")
cloudckpt.convert("s3://bucket/dcp/step-7", "/data/ckpt/step-7", to="cloudckpt",
                  allow_pickle=True)   # DCP's .metadata is a pickle: see below
```

Either side may be on S3 or local (any URL cloudckpt takes). Nothing is held whole in memory:
tensors move stored chunk by stored chunk, in batches of about ``options.object_size`` bytes
(read, verified, written, released), so memory stays near one batch plus the read buffers.

- ``to="dcp"``: the DCP checkpoint has DCP's layout as :class:`cloudckpt.dcp.StorageWriter`
  writes it (``__0_<n>.distcp``, ``.metadata.checksums``, then ``.metadata`` in create mode):
  each stored chunk becomes a DCP chunk of its tensor, each value a DCP bytes item holding
  ``torch.save(value)``, and ``planner_data`` the nesting of the cloudckpt checkpoint (DCP's
  fully qualified names are cloudckpt's dotted names). ``dcp.load`` with DCP's default planner,
  ``FileSystemReader`` (after a copy) and :class:`cloudckpt.dcp.StorageReader` load it. Pickled
  cloudckpt values need ``allow_pickle=True`` to be read, as for ``cloudckpt.load``.
- ``to="cloudckpt"``: a normal committed checkpoint (data objects, then the manifest in create
  mode) that ``cloudckpt.load``, ``load_full`` and ``verify`` accept; each DCP chunk is a
  stored chunk (crc32c per block), the nesting comes from DCP's ``planner_data`` (flat names
  without it). DCP's ``.metadata`` is a pickle: reading it needs ``allow_pickle=True``
  (``--trust``), which says you trust the checkpoint's writer. cloudckpt unpickles it with its
  restricted unpickler even then (:mod:`cloudckpt.dcp.metadata`). Non-tensor values are read with
  ``torch.load(weights_only=True)`` only, and kept when msgpack holds them.

Skipped, and named in :attr:`ConvertResult.skipped` (nothing else is dropped): DCP values that
torch's weights_only unpickler refuses or that msgpack cannot hold (a tensor inside a value,
an object of a class), and DCP tensors of a dtype cloudckpt does not store.
The destination must not hold a committed checkpoint (``CheckpointExists``).
"""

from __future__ import annotations

import io
import math
import time
import uuid
from dataclasses import dataclass

import torch

from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.reads import ChunkIndex, Part, read_parts
from cloudckpt.dcp.reader import check_value, load_checkpoint_metadata
from cloudckpt.dcp.writes import DCP_VERSION, FileOptions, commit, refuse_existing, write_files
from cloudckpt.errors import ConfigError, PickleNotAllowed, PlanningError, UnsupportedValueError
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime import run_coroutine, shared_store

TARGETS = ("dcp", "cloudckpt")
TRUST_MESSAGE = (
    "reading a DCP checkpoint means unpickling its .metadata, and a pickle can run any code it "
    "names; cloudckpt uses a restricted unpickler, but convert a DCP checkpoint only when you "
    "trust who wrote it: pass allow_pickle=True (command line: --trust)")


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did: tensors, stored chunks and values written, tensor bytes moved,
    what was left out (``"name: why"``) and how long it took."""

    src: str
    dst: str
    to: str
    tensors: int
    chunks: int
    values: int
    bytes: int
    skipped: tuple[str, ...]
    seconds: float


def convert(src: str, dst: str, *, to: str, allow_pickle: bool = False, storage=None,
            options: DCPOptions | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into a new one at ``dst`` of format ``to`` (``"dcp"``:
    ``src`` is a cloudckpt checkpoint; ``"cloudckpt"``: ``src`` is a DCP checkpoint). See the
    module doc. ``storage``: :class:`cloudckpt.storage.StorageOptions` for both sides;
    ``options``: :class:`DCPOptions` (``object_size`` is the batch size)."""
    if to not in TARGETS:
        raise ConfigError(f"to must be 'dcp' or 'cloudckpt', got {to!r}")
    options = options or DCPOptions()
    started = time.perf_counter()
    if to == "dcp":
        counts = _to_dcp(str(src), str(dst), allow_pickle, storage, options)
    else:
        if not allow_pickle:
            raise PickleNotAllowed(TRUST_MESSAGE)
        counts = _to_cloudckpt(str(src), str(dst), storage, options)
    return ConvertResult(src=str(src), dst=str(dst), to=to, seconds=time.perf_counter() - started,
                         **counts)


# -- cloudckpt -> DCP -------------------------------------------------------------------------


def _to_dcp(src: str, dst: str, allow_pickle: bool, storage, options: DCPOptions) -> dict:
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    from cloudckpt.api.read_tensors import TensorReader
    from cloudckpt.options import LoadOptions
    from cloudckpt.statedict import torch_dtype

    reader = TensorReader(src, storage=storage, allow_pickle=allow_pickle,
                          options=LoadOptions(max_read_bytes=options.max_read_bytes))
    manifest = reader.manifest
    store = shared_store(dst, storage)
    run_coroutine(refuse_existing(store, dst))
    state_md: dict = {}
    boxes: list[tuple[str, tuple, tuple, int]] = []   # name, offsets, sizes, bytes
    for name, record in manifest.tensors.items():
        dtype = torch_dtype(record.dtype)
        chunks = [(c.offsets, c.sizes) for c in record.chunks if math.prod(c.sizes)]
        if not chunks:   # a tensor without elements: one empty chunk, as DCP writes it
            chunks = [((0,) * len(record.shape), tuple(record.shape))]
        state_md[name] = TensorStorageMetadata(
            TensorProperties(dtype=dtype), torch.Size(record.shape),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        boxes += [(name, o, s, math.prod(s) * record.itemsize) for o, s in chunks]

    file_opts = FileOptions(object_size=options.object_size,
                            checksum_block_size=options.checksum_block_size,
                            max_staging_bytes=options.max_staging_bytes)
    storage_data, checks, files, moved = {}, {}, 0, 0

    def put(items: list, keys: list) -> None:
        nonlocal files
        written = run_coroutine(write_files(store, [0] * len(items), lambda i: items[i],
                                            prefix="__0_", options=file_opts, first_file=files))
        files += len({w.info.relative_path for w in written})
        for key, w in zip(keys, written):
            storage_data[key] = w.info
            checks[(w.info.relative_path, w.info.offset)] = w.checks

    for group in pack_in_order([b[3] for b in boxes], options.object_size):
        batch = [boxes[i] for i in group]
        wanted = [(n, o, s) for n, o, s, nbytes in batch if nbytes]
        fetched = iter(reader.read_boxes(wanted))
        tensors = [next(fetched) if nbytes else
                   torch.empty(s, dtype=torch_dtype(manifest.tensors[n].dtype))
                   for n, o, s, nbytes in batch]
        put(tensors, [MetadataIndex(n, o) for n, o, _, _ in batch])
        moved += sum(b[3] for b in batch)
        del tensors, fetched
    values = dict(manifest.values)
    paths = paths_of(manifest.structure, list(state_md) + list(values))
    order, skipped = list(paths), []
    blobs, keys = [], []
    for name, value in values.items():   # split where DCP's planner would split the value
        split = dcp_leaves(value)
        if not split:
            skipped.append(f"{name}: holds only empty containers, which DCP does not store")
        at = order.index(name)
        order[at:at + 1] = [name + "".join(f".{k}" for k in sub) for sub, _ in split]
        for sub, leaf in split:
            fqn = name + "".join(f".{k}" for k in sub)
            paths[fqn] = tuple(paths[name]) + tuple(sub)
            state_md[fqn] = BytesStorageMetadata()
            buf = io.BytesIO()
            torch.save(leaf, buf)
            blobs.append(buf)
            keys.append(MetadataIndex(fqn))
    if blobs:
        put(blobs, keys)

    save_id = str(uuid.uuid4())
    paths = {name: paths[name] for name in order if name in state_md}
    metadata = Metadata(state_dict_metadata={name: state_md[name] for name in paths},
                        planner_data=paths,
                        storage_data=storage_data,
                        storage_meta=StorageMeta(checkpoint_id=dst, save_id=save_id),
                        version=DCP_VERSION)
    run_coroutine(commit(store, dst, metadata, checks, save_id=save_id,
                         block_size=options.checksum_block_size))
    return dict(tensors=len(manifest.tensors), chunks=len(boxes), values=len(keys),
                bytes=moved, skipped=tuple(skipped))


def dcp_leaves(value) -> list[tuple[tuple, object]]:
    """``(path below the value, leaf)`` pairs of a non-tensor value as DCP's planner flattens a
    state dict (mappings always; lists holding mappings or lists that hold them); ``[((),
    value)]`` for a value it keeps whole."""
    try:
        from torch.distributed.checkpoint._traverse import traverse_state_dict
    except ImportError:  # pragma: no cover - a torch without it: keep values whole
        return [((), value)]
    found: list = []
    traverse_state_dict({"v": value}, lambda path, leaf: found.append((tuple(path[1:]), leaf)))
    return found


def paths_of(structure, names) -> dict:
    """DCP's ``planner_data``: each leaf name's path in the nesting (dict keys as str, list
    indices as int, as DCP records them); a flat name where the structure has no entry."""
    paths: dict = {}

    def walk(node, path: tuple) -> None:
        if not isinstance(node, (list, tuple)) or len(node) != 2:
            return
        tag, body = node
        if tag in ("x", "v"):
            paths[body] = path
        elif tag in ("d", "o"):
            for key, child in body:
                walk(child, path + (str(key),))
        elif tag in ("l", "t"):
            for i, child in enumerate(body):
                walk(child, path + (i,))

    walk(structure, ())
    ordered = [name for name in paths if name in names]   # the checkpoint's order
    ordered += [name for name in names if name not in paths]
    return {name: paths.get(name, (name,)) for name in ordered}


# -- DCP -> cloudckpt -------------------------------------------------------------------------


class _IntoSave:
    """read_parts' consumer: chunks into the streaming save; values checked and collected."""

    def __init__(self, out, chunks: ChunkIndex, skipped: list[str]):
        self.out, self.chunks, self.skipped = out, chunks, skipped
        self.values: dict = {}
        self.moved = 0

    def target(self, part: Part) -> torch.Tensor:
        dtype, sizes = self.chunks.of(part.index)
        return torch.empty(sizes, dtype=dtype)

    def commit(self, part: Part, tensor: torch.Tensor) -> None:
        fqn, offsets = part.ref
        self.out.write(fqn, offsets, tensor)
        self.moved += tensor.numel() * tensor.element_size()

    def take_bytes(self, part: Part, data: bytes) -> None:
        try:
            self.values[part.ref] = check_value(data, part.ref)
        except PickleNotAllowed:
            self.skipped.append(f"{part.ref}: torch.load(weights_only=True) refuses it")


def _to_cloudckpt(src: str, dst: str, storage, options: DCPOptions) -> dict:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from cloudckpt import SaveOptions
    from cloudckpt.api.streaming import StreamingSave
    from cloudckpt.statedict import dtype_name, plain_value

    store = shared_store(src, storage)
    metadata, checksums = load_checkpoint_metadata(store, src)
    out = StreamingSave(dst, storage=storage, batch_bytes=options.object_size,
                        metadata={"converted_from": src, "format": "dcp"},
                        options=SaveOptions(object_size=options.object_size,
                                            checksum_block_size=options.checksum_block_size,
                                            max_staging_bytes=options.max_staging_bytes))
    skipped: list[str] = []
    parts, tensors, chunks = [], [], 0
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            parts.append(Part(ref=fqn, index=MetadataIndex(fqn), is_bytes=True))
            continue
        try:
            out.add_tensor(fqn, dtype_name(entry.properties.dtype), tuple(entry.size))
        except PlanningError:
            skipped.append(f"{fqn}: dtype {entry.properties.dtype} is not one cloudckpt stores")
            continue
        tensors.append(fqn)
        for chunk in entry.chunks:
            sizes = tuple(chunk.sizes)
            if math.prod(sizes):
                parts.append(Part(ref=(fqn, tuple(chunk.offsets)),
                                  index=MetadataIndex(fqn, chunk.offsets), is_bytes=False,
                                  offsets=(0,) * len(sizes), lengths=sizes))
                chunks += 1
    index = ChunkIndex(metadata)
    consumer = _IntoSave(out, index, skipped)
    read_parts(store, parts, storage_data=metadata.storage_data,
               checksums=checksums.items if checksums else None, chunks=index,
               consumer=consumer, batch_bytes=options.read_batch_bytes,
               max_bytes=options.max_read_bytes,
               block_size=checksums.block_size if checksums else 1)
    leaves, values = regroup(metadata.planner_data, tensors, consumer.values)
    kept = {}
    for name, path in leaves.items():
        if name in values:
            try:
                out.set_value(name, plain_value(values[name]))
            except (UnsupportedValueError, PlanningError, TypeError, ValueError):
                skipped.append(f"{name}: a {type(values[name]).__name__} msgpack cannot hold")
                continue
        kept[name] = path
    out.commit(structure_of(kept, set(tensors)))
    return dict(tensors=len(tensors), chunks=chunks, values=len(kept) - len(tensors),
                bytes=consumer.moved, skipped=tuple(skipped))


def regroup(planner_data, tensors: list[str], values: dict) -> tuple[dict, dict]:
    """cloudckpt's leaves from DCP's: ``(name -> path, name -> value)``. DCP splits a list into
    leaves when it holds a mapping; cloudckpt keeps a list without tensors as one value: such
    lists are rebuilt from DCP's leaves (through ``planner_data``'s paths) into one value named
    by its path. Without usable paths, DCP's names stay flat."""
    if not isinstance(planner_data, dict):   # a planner of its own: no paths to use
        planner_data = {}
    names = [n for n in planner_data if n in values or n in tensors]
    names += [n for n in list(tensors) + list(values) if n not in names]
    flat = ({n: (n,) for n in names}, dict(values))
    root: dict = {}
    for name in names:
        path = planner_data.get(name)
        if not isinstance(path, (tuple, list)) or not path or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            return flat
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                return flat   # a leaf and a container at one path
        if path[-1] in node:
            return flat
        node[path[-1]] = (name,)
    tensor_set = set(tensors)
    leaves, merged = {}, {}

    def holds_tensor(node) -> bool:
        if isinstance(node, tuple):
            return node[0] in tensor_set
        return any(holds_tensor(child) for child in node.values())

    def rebuild(node):
        if isinstance(node, tuple):
            return values.get(node[0])
        if _is_list(node):
            return [rebuild(node[i]) for i in range(len(node))]
        return {k: rebuild(v) for k, v in node.items()}

    def walk(node, path: tuple) -> None:
        if isinstance(node, tuple):
            leaves[node[0]] = path
            if node[0] in values:
                merged[node[0]] = values[node[0]]
            return
        if path and _is_list(node) and not holds_tensor(node):
            name = ".".join(str(k) for k in path)
            leaves[name], merged[name] = path, rebuild(node)
            return
        for key, child in node.items():
            walk(child, path + (key,))

    walk(root, ())
    return leaves, merged


def _is_list(node: dict) -> bool:
    keys = list(node)
    return bool(keys) and all(isinstance(k, int) for k in keys) and \
        sorted(keys) == list(range(len(keys)))


def structure_of(leaves: dict, tensors: set) -> list:
    """A :mod:`cloudckpt.statedict` structure for ``leaves`` (name -> path): nested dicts, and
    lists where a node's keys are the indices 0..n-1."""
    root: dict = {}
    for name, path in leaves.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = ("x" if name in tensors else "v", name)

    def build(node):
        if isinstance(node, tuple):
            return [node[0], node[1]]
        if _is_list(node):
            return ["l", [build(node[i]) for i in range(len(node))]]
        return ["d", [[k, build(v)] for k, v in node.items()]]

    return build(root)


__all__ = ["ConvertResult", "TARGETS", "TRUST_MESSAGE", "convert"]
