"""DCP -> cloudckpt, streaming, for :func:`cloudckpt.dcp.convert.convert` (``to="cloudckpt"``;
the contract is in that module's doc)."""

from __future__ import annotations

import math

import torch

from cloudckpt.api.streaming import StreamingSave
from cloudckpt.dcp.nesting import rebuild
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.reader import check_value, load_checkpoint_metadata
from cloudckpt.dcp.reads import ChunkIndex, Part, read_parts
from cloudckpt.errors import (
    DuplicateKeyError,
    PickleNotAllowed,
    PlanningError,
    UnsupportedValueError,
)
from cloudckpt.manifest.values import encode_value
from cloudckpt.options import SaveOptions
from cloudckpt.runtime.loop import shared_store
from cloudckpt.statedict.dtypes import dtype_name
from cloudckpt.statedict.flatten import flatten_state_dict


class _IntoSave:
    """read_parts' consumer: values checked and kept (or named in ``skipped``), tensor chunks
    into the streaming save under their cloudckpt names."""

    out: StreamingSave  # set once the values are read, before any tensor chunk comes

    def __init__(self, chunks: ChunkIndex, skipped: list[str]):
        self.chunks, self.skipped = chunks, skipped
        self.name_of: dict[str, str] = {}  # DCP fqn -> cloudckpt name
        self.values: dict[str, object] = {}
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


def to_cloudckpt(src: str, dst: str, storage, options: DCPOptions) -> dict:
    """The DCP checkpoint at ``src`` as a new cloudckpt checkpoint at ``dst``
    (:mod:`cloudckpt.dcp.convert`); returns :class:`~cloudckpt.dcp.convert.ConvertResult`'s
    counts."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

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
    entries: list[tuple[str, object]] = []
    placeholders: dict[int, str] = {}  # id of a meta tensor -> its DCP fqn
    tensor_md: dict[str, TensorStorageMetadata] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            try:
                dtype_name(entry.properties.dtype)
            except PlanningError:
                skipped.append(f"{fqn}: dtype {entry.properties.dtype} is not one cloudckpt stores")
                continue
            leaf = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device="meta")
            placeholders[id(leaf)] = fqn
            tensor_md[fqn] = entry
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
    for name, value_leaf in flat.values.items():
        out.set_value(name, value_leaf.value)
    parts: list[Part] = []
    inline: list[tuple[str, torch.Tensor]] = []
    for name, tensor_leaf in flat.tensors.items():
        ((spec, tensor),) = tensor_leaf.pieces
        out.add_tensor(name, spec.dtype, spec.global_shape)
        source = placeholders.get(id(tensor))
        if source is None:  # a tensor that sat inside a DCP value
            inline.append((name, tensor))
            continue
        consumer.name_of[source] = name
        for chunk in tensor_md[source].chunks:
            sizes = tuple(chunk.sizes)
            if math.prod(sizes):
                parts.append(
                    Part(
                        ref=(source, tuple(chunk.offsets)),
                        index=MetadataIndex(source, chunk.offsets),
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
