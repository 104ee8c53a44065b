"""The storage of one run of the ``cloudckpt`` command: its one ``StorageOptions`` and what is
opened with it.

Contract: :func:`cloudckpt.cli.main.main` makes one :class:`CommandStorage` from the global
options (:func:`cloudckpt.cli.options.storage_options`) and passes it to the command; the
command opens every store (:meth:`CommandStorage.open`, shared and closed at exit) and manager
(:meth:`CommandStorage.manager`) with it, and gives its ``options`` to every library call that
takes ``storage=``. Nothing else holds the command's storage options (no global, no default
set in the runtime). :func:`progress` is the command's tqdm bar: on stderr when it is a
terminal, else silent.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloudckpt.errors import ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY

if TYPE_CHECKING:  # imported when used: `cloudckpt --help` stays quick
    from cloudckpt.runs.manager import CheckpointManager
    from cloudckpt.storage.base import ObjectStore
    from cloudckpt.storage.options import StorageOptions


@dataclass(frozen=True, kw_only=True)
class CommandStorage:
    """The ``StorageOptions`` of this run of the command (``None``: the standard AWS chain)."""

    options: StorageOptions | None = None

    def open(self, url: str) -> ObjectStore:
        """The shared store of ``url`` (closed at exit)."""
        from cloudckpt.runtime.loop import shared_store

        return shared_store(url, self.options)

    def manager(self, url: str, **kwargs: Any) -> CheckpointManager:
        """A ``CheckpointManager`` of the run at ``url`` with these options."""
        from cloudckpt.runs.manager import CheckpointManager

        return CheckpointManager(url, storage=self.options, **kwargs)


def has_manifest(store: ObjectStore) -> bool:
    """Whether ``store``'s root is a checkpoint (one HEAD of its manifest)."""
    from cloudckpt.runtime.loop import run_coroutine

    try:
        run_coroutine(store.head(MANIFEST_KEY))
        return True
    except ObjectNotFound:
        return False


def progress(total: int | None, desc: str, unit: str = "obj") -> Any:
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
