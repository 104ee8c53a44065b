"""The memos of the plan codecs, forgotten together."""

from cloudckpt.planning.load import plan_codec as _load_plan_codec
from cloudckpt.planning.save import local_plan as _local_plan


def clear_header_caches() -> None:
    """Forget the plan headers the plan codecs memoise (pure memos: only memory is freed)."""
    _load_plan_codec.HEADER_CACHE.clear()
    _local_plan.HEADER_CACHE.clear()
