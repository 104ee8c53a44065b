"""``map_location`` as ``torch.load`` takes it: where the tensors a load creates are placed.

Contract (:func:`placement`): ``map_location`` is

- ``None``: CPU (where cloudckpt reads them);
- a device (``"cpu"``, ``"cuda:1"``, ``torch.device(...)``, an int for a CUDA index);
  ``"meta"``: tensors of the right shape and dtype and no data (nothing is read);
- a dict from location to location, as ``torch.load``: cloudckpt does not record the device a
  tensor was saved from, so every stored tensor's location is ``"cpu"``: ``{"cpu": "cuda:0"}``
  moves them, a dict without ``"cpu"`` leaves them on CPU;
- a callable ``f(tensor, location)`` (``location`` is ``"cpu"``) returning the tensor to use or
  ``None`` (keep it): ``lambda t, loc: t.cuda(0)`` works as with ``torch.load``'s storages.

A value that is none of these, a string that is no device, or a CUDA device in a process without
CUDA raises :class:`~cloudckpt.errors.ConfigError` before anything is read. (CUDA targets are
exercised only where a GPU is present.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.errors import ConfigError

__all__ = ["Placement", "placement"]

#: The location every stored tensor has for a ``map_location`` dict or callable.
STORED_LOCATION = "cpu"


@dataclass(frozen=True)
class Placement:
    """A validated ``map_location``: ``device`` when every tensor goes to one known device
    (``None`` for CPU or a callable's choice), ``call`` for a callable."""

    device: torch.device | None = None
    call: Callable[[torch.Tensor, str], Any] | None = None

    @property
    def meta(self) -> bool:
        """Whether tensors are created on the meta device (no data read)."""
        return self.device is not None and self.device.type == "meta"

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (read on CPU) where the ``map_location`` puts it."""
        if self.call is not None:
            placed = self.call(tensor, STORED_LOCATION)
            if placed is None:
                return tensor
            if not isinstance(placed, torch.Tensor):
                raise ConfigError(
                    f"map_location returned a {type(placed).__name__}, not a tensor or None "
                    f"(it is called as map_location(tensor, {STORED_LOCATION!r}))"
                )
            return placed
        if self.device is None or self.device.type == "cpu":
            return tensor
        return tensor.to(self.device)


def _device(value: Any, what: str, *, here: bool = True) -> torch.device:
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise ConfigError(
            f"{what} {value!r} is not a device: give a device string ('cpu', 'cuda:0'), a "
            f"torch.device, an int, a dict or a callable, as torch.load takes"
        )
    try:
        device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{what} {value!r} is not a device: {exc}") from exc
    if here and device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{what} {value!r}: CUDA is not available in this process; load to 'cpu' "
            f"(map_location='cpu') and move the tensors later"
        )
    return device


def placement(map_location: Any) -> Placement:
    """The validated :class:`Placement` of ``map_location`` (module docstring)."""
    if map_location is None:
        return Placement()
    if isinstance(map_location, dict):
        target = map_location.get(STORED_LOCATION)
        for source, dest in map_location.items():
            _device(source, "map_location key", here=False)  # a location saved elsewhere
            _device(dest, "map_location value")
        return Placement() if target is None else Placement(device=_device(target, "map_location"))
    if callable(map_location):
        return Placement(call=map_location)
    return Placement(device=_device(map_location, "map_location"))
