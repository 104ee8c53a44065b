"""The trainers' frameworks are optional extras: imported on first use, never at import time."""

from __future__ import annotations

import importlib
from types import ModuleType

from cloudckpt.errors import ConfigError


def import_framework(module: str, extra: str) -> ModuleType:
    """``import module``; a ``ConfigError`` naming the extra to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{module} is not installed: pip install 'cloudckpt[{extra}]' ({exc})"
        ) from exc
