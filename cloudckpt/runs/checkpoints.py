"""One checkpoint by its URL, whatever its folder's name: ``exists``, ``delete``,
``list_checkpoints`` (the calls a trainer's checkpoint plugin makes).

Contracts:

- :func:`exists` is one HEAD of ``<url>/manifest.msgpack``: true for a committed checkpoint,
  false for nothing or a half-written one. Storage errors (credentials, endpoint) raise.
- :func:`delete` removes one checkpoint the way ``CheckpointManager.delete`` does (plans of
  :mod:`cloudckpt.runs.cleanup`): the manifest first, so a half-deleted checkpoint is never listed
  complete, then its own data objects, then its unfinished uploads; only keys the layout owns;
  objects another checkpoint still references stay (its folder is *retained*, collected with the
  last checkpoint using them). It is judged from the folder above ``url`` (its siblings may
  reference its objects). Before anything goes, a committed checkpoint's manifest must decode
  (without unpickling): a damaged or hostile one raises ``ManifestError`` and nothing is removed
  (``cloudckpt rm URL`` removes it regardless). Nothing there: ``CheckpointNotFound``. Not
  collective: call it on one rank. Do not delete a checkpoint that is being saved.
- :func:`list_checkpoints`: every checkpoint folder right under ``url`` (``step-100``,
  ``epoch=0-step=10.ckpt``, ``checkpoint-500``, ``last``), the complete ones oldest commit first,
  then the half-written ones (``complete=False``) by step and name. Costs as
  ``CheckpointManager.list`` (one delimited walk; one manifest GET per complete folder not named
  ``step-<N>``, for its step).
"""

from __future__ import annotations

from cloudckpt.errors import CheckpointNotFound, ManifestError, ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY, split_folder
from cloudckpt.runs.cleanup import delete_checkpoint, plan_checkpoint
from cloudckpt.runs.pruning import CheckpointInfo, list_run, order_key
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage.urls import parse_store_url
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes
from cloudckpt.wording import plural

__all__ = ["delete", "exists", "list_checkpoints"]


def exists(url: str, *, storage=None) -> bool:
    """Whether a committed checkpoint (its manifest) is at ``url``."""
    store = shared_store(_normal(url), storage)
    try:
        run_coroutine(store.head(MANIFEST_KEY))
    except ObjectNotFound:
        return False
    return True


def delete(url: str, *, storage=None) -> int:
    """Delete the checkpoint at ``url``, complete or half-written; returns the objects removed
    (the manifest included). See the module docstring for what goes and what is refused."""
    url = _normal(url)
    above = split_folder(url)
    if above is None:
        raise ValueError(
            f"{url} is not a checkpoint folder inside a run or bucket (delete takes the URL of "
            f"one checkpoint, e.g. s3://bucket/run/step-100)"
        )
    run_url, name = above
    return run_coroutine(_delete(shared_store(run_url, storage), name, url))


async def _delete(store, name: str, url: str) -> int:
    prefix = name + "/"
    try:
        raw = await fetch_manifest_bytes(store, prefix + MANIFEST_KEY)
    except ObjectNotFound:
        raw = None
    except ManifestError as exc:
        raise _damaged(url, exc) from exc
    if raw is not None:
        try:
            decode_manifest_without_pickle(raw)
        except ManifestError as exc:
            raise _damaged(url, exc) from exc
    else:
        plan = await plan_checkpoint(store, prefix)
        if plan.empty:
            held = (
                f" ({plural(plan.kept, 'object')} of a deleted checkpoint that others still use)"
                if plan.kept
                else ""
            )
            raise CheckpointNotFound(f"no checkpoint at {url}{held}: nothing deleted")
    return await delete_checkpoint(store, prefix)


def _damaged(url: str, exc: Exception) -> ManifestError:
    return ManifestError(
        f"{url}: its manifest cannot be read ({exc}), so what it references is unknown: "
        f"nothing deleted (`cloudckpt rm {url}` removes it regardless)"
    )


def list_checkpoints(url: str, *, storage=None) -> list[CheckpointInfo]:
    """Every checkpoint folder right under ``url``, oldest commit first (module docstring)."""
    url = _normal(url)
    infos = run_coroutine(list_run(shared_store(url, storage), url))
    return sorted(infos, key=lambda i: (not i.complete, order_key(i)[2], order_key(i)))


def _normal(url: str) -> str:
    url = parse_store_url(url).url  # a malformed URL fails here, before any I/O
    return url.rstrip("/") or url
