"""The trainers' own checkpoint names under a run folder on the local SeaweedFS: only committed
``<prefix><N>`` folders are listed; pruning keeps the newest (always), spares the protected,
never touches half-written or foreign folders; random-generator records from storage are
checked before anything is set."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import cloudckpt
from cloudckpt.errors import ManifestError
from cloudckpt.integrations import rng_states
from cloudckpt.integrations.run_folder import complete_checkpoints, newest_complete, prune_to
from cloudckpt.runtime.loop import run_coroutine, shared_store


def _names(url, prefix="checkpoint-"):
    return [c.name for c in complete_checkpoints(url, prefix)]


def test_listing_and_pruning_keep_to_the_trainers_names(s3_env, s3_url):
    for step in (1, 2, 10, 3):
        cloudckpt.save({"w": torch.full((4,), float(step))}, f"{s3_url}/checkpoint-{step}")
    store = shared_store(s3_url)
    for foreign in ("other-7", "checkpoint-x", "checkpoint-4.bak"):  # not the trainer's names
        run_coroutine(store.put(f"{foreign}/manifest.msgpack", b"foreign"))
    # half-written: data objects but no manifest (a save killed before its commit)
    run_coroutine(store.put("checkpoint-20/data/a/r0-0.bin", b"partial"))
    assert _names(s3_url) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-10"]
    assert newest_complete(s3_url, "checkpoint-").step == 10  # numeric order, not text order
    assert newest_complete(s3_url, "nothing_") is None

    gone = prune_to(s3_url, "checkpoint-", keep=2, protect=[f"{s3_url}/checkpoint-1/"])
    assert gone == [f"{s3_url}/checkpoint-2"]
    assert _names(s3_url) == ["checkpoint-1", "checkpoint-3", "checkpoint-10"]
    assert prune_to(s3_url, "checkpoint-", keep=0) == [
        f"{s3_url}/checkpoint-1",
        f"{s3_url}/checkpoint-3",
    ]
    assert _names(s3_url) == ["checkpoint-10"]  # the newest complete one stays, whatever keep
    assert torch.equal(cloudckpt.load_full(f"{s3_url}/checkpoint-10")["w"], torch.full((4,), 10.0))
    # foreign and half-written folders untouched
    for foreign in ("other-7", "checkpoint-x", "checkpoint-4.bak"):
        assert run_coroutine(store.get(f"{foreign}/manifest.msgpack")) == b"foreign"
    assert run_coroutine(store.get("checkpoint-20/data/a/r0-0.bin")) == b"partial"


def test_rng_records_round_trip_and_bad_ones_set_nothing():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    record = rng_states.capture()
    want = (random.random(), np.random.rand(), torch.rand(1))
    rng_states.restore(record)
    assert (random.random(), np.random.rand(), torch.rand(1)) == want
    before = (random.getstate(), torch.random.get_rng_state())
    bad = [
        {},
        7,
        {**record, "torch": torch.zeros(3, dtype=torch.uint8)},
        {**record, "numpy": {**record["numpy"], "keys": torch.zeros(5, dtype=torch.int64)}},
        {**record, "python": {**record["python"], "internal": torch.zeros(2)}},
        {**record, "python": {**record["python"], "gauss": "x"}},
        {**record, "cuda": "x"},
    ]
    for b in bad:
        with pytest.raises(ManifestError, match="not a random-generator record"):
            rng_states.restore(b)
    assert random.getstate() == before[0]
    assert torch.equal(torch.random.get_rng_state(), before[1])
