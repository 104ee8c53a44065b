"""torch dtypes <-> the allow-listed dtype names a manifest stores (``"bfloat16"``).

The allow-list is :data:`cloudckpt.manifest.dtypes.DTYPE_ITEMSIZE`; a name the installed torch
does not have is refused like a name outside the list.
"""

from __future__ import annotations

import torch

from cloudckpt.errors import PlanningError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE

_DTYPE_NAMES = {
    getattr(torch, n): n for n in DTYPE_ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> allow-listed name (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise PlanningError(
            f"dtype {dtype} is not supported (allowed: {', '.join(DTYPE_ITEMSIZE)})"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Allow-listed name -> torch dtype."""
    dtype = getattr(torch, name, None) if name in DTYPE_ITEMSIZE else None
    if not isinstance(dtype, torch.dtype):
        raise PlanningError(f"dtype {name!r} is not supported by this torch")
    return dtype
