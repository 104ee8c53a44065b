"""Functions the reliability tests run on every rank of a ProcessWorld (module level, so the
harness can pickle them by reference). Each returns plain data the test process checks."""

from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist

import cloudckpt
from tests.reliability.killpoints import KillPoint, armed, rendezvous_before_manifest
from tests.reliability.states import blank_rank_state, differences, full_expected, rank_state


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def error_names(exc: BaseException) -> list[str]:
    return [c.__name__ for c in type(exc).__mro__]


def save_step(
    url: str,
    step: int,
    gen: int,
    *,
    storage=None,
    options=None,
    point: KillPoint | None = None,
    pids=(),
    state_kw=None,
    outcome_dir: str | None = None,
    run_url: str | None = None,
    barrier_dir: str | None = None,
) -> dict:
    """Save this rank's state of ``(step, gen)``; with ``point``, die where it says.

    Returns ``{"ok": True, ...}`` or ``{"ok": False, "error": [class names], "message": ...}`` for
    a cloudckpt error (anything else propagates to the harness). With ``outcome_dir`` the
    outcome is also written to ``<outcome_dir>/rank<r>.json``: a survivor's answer is lost when
    the harness reports a dead peer. With ``run_url`` the save goes through
    ``CheckpointManager(run_url).save(step, ...)`` (``url`` is then its step URL). With
    ``barrier_dir``, the coordinator's manifest put waits for another job's (see
    ``killpoints.rendezvous_before_manifest``)."""
    with rendezvous_before_manifest(barrier_dir, 2):
        outcome = _save_step(
            url,
            step,
            gen,
            storage=storage,
            options=options,
            point=point,
            pids=pids,
            state_kw=state_kw,
            run_url=run_url,
        )
    if outcome_dir is not None:
        rank = dist.get_rank()
        tmp = os.path.join(outcome_dir, f".rank{rank}.json")
        with open(tmp, "w") as f:
            json.dump(outcome, f)
        os.replace(tmp, os.path.join(outcome_dir, f"rank{rank}.json"))
    return outcome


def _save_step(url, step, gen, *, storage, options, point, pids, state_kw, run_url) -> dict:
    rank, world = rank_and_world()
    sd = rank_state(rank, world, step, gen, **(state_kw or {}))
    started = time.perf_counter()
    async_ = point is not None and point.async_save
    try:
        with armed(point, rank, pids):
            if run_url is not None:
                mgr = cloudckpt.CheckpointManager(run_url, storage=storage, save_options=options)
                if async_:
                    result = mgr.save(step, sd, blocking=False).result(timeout=300)
                else:
                    result = mgr.save(step, sd)
            elif async_:
                handle = cloudckpt.async_save(sd, url, storage=storage, options=options)
                result = handle.result(timeout=300)
            else:
                result = cloudckpt.save(sd, url, storage=storage, options=options)
    except cloudckpt.CloudCkptError as exc:
        return {
            "ok": False,
            "error": error_names(exc),
            "message": str(exc),
            "seconds": time.perf_counter() - started,
        }
    return {
        "ok": True,
        "bytes": result.bytes_written,
        "objects": result.objects,
        "attempt": result.attempt,
        "seconds": time.perf_counter() - started,
    }


def load_step(url: str, step: int, gen: int, *, storage=None, options=None, state_kw=None) -> dict:
    """Load into a blank state and compare with ``(step, gen)``; names that differ, or the
    error."""
    rank, world = rank_and_world()
    sd = blank_rank_state(rank, world, **(state_kw or {}))
    started = time.perf_counter()
    try:
        cloudckpt.load(sd, url, storage=storage, options=options)
    except cloudckpt.CloudCkptError as exc:
        return {
            "ok": False,
            "error": error_names(exc),
            "message": str(exc),
            "seconds": time.perf_counter() - started,
            "untouched": _untouched(sd),
        }
    want = {k: v for k, v in full_expected(world, step, gen, **(state_kw or {})).items() if k in sd}
    return {"ok": True, "bad": differences(sd, want), "seconds": time.perf_counter() - started}


def _untouched(sd: dict) -> list[str]:
    """Tensors that still hold only the blank sentinel."""
    return [
        k for k, v in sd.items() if isinstance(v, torch.Tensor) and bool((v == 0x5A5A5A5A).all())
    ]


def capture_logs_during(fn_name: str, *args, **kwargs) -> dict:
    """Run another function of this module with every logger at DEBUG, capturing all records
    (formatted, exception text included). Returns the function's result and the text."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            try:
                text = self.format(record)
            except Exception as exc:  # a broken record must not hide others
                text = f"<unformattable {record.name}: {exc!r}>"
            records.append(text)

    handler = Collect(level=logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        result = globals()[fn_name](*args, **kwargs)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return {
        "result": result,
        "log": "\n".join(records),
        "records": len(records),
        "pid": os.getpid(),
    }


def warm_up(url: str, storage=None) -> int:
    """Import the save/load code and open this process's connection (one HEAD), so that a
    timed save that follows measures the save, not the process's first use."""
    import cloudckpt.api.load  # noqa: F401
    import cloudckpt.api.save  # noqa: F401
    from cloudckpt.runtime.loop import run_coroutine, shared_store

    try:
        run_coroutine(shared_store(url, storage).head("manifest.msgpack"))
    except cloudckpt.ObjectNotFound:
        pass
    return os.getpid()
