"""CUDA paths: pinned staging with a side stream, and loads into device tensors.

Skipped where no CUDA device exists (CI here); run on a GPU machine with
``python -m pytest -q tests/e2e/test_cuda.py`` (the one short script for the CUDA path).
"""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.runtime.staging import StagingPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staging_pins_and_copies_on_a_side_stream():
    pool = StagingPool()
    src = torch.randn(1024, 1024, device="cuda")
    staged = pool.stage([(0, src), (1, torch.arange(10.0))])
    assert staged[0][1].is_pinned() and staged[0][1].device.type == "cpu"
    assert not staged[1][1].is_pinned()
    src.add_(1)  # after stage() returns, the copy is complete: mutating the source is safe
    torch.testing.assert_close(staged[0][1] + 1, src.cpu())
    before = pool.allocations
    pool.stage([(0, src), (1, torch.arange(10.0))])
    assert pool.allocations == before  # same layout: buffers reused


def test_async_save_of_cuda_tensors_and_load_into_cuda(tmp_path):
    url = (tmp_path / "ckpt").as_uri()
    sd = {
        "w": torch.randn(512, 512, device="cuda"),
        "b": torch.randn(512, device="cuda"),
        "step": 3,
    }
    expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    handle = cloudckpt.async_save(sd, url)
    sd["w"].mul_(0)
    handle.result(timeout=120)
    blank = {
        "w": torch.zeros(512, 512, device="cuda"),
        "b": torch.zeros(512, device="cuda"),
        "step": 0,
    }
    cloudckpt.load(blank, url)
    for k, v in expected.items():
        assert blank[k].device.type == "cuda"
        torch.testing.assert_close(blank[k], v, rtol=0, atol=0)
    assert blank["step"] == 3
    full = cloudckpt.load_full(url)
    torch.testing.assert_close(full["w"], expected["w"].cpu(), rtol=0, atol=0)


def test_sync_save_of_noncontiguous_bf16_cuda_tensor(tmp_path):
    url = (tmp_path / "c2").as_uri()
    t = torch.randn(64, 32, device="cuda").to(torch.bfloat16).t()
    cloudckpt.save({"t": t}, url)
    out = {"t": torch.zeros(32, 64, dtype=torch.float32, device="cuda")}
    cloudckpt.load(out, url)  # dtype converted on load
    torch.testing.assert_close(out["t"], t.float(), rtol=0, atol=0)
