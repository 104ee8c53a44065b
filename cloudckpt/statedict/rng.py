"""``cloudckpt.RNGState``: this process's random generators as a stateful value of a state dict.

```python
state = {"model": model, "optim": optim, "rng": cloudckpt.RNGState()}
cloudckpt.save(state, url)      # on every rank
cloudckpt.load(state, url)      # restores this rank's generators: random ops go on as before
```

Contract:

- What is saved, all as tensors and plain numbers (no pickle): torch's CPU generator
  (``torch.get_rng_state()``, a ``uint8`` tensor), each CUDA device's (``torch.cuda.
  get_rng_state_all()``, only when CUDA is initialized in the process), numpy's global generator
  (``numpy.random.get_state()``: its 624 keys as an ``int64`` tensor, position, Gaussian cache)
  and Python's ``random`` (``random.getstate()``: its 625 words as an ``int64`` tensor, version,
  Gaussian cache).
- One set per rank: under the key ``rank<r>`` (``r`` the global rank, 0 without
  ``torch.distributed``), so a distributed save stores every rank's own states (replicated
  values are never merged across ranks), and each rank's load restores its own.
- Restoring (``load_state_dict``, called by ``cloudckpt.load``) sets every generator saved, so the
  random ops after a load draw what an uninterrupted run would have drawn. CUDA states are
  restored when CUDA is initialized at load time and the device counts agree.
- Another world size: a rank that has no saved state (more ranks than at the save) is missing
  ``<path>/rank<r>/...``: a strict load raises ``MissingKeysError`` naming it; with
  ``strict=False`` that rank keeps its current generators (its random ops then differ from an
  uninterrupted run). States of ranks that no longer exist are ignored (``unexpected_keys``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNGState"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RNGState:
    """The process's random generators, saved and restored per rank (module docstring)."""

    def __repr__(self) -> str:
        return f"RNGState(rank={_rank()})"

    def state_dict(self) -> dict[str, Any]:
        """This rank's generator states under ``rank<r>``."""
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, words, gauss_next = random.getstate()
        states: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "python": {
                "version": int(version),
                "words": torch.tensor(words, dtype=torch.int64),
                "gauss_next": gauss_next,
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = list(torch.cuda.get_rng_state_all())
        return {f"rank{_rank()}": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators from this rank's saved states (kept as they are when absent)."""
        states = state_dict.get(f"rank{_rank()}")
        if not isinstance(states, dict):
            return
        torch.set_rng_state(states["torch"].to(torch.uint8))
        n = states["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
        p = states["python"]
        words = tuple(int(w) for w in p["words"].tolist())
        random.setstate((p["version"], words, p["gauss_next"]))
        cuda = states.get("cuda")
        if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in cuda])
