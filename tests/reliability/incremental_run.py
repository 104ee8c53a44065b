"""The pieces of the incremental-run reliability test (``test_incremental_gc.py``): the states of a
fine-tuning run (some parameters frozen, the others updated at random steps), the save a saver
process runs (with an optional kill point of its own), and the garbage oracle.

Run as a module, it is the concurrent pruning process::

    python -m tests.reliability.incremental_run RUN_URL SEED   (see ``pruner_main``)
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

N_TENSORS = 8
FROZEN = 3  # p0..p2 never change
SHAPE = (64, 128)  # 32 KiB each


def _updated(seed: int, i: int, step: int) -> bool:
    return i >= FROZEN and random.Random(seed * 1_000_003 + i * 1009 + step).random() < 0.5


def versions(seed: int, step: int) -> list[int]:
    return [sum(_updated(seed, i, s) for s in range(1, step + 1)) for i in range(N_TENSORS)]


def state(seed: int, step: int) -> dict:
    """Step ``step``'s state: tensor ``p<i>`` is a function of (seed, i, its version)."""
    import torch

    tensors = {
        f"p{i}": torch.randn(
            *SHAPE, generator=torch.Generator().manual_seed(seed * 7919 + i * 104729 + v)
        )
        for i, v in enumerate(versions(seed, step))
    }
    return {"model": tensors, "step": step}


def save_step(
    run_url: str, step: int, seed: int, storage, kill: str | None, keep_last: int | None
) -> dict:
    """On the saver world's (only) rank: an incremental ``CheckpointManager.save`` of ``step``,
    killed (SIGKILL of this process) where ``kill`` says: ``after_pin`` (the base is pinned and
    checked), ``before_commit`` (the lease is checked, the manifest not sent), ``after_commit``
    (committed, the clean-up after the save not run)."""
    import cloudckpt.api.incremental as incremental
    import cloudckpt.api.save as save_module
    from cloudckpt import CheckpointManager, SaveOptions

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    patches = []
    if kill == "after_pin":
        original = save_module.open_base

        async def open_then_die(*a, **kw):
            pinned = await original(*a, **kw)
            if pinned is not None:
                die()
            return pinned

        patches.append((save_module, "open_base", original, open_then_die))
    elif kill == "before_commit":
        original = incremental.PinnedBase.check_lease

        def check_then_die(self):
            original(self)
            die()

        patches.append((incremental.PinnedBase, "check_lease", original, check_then_die))
    elif kill == "after_commit":
        original = CheckpointManager._after_save
        patches.append((CheckpointManager, "_after_save", original, lambda *a, **kw: die()))
    for owner, name, _, replacement in patches:
        setattr(owner, name, replacement)
    try:
        mgr = CheckpointManager(
            run_url,
            incremental=True,
            storage=storage,
            keep_last=keep_last,
            save_options=SaveOptions(
                object_size=96 << 10, checksum_block_size=32 << 10, pin_lease=60.0, timeout=60.0
            ),
        )
        result = mgr.save(step, state(seed, step))
        return {
            "bytes_written": result.bytes_written,
            "bytes_reused": result.bytes_reused,
            "base": result.base,
        }
    finally:
        for owner, name, original, _ in patches:
            setattr(owner, name, original)


async def garbage(store) -> list[str]:
    """What the run (``store`` at its root) holds that nothing needs: owned data objects no
    committed manifest references, pins not backed by a committed manifest that references
    their folder, unfinished uploads. Empty once a full clean-up ran and no save is running."""
    from cloudckpt.layout import MANIFEST_KEY, data_key_attempt, parse_pin_key
    from cloudckpt.runs.refs import read_manifest_or_none

    keys = [i.key async for i in store.list("")]
    folders = sorted({k.split("/", 1)[0] for k in keys})
    manifests = {}
    for f in folders:
        m = await read_manifest_or_none(store, f)
        if m is not None:
            manifests[f] = m
    referenced = {
        f"{h or f}/{k}" for f, m in manifests.items() for h, k in zip(m.object_homes, m.objects)
    }
    bad = []
    for key in keys:
        folder, _, rel = key.partition("/")
        if rel == MANIFEST_KEY:
            continue
        if data_key_attempt(rel) is not None:
            if key not in referenced:
                bad.append(f"unreferenced {key}")
            continue
        pin = parse_pin_key(rel)
        if pin is not None:
            m = manifests.get(pin[1])
            if m is None or m.attempt != pin[0] or folder not in m.object_homes:
                bad.append(f"stale pin {key}")
            continue
        bad.append(f"unexpected {key}")
    bad += [f"upload {u.key}" for u in await store.list_uploads("")]
    return bad


def pruner_main(run_url: str, seed: int) -> None:
    """Prune the run again and again until killed: retention with a random ``keep_last``, or
    the deletion of a random complete checkpoint (the newest included: an incremental save may
    be using it as its base right then)."""
    from cloudckpt.runs.manager import CheckpointManager

    rng = random.Random(seed)
    while True:
        try:
            time.sleep(rng.uniform(0.05, 0.3))
            action = rng.random()
            if action < 0.7:
                CheckpointManager(
                    run_url, keep_last=rng.choice([1, 2, 3]), abandoned_after=30.0
                ).prune()
            elif action < 0.85:
                mgr = CheckpointManager(run_url, abandoned_after=30.0)
                complete = [i.step for i in mgr.list() if i.complete]
                if complete:
                    mgr.delete(rng.choice(complete))
            print("pruned", flush=True)
        except Exception as exc:  # noqa: BLE001 - a race lost (a key deleted meanwhile)
            print(f"pruner: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def run_garbage(store) -> list[str]:
    from cloudckpt.runtime.loop import run_coroutine

    return run_coroutine(garbage(store))


if __name__ == "__main__":
    pruner_main(sys.argv[1], int(sys.argv[2]))
