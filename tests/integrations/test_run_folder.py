"""The trainers' own checkpoint names under a run folder on the local SeaweedFS: only committed
``<prefix><N>`` folders are listed; pruning keeps the newest (always), spares the protected,
never touches half-written, damaged or foreign folders; a random-generator record that does not
fit is one ManifestError."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.errors import ManifestError
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
    # damaged: a manifest that does not decode (listed: it is committed; never deleted blindly)
    run_coroutine(store.put("checkpoint-0/manifest.msgpack", b"\x00garbage"))
    assert _names(s3_url) == [
        "checkpoint-0",
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
        "checkpoint-10",
    ]
    assert newest_complete(s3_url, "checkpoint-").step == 10  # numeric order, not text order
    assert newest_complete(s3_url, "nothing_") is None

    gone = prune_to(s3_url, "checkpoint-", keep=2, protect=[f"{s3_url}/checkpoint-1/"])
    assert gone == [f"{s3_url}/checkpoint-2"]
    assert _names(s3_url) == ["checkpoint-0", "checkpoint-1", "checkpoint-3", "checkpoint-10"]
    assert prune_to(s3_url, "checkpoint-", keep=0) == [
        f"{s3_url}/checkpoint-1",
        f"{s3_url}/checkpoint-3",
    ]
    # the newest complete one stays whatever keep; the damaged one is left for `cloudckpt rm`
    assert _names(s3_url) == ["checkpoint-0", "checkpoint-10"]
    assert torch.equal(cloudckpt.load_full(f"{s3_url}/checkpoint-10")["w"], torch.full((4,), 10.0))
    # foreign and half-written folders untouched
    for foreign in ("other-7", "checkpoint-x", "checkpoint-4.bak"):
        assert run_coroutine(store.get(f"{foreign}/manifest.msgpack")) == b"foreign"
    assert run_coroutine(store.get("checkpoint-0/manifest.msgpack")) == b"\x00garbage"
    assert run_coroutine(store.get("checkpoint-20/data/a/r0-0.bin")) == b"partial"


def test_bad_random_generator_records_are_one_manifest_error():
    from cloudckpt.integrations.hf_trainer import load_into

    good = cloudckpt.RNGState().state_dict()["rank0"]
    before = torch.random.get_rng_state()
    for bad in (
        {"rank0": {**good, "torch": torch.zeros(3, dtype=torch.uint8)}},
        {"rank0": {"numpy": good["numpy"]}},
    ):
        with pytest.raises(ManifestError, match="stored random generator states cannot be"):
            load_into(
                "s3://b/run/checkpoint-1",
                "random generator states",
                cloudckpt.RNGState().load_state_dict,
                bad,
            )
    assert torch.equal(torch.random.get_rng_state(), before)
