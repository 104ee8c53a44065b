"""The store options, stores and managers of one run of the ``cloudckpt`` command.

Contract: :func:`set_storage` is called once by :func:`cloudckpt.cli.main.main` with the one
``StorageOptions`` of the run (None: the standard AWS chain); every command then opens its stores
(:func:`open_store`, shared and closed at exit) and managers (:func:`manager`) with it.
:func:`progress` is the command's tqdm bar: on stderr when it is a terminal, else silent.
"""

from __future__ import annotations

import sys
from typing import Any

from cloudckpt.errors import ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY

#: The StorageOptions of this run of the command (None: the AWS chain).
_STORAGE: Any = None


def set_storage(options: Any) -> None:
    global _STORAGE
    _STORAGE = options


def storage() -> Any:
    """The StorageOptions of this run (None: the AWS chain)."""
    return _STORAGE


def open_store(url: str):
    from cloudckpt.runtime.loop import shared_store

    return shared_store(url, _STORAGE)  # closed at exit


def has_manifest(store) -> bool:
    from cloudckpt.runtime.loop import run_coroutine

    try:
        run_coroutine(store.head(MANIFEST_KEY))
        return True
    except ObjectNotFound:
        return False


def manager(url: str, **kwargs):
    from cloudckpt.runs.manager import CheckpointManager

    return CheckpointManager(url, storage=_STORAGE, **kwargs)


def progress(total: int | None, desc: str, unit: str = "obj"):
    """A tqdm bar on stderr when it is a terminal, else a silent stand-in."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
