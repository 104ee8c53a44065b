"""The api in one process without torch.distributed (every phase a single-rank exchange, no
collective): save, load (destinations of other dtypes and layouts), load_full, verify, and a
corrupt block failing load and verify, against a LocalStore."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.errors import CheckpointError, ChecksumError

BLOCK = 1024
OPTS = cloudckpt.SaveOptions(checksum_block_size=BLOCK, object_size=4 << 10)


def _state() -> dict:
    g = torch.Generator().manual_seed(13)
    return {
        "w": torch.randn(48, 40, generator=g),
        "b": torch.randn(30, 7, generator=g).to(torch.bfloat16),
        "opt": {"m": torch.randint(0, 99, (500,), generator=g), "step": 12, "name": "run"},
        "pair": (torch.arange(6.0).reshape(2, 3), 3),
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(48, 40, dtype=torch.float64),  # converted from float32
        "b": torch.zeros(7, 30, dtype=torch.bfloat16).t(),  # not contiguous
        "opt": {"m": torch.zeros(500, dtype=torch.int64), "step": 0, "name": ""},
        "pair": (torch.zeros(2, 3), 0),
    }


def test_save_load_load_full_and_verify(tmp_path):
    url = str(tmp_path / "ck")
    state = _state()
    saved = cloudckpt.save(state, url, options=OPTS)
    assert saved.objects >= 2 and saved.bytes_written == sum(
        t.numel() * t.element_size()
        for t in (state["w"], state["b"], state["opt"]["m"], state["pair"][0])
    )
    dest = _blank()
    loaded = cloudckpt.load(dest, url)
    assert (loaded.bytes_fetched, loaded.bytes_received, loaded.broadcasts) == (
        saved.bytes_written,
        0,
        0,
    )
    assert torch.equal(dest["w"], state["w"].double())
    assert torch.equal(dest["b"], state["b"]) and not dest["b"].is_contiguous()
    assert torch.equal(dest["opt"]["m"], state["opt"]["m"])
    assert (dest["opt"]["step"], dest["opt"]["name"]) == (12, "run")
    full = cloudckpt.load_full(url)
    assert torch.equal(full["w"], state["w"]) and full["pair"][1] == 3
    assert isinstance(full["pair"], tuple) and torch.equal(full["pair"][0], state["pair"][0])
    report = cloudckpt.verify(url)
    assert report.ok and report.bytes_checked == saved.bytes_written


def test_a_corrupt_block_fails_load_and_verify_and_does_not_land(tmp_path):
    url = str(tmp_path / "ck")
    state = _state()
    cloudckpt.save(state, url, options=OPTS)
    manifest = cloudckpt.read_manifest(url)
    chunk = manifest.tensors["w"].chunks[0]
    key = manifest.objects[chunk.object_index]
    path = tmp_path / "ck" / key
    body = bytearray(path.read_bytes())
    body[chunk.byte_offset + BLOCK + 1] ^= 0x10  # second block of "w"
    path.write_bytes(bytes(body))
    for dest in (_blank(), {**_blank(), "w": torch.zeros(48, 40)}):  # windows, then sinks
        with pytest.raises(CheckpointError) as info:
            cloudckpt.load(dest, url)
        assert isinstance(info.value, ChecksumError) or isinstance(
            info.value.__cause__, ChecksumError
        )
        assert key in str(info.value)
        elements = BLOCK // 4  # float32 elements per block
        assert (dest["w"].reshape(-1)[elements : 2 * elements] == 0).all()
        assert dest["opt"]["step"] == 0  # no value restored after a failed data phase
    report = cloudckpt.verify(url)
    assert not report.ok and any(key in p for p in report.problems)
    with pytest.raises(ChecksumError):
        cloudckpt.load_full(url)


def test_each_entry_point_opens_the_checkpoints_store_once(tmp_path, monkeypatch):
    """save, load, load_full, verify and a streaming save resolve ``(url, storage)`` to a store
    once and pass it down (a LocalStore is opened per resolution: no cache hides a second)."""
    import cloudckpt.api.load as load_module
    import cloudckpt.api.save as save_module
    import cloudckpt.api.streaming as streaming_module
    import cloudckpt.api.verify as verify_module
    import cloudckpt.stored as stored_module

    opened: list[str] = []

    def counting(module):
        real = module.shared_store

        def spy(url, storage=None):
            opened.append(url)
            return real(url, storage)

        monkeypatch.setattr(module, "shared_store", spy)

    for module in (load_module, save_module, streaming_module, verify_module, stored_module):
        counting(module)
    url = str(tmp_path / "ck")
    cloudckpt.save(_state(), url, options=OPTS)
    assert opened == [url]
    for entry in (
        lambda: cloudckpt.load(_blank(), url),
        lambda: cloudckpt.load_full(url),
        lambda: cloudckpt.verify(url),
    ):
        opened.clear()
        entry()
        assert opened == [url]
    opened.clear()
    streaming = streaming_module.StreamingSave(str(tmp_path / "streamed"))
    streaming.add_tensor("t", "float32", (4,))
    streaming.write("t", (0,), torch.ones(4))
    streaming.commit()
    assert opened == [str(tmp_path / "streamed")]
