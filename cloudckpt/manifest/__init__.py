"""The checkpoint manifest: data model, msgpack codec, validation of untrusted bytes, and the
exact-type encoding of non-tensor values. Pure: no I/O, no torch, no collectives."""

from cloudckpt.manifest.builder import ManifestBuilder, expected_crc_count
from cloudckpt.manifest.codec import decode_manifest, encode_manifest
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_NDIM
from cloudckpt.manifest.model import (
    DEFAULT_CHECKSUM_BLOCK_SIZE,
    FORMAT_NAME,
    FORMAT_VERSION,
    Manifest,
    crc_counts,
    tensor_path,
    validate_object_key,
    validate_structure,
)
from cloudckpt.manifest.records import ChunkRecord, ChunkTable, ManifestColumns, TensorRecord
from cloudckpt.manifest.values import decode_value, encode_value, is_pickled, value_path

__all__ = [
    "DEFAULT_CHECKSUM_BLOCK_SIZE", "DTYPE_ITEMSIZE", "FORMAT_NAME", "FORMAT_VERSION", "MAX_NDIM",
    "ChunkRecord", "ChunkTable", "Manifest", "ManifestBuilder", "ManifestColumns", "TensorRecord",
    "crc_counts",
    "decode_manifest", "decode_value", "encode_manifest", "encode_value", "expected_crc_count",
    "is_pickled", "tensor_path", "validate_object_key", "validate_structure", "value_path",
]
