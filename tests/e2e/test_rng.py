"""``cloudckpt.RNGState`` against the session's SeaweedFS: after a load, torch's, numpy's and
Python's random draws equal those of an uninterrupted run, in one process and per rank of a
2-rank world (each rank its own states, never merged); stored without pickle; another world
size fails in a typed way or, with ``strict=False``, keeps the rank's generators."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

import cloudckpt


def _draws() -> tuple:
    return (
        torch.rand(4).tolist(),
        torch.randn(2, generator=None).tolist(),
        np.random.rand(3).tolist(),
        float(np.random.randn()),
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),
    )


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    random.gauss(0.0, 1.0)  # and in Python's


def test_rng_state_resumes_random_ops_exactly(s3_env, s3_url):
    _seed(7)
    state = {"w": torch.ones(3), "rng": cloudckpt.RNGState()}
    cloudckpt.save(state, s3_url)
    expected = _draws()  # the uninterrupted run
    _seed(99)  # another process, say
    assert _draws() != expected
    cloudckpt.load(state, s3_url)
    assert _draws() == expected
    manifest = cloudckpt.read_manifest(s3_url)  # no pickle anywhere (it would be refused)
    names = sorted(manifest.tensors)
    assert len(names) == 4 and all("rank0" in n for n in names if n != "w"), names
    assert {manifest.tensors[n].dtype for n in names} == {"uint8", "int64", "float32"}


def rank_rng(url: str, mode: str):
    rank = dist.get_rank()
    if mode == "save":
        _seed(100 + rank)
        cloudckpt.save({"rng": cloudckpt.RNGState()}, url)
        return _draws()
    _seed(5)  # the same on every rank: a load must give each rank its own back
    cloudckpt.load({"rng": cloudckpt.RNGState()}, url)
    return _draws()


def test_rng_state_per_rank_in_a_2_rank_world(world2, s3_server):
    url = s3_server.url(f"rng-{os.getpid()}/w2")
    expected = world2.run(rank_rng, url, "save")
    assert expected[0] != expected[1]  # ranks draw differently
    assert world2.run(rank_rng, url, "load") == expected
    assert cloudckpt.RNGState().state_dict().keys() == {"rank0"}


def rank_more(url: str):
    _seed(1)
    before = torch.get_rng_state()
    try:
        cloudckpt.load({"rng": cloudckpt.RNGState()}, url)
        strict = "loaded"
    except Exception as exc:  # noqa: BLE001 - every rank fails: which error, and what it names
        strict = f"{type(exc).__name__}: {'rank1' in str(exc)}"
    _seed(1)
    cloudckpt.load({"rng": cloudckpt.RNGState()}, url, strict=False)
    return strict, torch.equal(torch.get_rng_state(), before)


def test_rng_state_saved_by_one_process_loaded_by_two(s3_env, s3_url, world2):
    _seed(3)
    cloudckpt.save({"rng": cloudckpt.RNGState()}, s3_url)
    (strict0, kept0), (strict1, kept1) = world2.run(rank_more, s3_url)
    assert strict1 == "MissingKeysError: True", strict1  # names the missing rank's state
    assert strict0 != "loaded"  # fails together: no rank goes on half restored
    assert not kept0 and kept1  # strict=False: rank 0 restored, rank 1 keeps its generators
