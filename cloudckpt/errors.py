"""The one error tree of cloudckpt.

Every error cloudckpt raises derives from :class:`CloudCkptError`. Leaves also inherit the
builtin a caller would naturally catch (``FileNotFoundError``, ``FileExistsError``,
``PermissionError``, ``ValueError``, ``TypeError``), so ``except FileNotFoundError`` keeps working
for code that knows nothing of cloudckpt. Errors are always raised ``from`` their cause.

Messages never contain secrets (keys, tokens, signed URLs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class CloudCkptError(Exception):
    """Base of every error raised by cloudckpt."""


class ConfigError(CloudCkptError, ValueError):
    """Bad options, URL or credentials configuration (detected before any request)."""


# --- storage -----------------------------------------------------------------------------------


class StorageError(CloudCkptError):
    """A request to an object store failed. ``key`` names the object when there is one."""

    def __init__(self, message: str, *, key: str | None = None, operation: str | None = None):
        super().__init__(message)
        self.key = key
        self.operation = operation


class ObjectNotFound(StorageError, FileNotFoundError):
    """The object (or bucket) does not exist."""


class BucketNotFound(ObjectNotFound):
    """The bucket named in the URL does not exist."""


class ObjectExists(StorageError, FileExistsError):
    """A ``create``-mode put found the key already present (412 / If-None-Match)."""


class AccessDenied(StorageError, PermissionError):
    """The store refused the credentials or the operation (403). Never retried."""


class ObjectTooLarge(StorageError, ValueError):
    """A size-limited read (``get(key, max_bytes=...)``) found the object larger than the limit;
    its body was not read. ``size`` and ``limit`` say by how much."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        operation: str | None = None,
        size: int | None = None,
        limit: int | None = None,
    ):
        super().__init__(message, key=key, operation=operation)
        self.size = size
        self.limit = limit


class InvalidRange(StorageError, ValueError):
    """A ranged read reached past the end of the object (416)."""


class RetriesExhausted(StorageError):
    """Every attempt of a retriable request failed, or its deadline passed.

    ``last_cause`` holds the exception of the last attempt; ``attempts`` how many were made.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        operation: str | None = None,
        attempts: int = 0,
        last_cause: BaseException | None = None,
    ):
        super().__init__(message, key=key, operation=operation)
        self.attempts = attempts
        self.last_cause = last_cause


# --- integrity ---------------------------------------------------------------------------------


class IntegrityError(CloudCkptError, ValueError):
    """Stored bytes are not what the checkpoint says they are."""


class ChecksumError(IntegrityError):
    """A crc32c mismatch. Names the object and the byte range that failed."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        offset: int | None = None,
        length: int | None = None,
    ):
        super().__init__(message)
        self.key = key
        self.offset = offset
        self.length = length


class ManifestError(IntegrityError):
    """A manifest failed validation. ``path`` says where, like ``tensors["w"].chunks[3]``."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class UnsupportedManifestVersion(ManifestError):
    """The manifest's format name or version is not one this cloudckpt can read."""


class SafetensorsError(ManifestError):
    """A Hugging Face safetensors header or index is malformed, hostile or inconsistent (read by
    :func:`cloudckpt.load_safetensors`, parsed by :mod:`cloudckpt.hf.header`), or a header could
    not be built (a dtype safetensors cannot hold). ``path`` names the file and the entry where
    known. Nothing is allocated or read from a refused header."""


class PickleNotAllowed(ManifestError, PermissionError):
    """The checkpoint holds pickled values and the loader did not pass ``allow_pickle=True``."""


# --- planning ----------------------------------------------------------------------------------


class PlanningError(CloudCkptError, ValueError):
    """A state dict cannot be turned into a consistent save or load plan."""


class UnsupportedValueError(PlanningError, TypeError):
    """A non-tensor value msgpack cannot hold, and pickle was not allowed. Names the key."""


class DuplicateKeyError(PlanningError):
    """Two paths of a nested state dict flatten to the same name."""


class LayoutMismatchError(PlanningError):
    """Ranks disagree on a tensor's dtype or global shape. Names the tensor and the ranks."""


class CoverageError(PlanningError):
    """Pieces leave a gap in, or overlap (other than identical replicas), a tensor or
    destination."""


class MissingKeysError(PlanningError, KeyError):
    """Names requested by a load are absent from the checkpoint. ``keys`` lists them."""

    def __init__(self, message: str, *, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys = keys

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(PlanningError):
    """A requested global shape differs from the stored one. Names both shapes."""


# --- checkpoint-level --------------------------------------------------------------------------


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: the exception type name, message and formatted traceback."""

    rank: int
    error_type: str
    message: str
    traceback: str = ""


class CheckpointError(CloudCkptError):
    """A distributed save or load failed. Raised identically on every rank.

    ``failures`` maps each failed rank to its :class:`RankFailure`.
    """

    def __init__(self, message: str, *, failures: Mapping[int, RankFailure] | None = None):
        self.failures = dict(failures or {})
        if self.failures:
            detail = "; ".join(
                f"rank {r}: {f.error_type}: {f.message}" for r, f in sorted(self.failures.items())
            )
            message = f"{message} ({detail})"
        super().__init__(message)


class CheckpointExists(CheckpointError, FileExistsError):
    """A committed checkpoint (a manifest) already exists at that URL."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no manifest) at that URL."""


class ProtocolError(CloudCkptError, ValueError):
    """A message between ranks is malformed (the ranks run different cloudckpt versions?)."""


class CollectiveTimeout(CheckpointError, TimeoutError):
    """A peer did not answer a collective within the configured timeout (dead or hung rank)."""


class StagingMemoryError(CloudCkptError, MemoryError):
    """An async save would need more host staging memory than its configured limit."""


class SaveInProgress(CloudCkptError, RuntimeError):
    """An async save is still running and the caller asked not to wait for it."""


# --- Hugging Face safetensors ------------------------------------------------------------------


class ExportTargetNotEmpty(CloudCkptError, FileExistsError):
    """A safetensors export found safetensors files or an index at its destination already (or
    another export took a name first); it writes nothing over them. ``names`` lists them."""

    def __init__(self, message: str, *, names: tuple[str, ...] = ()):
        super().__init__(message)
        self.names = names


# --- the error every rank raises ---------------------------------------------------------------

_combined_lock = threading.Lock()
_combined_classes: dict[type[CloudCkptError], type[CheckpointError]] = {}


def checkpoint_error_class(error_types: Iterable[str]) -> type[CheckpointError]:
    """The class every rank raises when failed ranks raised errors of the class names
    ``error_types``: when all are one cloudckpt error class, a :class:`CheckpointError` that is
    also that class (so ``except MissingKeysError`` works on every rank, including those that did
    not detect it); plain :class:`CheckpointError` otherwise. Each combined class is made once."""
    names = set(error_types)
    if len(names) != 1:
        return CheckpointError
    cls = globals().get(names.pop())
    if not (isinstance(cls, type) and issubclass(cls, CloudCkptError)):
        return CheckpointError
    if issubclass(cls, CheckpointError):
        return cls
    with _combined_lock:
        combined = _combined_classes.get(cls)
        if combined is None:
            try:
                made = type(cls.__name__, (CheckpointError, cls), {"__module__": __name__})
            except TypeError:  # incompatible builtin layouts: fall back to the plain class
                made = CheckpointError
            combined = made if issubclass(made, CheckpointError) else CheckpointError
            _combined_classes[cls] = combined
        return combined


class PeerError(StorageError, ConnectionError):
    """Another node's local checkpoint tier did not answer as the protocol says (unreachable,
    refused, a malformed or oversized answer). Nothing of its answer is used: the load reads the
    object from the next tier (another peer, then the object store)."""


# --- the rank-0 guard --------------------------------------------------------------------------


class CollectiveMismatch(CheckpointError, RuntimeError):
    """A collective save or load that not every rank of its process group joined within
    ``join_timeout``, or that ranks joined with different calls (save / load, URLs). Raised on
    every rank that made the call, within seconds; names the ranks and what differs."""
