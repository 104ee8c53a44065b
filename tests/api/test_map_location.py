"""``map_location`` of ``cloudckpt.load_full`` and ``cloudckpt.load``, as ``torch.load`` takes it
(CPU only here: the CUDA targets are written, not run, without a GPU; a CUDA target in a process
without CUDA is refused before anything is read)."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.statedict.placement import placement


@pytest.fixture(scope="module")
def saved(s3_server):
    import os

    url = s3_server.url(f"map-location-{os.getpid()}-{id(s3_server)}")
    state = {
        "w": torch.arange(12.0).reshape(3, 4),
        "nested": {"b": torch.ones(5, dtype=torch.int8)},
    }
    state["step"] = 3
    env = s3_server.env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cloudckpt.save(state, url)
        yield url, state
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _same(full, state, device="cpu"):
    assert full["step"] == 3
    assert full["w"].device.type == device and full["nested"]["b"].device.type == device
    if device != "meta":
        assert torch.equal(full["w"], state["w"]) and torch.equal(
            full["nested"]["b"], state["nested"]["b"]
        )
    assert full["w"].shape == (3, 4) and full["nested"]["b"].dtype == torch.int8


@pytest.mark.parametrize(
    "where",
    [None, "cpu", torch.device("cpu"), {"cuda:0": "cpu"}, {"cpu": "cpu"}, {}],
    ids=["none", "str", "device", "dict-other", "dict-cpu", "dict-empty"],
)
def test_map_location_to_cpu(saved, where):
    url, state = saved
    _same(cloudckpt.load_full(url, map_location=where), state)


def test_map_location_callable_and_meta(saved):
    url, state = saved
    calls = []

    def to_half(t, location):
        calls.append(location)
        return t.to(torch.float64) if t.is_floating_point() else None

    full = cloudckpt.load_full(url, map_location=to_half)
    assert calls == ["cpu", "cpu"] and full["w"].dtype == torch.float64
    assert torch.equal(full["w"], state["w"].double()) and full["nested"]["b"].dtype == torch.int8
    _same(cloudckpt.load_full(url, map_location=lambda t, loc: t), state)
    meta = cloudckpt.load_full(url, map_location="meta")  # shapes and dtypes, nothing read
    _same(meta, state, device="meta")
    with pytest.raises(ConfigError, match="not a tensor or None"):
        cloudckpt.load_full(url, map_location=lambda t, loc: "cpu")


@pytest.mark.parametrize(
    "bad, text",
    [
        ("nope", "is not a device"),
        (1.5, "is not a device"),
        (True, "is not a device"),
        ({"cpu": "gpu9"}, "is not a device"),
        ({"cpu": 3.0}, "is not a device"),
        ({"nope": "cpu"}, "is not a device"),
    ],
)
def test_bad_map_location_is_refused_before_reading(saved, bad, text):
    url, _ = saved
    with pytest.raises(ConfigError, match=text):
        cloudckpt.load_full(url, map_location=bad)
    with pytest.raises(ConfigError, match=text):
        cloudckpt.load({"w": torch.zeros(3, 4)}, url, map_location=bad, strict=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_cuda_is_refused():
    for where in ("cuda", "cuda:0", 0, torch.device("cuda", 1), {"cpu": "cuda:0"}):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            placement(where)
    assert placement({"cuda:0": "cpu"}).device is None  # a key saved elsewhere: stays on CPU


def test_load_in_place_keeps_the_destinations(saved):
    url, state = saved
    sd = {
        "w": torch.zeros(3, 4, dtype=torch.float64),
        "nested": {"b": torch.zeros(5, dtype=torch.int8)},
        "step": 0,
    }
    w = sd["w"]
    cloudckpt.load(sd, url, map_location="cpu")
    assert sd["w"] is w and torch.equal(w, state["w"].double()) and sd["step"] == 3
