"""How ``tests/data/manifest_v1.msgpack``, ``manifest_v2.msgpack`` and ``manifest_v3.msgpack`` were
made (and what they must keep decoding to): the same content in format version 1 (the msgpack
document alone) and 2 (the document framed with its crc32c); version 3 adds the fields of an
incremental checkpoint to it (:func:`build_v3`: the second object lies in the sibling folder
``step-000000000007``, the base; every chunk carries its 16-byte XXH3-128 hash, as format version
3 first recorded them; attempt ``...bb``). ``manifest_v2_hash64.msgpack``: :func:`build`'s
content with the 8-byte chunk hashes every save records now (``chunks.hash64``, version 2).

Generate a file only when deliberately creating the golden file of a NEW format version (the
existing files must stay as they are, forever)::

    python -m tests.manifest.golden tests/data/manifest_v1.msgpack 1
    python -m tests.manifest.golden tests/data/manifest_v2.msgpack 2
    python -m tests.manifest.golden tests/data/manifest_v3.msgpack 3
    python -m tests.manifest.golden tests/data/manifest_v2_hash64.msgpack 2 hash64

Content: 5 tensors (2-D sharded over two objects, bfloat16 vector, int64 scalar, an empty tensor
with no chunks, a 2x2 grid of int8 chunks), values of every exact type (tuple, big int, bytes,
None, nested dict with int keys), one pickled value (``fractions.Fraction(1, 3)``, flagged as
pickled: decoding it needs ``allow_pickle=True``), metadata, and a structure mapping. Checksum
block size 16 bytes, so the 24-byte chunks carry 2 crcs (16 + 8 bytes). Data bytes are
deterministic (see ``chunk_bytes``).
"""

from __future__ import annotations

import sys
from fractions import Fraction

import numpy as np
import xxhash

from cloudckpt.checksum import block_crcs, content_hash
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.manifest.lineage import LEGACY_HASH_BYTES
from cloudckpt.manifest.model import Manifest

BLOCK = 16
OBJECTS = ("data/00000000000000aa/r00000-0000.bin", "data/00000000000000aa/r00001-0000.bin")
METADATA = {"step": 100, "note": "golden v1", "tags": ("a", "b")}
VALUES = {
    "optim.param_groups": [
        {
            "lr": 0.001,
            "betas": (0.9, 0.999),
            "weight_decay": 0.0,
            "params": ["model.w", "model.b"],
            "foreach": None,
            "amsgrad": False,
        }
    ],
    "rng": {0: b"\x00\x01\xff", 1: 2**70, -3: -(2**65)},
    "epoch": 7,
}
PICKLED = {"frac": Fraction(1, 3)}
STRUCTURE = [
    "d",
    [
        ["model", ["o", [["w", ["x", "model.w"]], ["b", ["x", "model.b"]]]]],
        [
            "optim",
            ["d", [["step", ["x", "optim.step"]], ["param_groups", ["v", "optim.param_groups"]]]],
        ],
        ["empty", ["x", "empty"]],
        ["grid", ["x", "grid"]],
        ["extra", ["t", [["v", "rng"], ["v", "epoch"]]]],
        ["frac", ["v", "frac"]],
    ],
]
# name -> dtype, shape, chunks [(offsets, sizes, object index, byte offset)]
TENSORS = {
    "model.w": ("float32", (4, 3), [((0, 0), (2, 3), 0, 0), ((2, 0), (2, 3), 1, 0)]),
    "model.b": ("bfloat16", (3,), [((0,), (3,), 0, 24)]),
    "optim.step": ("int64", (), [((), (), 1, 24)]),
    "empty": ("float32", (0, 2), []),
    "grid": (
        "int8",
        (4, 6),
        [
            ((0, 0), (2, 3), 0, 32),
            ((0, 3), (2, 3), 1, 32),
            ((2, 0), (2, 3), 0, 38),
            ((2, 3), (2, 3), 1, 38),
        ],
    ),
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8, "int8": 1}


def chunk_bytes(name: str, index: int) -> bytes:
    """The deterministic bytes stored for chunk ``index`` of ``name``."""
    dtype, _, chunks = TENSORS[name]
    n = int(np.prod(chunks[index][1], dtype=np.int64)) * ITEMSIZE[dtype]
    return bytes((7 * i + 13 * index + len(name)) % 256 for i in range(n))


def build() -> Manifest:
    b = ManifestBuilder(
        world_size=2,
        metadata=METADATA,
        checksum_block_size=BLOCK,
        structure=STRUCTURE,
        created_at=1700000000.5,
        cloudckpt_version="0.1.0",
    )
    for name, (dtype, shape, chunks) in TENSORS.items():
        b.add_tensor(name, dtype, shape)
        for i, (off, size, obj, pos) in enumerate(chunks):
            data = chunk_bytes(name, i)
            b.add_chunk(name, off, size, OBJECTS[obj], pos, len(data), block_crcs(data, BLOCK))
    for k, v in VALUES.items():
        b.set_value(k, v)
    for k, v in PICKLED.items():
        b.set_value(k, v, allow_pickle=True)
    return b.build()


HOMES = ("", "step-000000000007")
BASE = "step-000000000007"
ATTEMPT = "00000000000000bb"


def chunk_hashes(legacy: bool = True) -> bytes:
    """Every chunk's content hash, in manifest order: the 16-byte XXH3-128 digest of its bytes
    (``legacy``, format version 3's first hashes), else its first 8 bytes (``content_hash``)."""
    digest = xxhash.xxh3_128_digest if legacy else content_hash
    return b"".join(
        digest(chunk_bytes(name, i))
        for name, (_, _, chunks) in TENSORS.items()
        for i in range(len(chunks))
    )


def _with_lineage(m: Manifest, **lineage) -> Manifest:
    c = m.columns
    return Manifest(
        world_size=m.world_size,
        created_at=m.created_at,
        cloudckpt_version=m.cloudckpt_version,
        metadata=m.metadata,
        checksum_block_size=m.checksum_block_size,
        objects=m.objects,
        tensor_names=c.names,
        tensor_dtypes=c.dtypes,
        tensor_shapes=m.shapes,
        chunk_counts=np.diff(c.chunk_start),
        chunk_offsets=c.offsets,
        chunk_sizes=c.sizes,
        chunk_object_index=c.object_index,
        chunk_byte_offset=c.byte_offset,
        chunk_byte_length=c.byte_length,
        chunk_crcs=c.crcs,
        value_blobs=dict(c.value_blobs),
        structure=m.structure,
        allow_pickle=True,
        **lineage,
    )


def build_v3() -> Manifest:
    """:func:`build`'s content with the fields of format version 3 (16-byte hashes)."""
    return _with_lineage(
        build(),
        object_homes=HOMES,
        chunk_hashes=chunk_hashes(),
        chunk_hash_bytes=LEGACY_HASH_BYTES,
        base=BASE,
        attempt=ATTEMPT,
    )


def build_hash64() -> Manifest:
    """:func:`build`'s content with the 8-byte chunk hashes of a default save (version 2)."""
    return _with_lineage(build(), chunk_hashes=chunk_hashes(legacy=False))


if __name__ == "__main__":
    out, version = sys.argv[1], int(sys.argv[2])
    made = build_hash64() if sys.argv[3:] == ["hash64"] else build_v3() if version >= 3 else build()
    with open(out, "xb") as f:  # never overwrite a golden file
        f.write(encode_manifest(made, format_version=version))
    print(f"wrote {out} (format version {version})")
