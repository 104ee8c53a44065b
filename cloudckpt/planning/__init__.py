"""Pure planning: piece descriptors, save plans (local, global, cached), load plans and the
read-once-broadcast assignment, with msgpack codecs. No I/O, no torch, no collectives."""

from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.planning.memos import clear_header_caches
from cloudckpt.planning.assemble import (
    WrittenChunks,
    assemble_manifest,
    decode_written_chunks,
    encode_written_chunks,
)
from cloudckpt.planning.cache import SavePlanCache, key_digest, save_plan_cache_key
from cloudckpt.planning.coverage import find_cover_defect
from cloudckpt.planning.load_plan import (
    LocalLoadPlan,
    ReadItem,
    ReadTable,
    Region,
    decode_local_load_plan,
    encode_local_load_plan,
    plan_local_load,
)
from cloudckpt.planning.local_plan import LocalSavePlan, decode_local_save_plan, encode_local_save_plan
from cloudckpt.planning.lru import LRUCache
from cloudckpt.planning.pieces import PieceHeader, PieceSpec, PieceTable, region_str
from cloudckpt.planning.readers import DEFAULT_MIN_BROADCAST_BYTES, Broadcast, ReadAssignment, assign_readers
from cloudckpt.planning.save_plan import GlobalSavePlan, ManifestSkeleton, WriteItem, plan_global_save

__all__ = [
    "DEFAULT_MIN_BROADCAST_BYTES", "DTYPE_ITEMSIZE", "Broadcast", "GlobalSavePlan", "LocalLoadPlan",
    "LRUCache", "LocalSavePlan", "ManifestSkeleton", "PieceHeader", "PieceSpec", "PieceTable", "ReadAssignment",
    "ReadItem", "ReadTable", "Region", "SavePlanCache", "WriteItem", "WrittenChunks", "assemble_manifest",
    "assign_readers", "clear_header_caches", "decode_written_chunks", "encode_written_chunks",
    "decode_local_load_plan", "decode_local_save_plan", "encode_local_load_plan", "encode_local_save_plan",
    "find_cover_defect", "key_digest", "plan_global_save", "plan_local_load", "region_str",
    "save_plan_cache_key",
]
