"""``cloudckpt.convert``: a cloudckpt checkpoint to a DCP checkpoint and back, streaming.

```python
cloudckpt.convert("s3://bucket/run/step-100", "s3://bucket/dcp/step-100", to="dcp")
cloudckpt.convert("s3://bucket/dcp/step-7", "/data/ckpt/step-7", to="cloudckpt",
                  allow_pickle=True)   # DCP's .metadata is a pickle: see below
```

Either side may be on S3 or local (any URL cloudckpt takes). Nothing is held whole in memory
but DCP's bytes items (values, and the tuples of tensors DCP stores whole): tensors move stored
chunk by stored chunk, in batches of about ``options.object_size`` bytes (read, verified,
written, released), so memory stays near one batch plus the read buffers.

Either way the nesting is what DCP keeps (:mod:`cloudckpt.dcp.nesting`): converting and
loading whole gives what DCP's own ``dcp_to_torch_save`` gives, containers and their kinds
(tuple, list, dict) included.

- ``to="dcp"``: the DCP checkpoint has DCP's layout as :class:`cloudckpt.dcp.StorageWriter`
  writes it (``__0_<n>.distcp``, ``.metadata.checksums``, then ``.metadata`` in create mode),
  split into items as DCP's planner splits the state dict ``load_full`` returns: each stored
  chunk of a tensor item becomes a DCP chunk; a value, and a tuple holding tensors (which DCP
  stores whole), a bytes item holding ``torch.save(value)`` (the tuple's tensors read whole);
  ``planner_data`` the paths (DCP's fully qualified names are the dotted paths): the very
  items ``dcp.save`` writes for that state dict. ``dcp.load`` with DCP's default planner,
  ``FileSystemReader`` (after a copy) and :class:`cloudckpt.dcp.StorageReader` load it.
  Pickled cloudckpt values need ``allow_pickle=True`` to be read, as for ``cloudckpt.load``.
  Named in :attr:`ConvertResult.changed`, as DCP's own save changes them: empty dicts (not
  stored), int keys and ``OrderedDict`` kinds of the mappings DCP walks (they come back ``str``
  keys and ``dict``).
- ``to="cloudckpt"``: a normal committed checkpoint (data objects, then the manifest in create
  mode) that ``cloudckpt.load``, ``load_full`` and ``verify`` accept, holding what
  ``cloudckpt.save`` would write for the state dict ``dcp_to_torch_save`` rebuilds: each DCP
  chunk is a stored chunk (crc32c per block), tensors inside DCP values (a tuple of tensors)
  are tensors of their own. The nesting comes from DCP's ``planner_data`` (flat names without
  it, or where its paths contradict each other: named in ``changed``, as are holes of a list,
  where DCP dropped an empty dict, rebuilt as ``None``). DCP's ``.metadata`` is a pickle:
  reading it needs ``allow_pickle=True`` (``--trust``), which says you trust the checkpoint's
  writer. cloudckpt unpickles it with its restricted unpickler even then
  (:mod:`cloudckpt.dcp.metadata`). Non-tensor values are read with
  ``torch.load(weights_only=True)`` only, and kept when msgpack holds them. The nesting is
  planned (values read) before anything is written: two leaves of one dotted name
  (``DuplicateKeyError``) fail with nothing written.

Skipped, and named in :attr:`ConvertResult.skipped` (nothing else is dropped): DCP values that
torch's weights_only unpickler refuses, that msgpack cannot hold (an object of a class) or
that hold a tensor of a dtype cloudckpt does not store, DCP tensors of such a dtype, and
cloudckpt leaves outside the checkpoint's nesting (``load_full`` does not return them either).
The destination must not hold a committed checkpoint (``CheckpointExists``).
"""

from __future__ import annotations

import io
import math
import time
import uuid
from dataclasses import dataclass

import torch

from cloudckpt.dcp.nesting import dcp_items, dcp_name, materialize, rebuild
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.reader import check_value, load_checkpoint_metadata
from cloudckpt.dcp.reads import ChunkIndex, Part, read_parts
from cloudckpt.dcp.writes import DCP_VERSION, FileOptions, commit, refuse_existing, write_files
from cloudckpt.errors import (
    ConfigError,
    DuplicateKeyError,
    PickleNotAllowed,
    PlanningError,
    UnsupportedValueError,
)
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime.loop import run_coroutine, shared_store

TARGETS = ("dcp", "cloudckpt")
TRUST_MESSAGE = (
    "reading a DCP checkpoint means unpickling its .metadata, and a pickle can run any code it "
    "names; cloudckpt uses a restricted unpickler, but convert a DCP checkpoint only when you "
    "trust who wrote it: pass allow_pickle=True (command line: --trust)"
)


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did: tensors, stored chunks and values written, tensor bytes moved,
    what was left out (``"name: why"``), what the destination's format keeps differently
    (``changed``, ``"name: what"``: see the module doc) and how long it took."""

    src: str
    dst: str
    to: str
    tensors: int
    chunks: int
    values: int
    bytes: int
    skipped: tuple[str, ...]
    seconds: float
    changed: tuple[str, ...] = ()


def convert(
    src: str,
    dst: str,
    *,
    to: str,
    allow_pickle: bool = False,
    storage=None,
    options: DCPOptions | None = None,
) -> ConvertResult:
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
    return ConvertResult(
        src=str(src), dst=str(dst), to=to, seconds=time.perf_counter() - started, **counts
    )


# -- cloudckpt -> DCP -------------------------------------------------------------------------


def _to_dcp(src: str, dst: str, allow_pickle: bool, storage, options: DCPOptions) -> dict:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from cloudckpt.api.read_tensors import TensorReader
    from cloudckpt.options import LoadOptions
    from cloudckpt.statedict.dtypes import torch_dtype
    from cloudckpt.statedict.flatten import unflatten_state_dict

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


# -- DCP -> cloudckpt -------------------------------------------------------------------------


class _IntoSave:
    """read_parts' consumer: values checked and kept (or named in ``skipped``), tensor chunks
    into the streaming save under their cloudckpt names."""

    def __init__(self, chunks: ChunkIndex, skipped: list[str]):
        self.chunks, self.skipped = chunks, skipped
        self.out, self.name_of = None, {}
        self.values: dict = {}
        self.moved = 0

    def target(self, part: Part) -> torch.Tensor:
        dtype, sizes = self.chunks.of(part.index)
        return torch.empty(sizes, dtype=dtype)

    def commit(self, part: Part, tensor: torch.Tensor) -> None:
        fqn, offsets = part.ref
        self.out.write(self.name_of[fqn], offsets, tensor)
        self.moved += tensor.numel() * tensor.element_size()

    def take_bytes(self, part: Part, data: bytes) -> None:
        try:
            value = check_value(data, part.ref)
        except PickleNotAllowed:
            self.skipped.append(f"{part.ref}: torch.load(weights_only=True) refuses it")
            return
        why = _unkept(part.ref, value)
        if why:
            self.skipped.append(f"{part.ref}: {why}")
        else:
            self.values[part.ref] = value


def _unkept(fqn: str, value) -> str | None:
    """Why cloudckpt cannot keep the DCP value ``fqn`` (tensors inside become tensors of
    their own, the rest values msgpack holds), or None."""
    from cloudckpt.manifest.values import encode_value
    from cloudckpt.statedict.flatten import flatten_state_dict

    try:
        flat = flatten_state_dict({fqn: value})
    except PlanningError as exc:
        return str(exc).split(" (allowed:")[0]
    for leaf in flat.values.values():
        try:
            encode_value(leaf.value, key=leaf.name, allow_pickle=False)
        except UnsupportedValueError as exc:
            inner = leaf.value is not value
            return f"a {type(leaf.value).__name__} msgpack cannot hold" + (
                f" ({exc.__cause__})" if inner and exc.__cause__ else ""
            )
    return None


def _to_cloudckpt(src: str, dst: str, storage, options: DCPOptions) -> dict:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from cloudckpt import SaveOptions
    from cloudckpt.api.streaming import StreamingSave
    from cloudckpt.statedict.dtypes import dtype_name
    from cloudckpt.statedict.flatten import flatten_state_dict

    store = shared_store(src, storage)
    metadata, checksums = load_checkpoint_metadata(store, src)
    index = ChunkIndex(metadata)
    skipped: list[str] = []
    consumer = _IntoSave(index, skipped)

    def read(parts: list[Part]) -> None:
        read_parts(
            store,
            parts,
            storage_data=metadata.storage_data,
            checksums=checksums.items if checksums else None,
            chunks=index,
            consumer=consumer,
            batch_bytes=options.read_batch_bytes,
            max_bytes=options.max_read_bytes,
            block_size=checksums.block_size if checksums else 1,
        )

    # values first: the whole nesting is planned before anything is written
    read(
        [
            Part(ref=fqn, index=MetadataIndex(fqn), is_bytes=True)
            for fqn, entry in metadata.state_dict_metadata.items()
            if not isinstance(entry, TensorStorageMetadata)
        ]
    )
    entries, placeholders = [], {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            try:
                dtype_name(entry.properties.dtype)
            except PlanningError:
                skipped.append(f"{fqn}: dtype {entry.properties.dtype} is not one cloudckpt stores")
                continue
            leaf = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")
            placeholders[id(leaf)] = fqn
            entries.append((fqn, leaf))
        elif fqn in consumer.values:
            entries.append((fqn, consumer.values[fqn]))
    nested, changed = rebuild(entries, metadata.planner_data)
    try:
        flat = flatten_state_dict(nested)
    except DuplicateKeyError as exc:
        raise DuplicateKeyError(
            f"{exc}: cloudckpt names each leaf by its path, so it cannot "
            "hold both; rename one in the DCP checkpoint's state dict "
            "and save it again"
        ) from exc
    del nested

    out = consumer.out = StreamingSave(
        dst,
        storage=storage,
        batch_bytes=options.object_size,
        metadata={"converted_from": src, "format": "dcp"},
        options=SaveOptions(
            object_size=options.object_size,
            checksum_block_size=options.checksum_block_size,
            max_staging_bytes=options.max_staging_bytes,
        ),
    )
    for name, leaf in flat.values.items():
        out.set_value(name, leaf.value)
    parts, inline = [], []
    for name, leaf in flat.tensors.items():
        ((spec, tensor),) = leaf.pieces
        out.add_tensor(name, spec.dtype, spec.global_shape)
        fqn = placeholders.get(id(tensor))
        if fqn is None:  # a tensor that sat inside a DCP value
            inline.append((name, tensor))
            continue
        consumer.name_of[fqn] = name
        for chunk in metadata.state_dict_metadata[fqn].chunks:
            sizes = tuple(chunk.sizes)
            if math.prod(sizes):
                parts.append(
                    Part(
                        ref=(fqn, tuple(chunk.offsets)),
                        index=MetadataIndex(fqn, chunk.offsets),
                        is_bytes=False,
                        offsets=(0,) * len(sizes),
                        lengths=sizes,
                    )
                )
    read(parts)
    for name, tensor in inline:
        out.write(name, (0,) * tensor.dim(), tensor)
        consumer.moved += tensor.numel() * tensor.element_size()
    out.commit(flat.structure)
    return dict(
        tensors=len(flat.tensors),
        chunks=len(parts) + sum(t.numel() > 0 for _, t in inline),
        values=len(flat.values),
        bytes=consumer.moved,
        skipped=tuple(skipped),
        changed=tuple(changed),
    )


__all__ = ["ConvertResult", "TARGETS", "TRUST_MESSAGE", "convert"]
