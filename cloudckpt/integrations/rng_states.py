"""This process's random generators as a record of tensors and numbers (no pickle).

``capture()`` holds torch's CPU generator, every CUDA device's (when CUDA is initialised),
numpy's global ``RandomState`` and Python's ``random``; ``restore(record)`` sets them back.
The trainers' checkpoints keep one record per rank (``rank<N>`` keys), as the Trainer's own
``rng_state_<N>.pth`` files do.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from cloudckpt.errors import ManifestError


def capture() -> dict[str, Any]:
    """The generators' states now."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    record: dict[str, Any] = {
        "torch": torch.random.get_rng_state(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["cuda"] = list(torch.cuda.get_rng_state_all())
    return record


def restore(record: Any) -> None:
    """Set the generators from a record of :func:`capture`; a record that is not one (wrong
    keys, types or sizes: it comes from storage) raises ``ManifestError`` and sets nothing."""
    try:
        torch_state = record["torch"]
        nps = record["numpy"]
        py = record["python"]
        keys = np.asarray(nps["keys"].numpy(), dtype=np.int64)
        internal = tuple(int(v) for v in py["internal"].tolist())
        np_state = (
            str(nps["name"]),
            keys.astype(np.uint32),
            int(nps["pos"]),
            int(nps["has_gauss"]),
            float(nps["cached_gaussian"]),
        )
        py_state = (int(py["version"]), internal, py["gauss"])
        if not isinstance(torch_state, torch.Tensor) or torch_state.numel() != _TORCH_STATE_BYTES:
            raise ValueError("torch state of the wrong size")
        if keys.shape != (624,) or len(internal) != 625:
            raise ValueError("numpy or Python state of the wrong size")
        if py_state[2] is not None and not isinstance(py_state[2], float):
            raise ValueError("Python state's gauss is not a float")
        cuda = record.get("cuda") or []
        if not isinstance(cuda, list) or not all(isinstance(c, torch.Tensor) for c in cuda):
            raise ValueError("CUDA states are not a list of tensors")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ManifestError(f"not a random-generator record of cloudckpt ({exc})") from exc
    torch.random.set_rng_state(torch_state.to(torch.uint8))
    np.random.set_state(np_state)
    random.setstate(py_state)
    if cuda and torch.cuda.is_available():  # CUDA paths are written, not run, on CPU machines
        torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in cuda])


#: the size of torch's CPU generator state (mt19937 plus its seed and normal cache)
_TORCH_STATE_BYTES = torch.random.get_rng_state().numel()
