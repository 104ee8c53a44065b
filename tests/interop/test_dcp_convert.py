"""cloudckpt.convert / ``cloudckpt convert`` between cloudckpt and DCP checkpoints, on SeaweedFS
and local folders: every chunk layout and dtype round-trips, the DCP side loads with DCP's own
reader, the cloudckpt side is a normal committed checkpoint (load, load_full, verify), values
survive where msgpack holds them and the rest is named, DCP sources need allow_pickle / --trust,
and conversion streams in bounded batches."""

from __future__ import annotations

import fractions

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import GlobalPiece
from cloudckpt.cli.main import main as cli_main
from cloudckpt.dcp import DCPOptions, StorageReader, StorageWriter
from cloudckpt.errors import CheckpointExists, PickleNotAllowed
from tests.interop.helpers import assert_same, download_prefix, storage_for, zeros_like_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


def _boxes(shape, layout):
    """Boxes (offsets, sizes) tiling ``shape``: one box, row slabs, column slabs, a 2x2 grid."""
    if layout == "one" or len(shape) == 0:
        return [((0,) * len(shape), tuple(shape))]
    rows = shape[0]
    if layout == "rows":
        cut = [0, rows // 3, rows // 3 * 2 + 1, rows]
        return [
            ((a,) + (0,) * (len(shape) - 1), (b - a,) + tuple(shape[1:]))
            for a, b in zip(cut, cut[1:])
            if b > a
        ]
    cols = shape[1]
    if layout == "cols":
        return [((0, a), (rows, b - a)) for a, b in ((0, cols // 2), (cols // 2, cols))]
    r, c = rows // 2, cols // 2
    return [
        ((0, 0), (r, c)),
        ((0, c), (r, cols - c)),
        ((r, 0), (rows - r, c)),
        ((r, c), (rows - r, cols - c)),
    ]


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8]
LAYOUTS = ["one", "rows", "cols", "grid"]


def _layout_state(seed: int = 0):
    """(what to save: GlobalPiece lists over several chunk layouts and dtypes, the full tensors)"""
    g = torch.Generator().manual_seed(seed)
    save, full = {}, {}
    for i, dtype in enumerate(DTYPES):
        for layout in LAYOUTS:
            shape = (11 + i, 6 + i)
            t = (torch.rand(shape, generator=g) * 100).to(dtype)
            name = f"{layout}_{str(dtype).removeprefix('torch.')}"
            full[name] = t
            save[name] = [
                GlobalPiece(t[o[0] : o[0] + s[0], o[1] : o[1] + s[1]].clone(), shape, o)
                for o, s in _boxes(shape, layout)
            ]
    full["scalar"] = save["scalar"] = torch.tensor(3.5)
    full["empty"] = save["empty"] = torch.empty(0, 4)
    full["big"] = save["big"] = torch.randn(MiB // 2 + 7, generator=g)  # 2 MiB: several batches
    values = {
        "step": 9,
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "name": "run",
        "none": None,
        "nested": {"a": [1, 2, {"b": "c"}], "blob": b"\x00\x01"},
    }
    save["opt"] = full["opt"] = values
    save["layers"] = full["layers"] = [torch.arange(4.0), torch.ones(2, 2)]
    return save, full


SMALL = DCPOptions(
    object_size=MiB, checksum_block_size=64 << 10, read_batch_bytes=256 << 10, max_read_bytes=MiB
)


def test_cloudckpt_to_dcp_loads_with_dcps_own_reader(s3_server, s3_url, tmp_path):
    storage = storage_for(s3_server)
    save, full = _layout_state(1)
    cloudckpt.save(save, s3_url + "/ck", storage=storage)
    result = cloudckpt.convert(
        s3_url + "/ck", s3_url + "/dcp", to="dcp", storage=storage, options=SMALL
    )
    # 29 tensors (the 2 of "layers" included); 9 DCP values: "nested.a" splits as DCP splits it
    assert (result.skipped, result.tensors, result.values) == ((), 29, 9)
    assert download_prefix(s3_server, s3_url + "/dcp", tmp_path)
    for reader in (dcp.FileSystemReader(str(tmp_path)), StorageReader(s3_url + "/dcp", storage)):
        out = zeros_like_state(full)
        dcp.load(out, storage_reader=reader)
        assert_same(out, full)
    md = StorageReader(s3_url + "/dcp", storage).read_metadata()
    assert md.planner_data["opt.betas"] == ("opt", "betas")
    assert md.planner_data["opt.nested.a.2.b"] == ("opt", "nested", "a", 2, "b")
    assert md.planner_data["layers.1"] == ("layers", 1)
    assert len(md.state_dict_metadata["grid_float32"].chunks) == 4


def test_dcp_to_cloudckpt_is_a_normal_checkpoint(s3_server, s3_url, tmp_path):
    storage = storage_for(s3_server)
    _, full = _layout_state(2)
    dcp.save(full, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs"), sync_files=False))
    dcp.save(full, storage_writer=StorageWriter(s3_url + "/dcp", storage, options=SMALL))
    for src in (str(tmp_path / "fs"), s3_url + "/dcp"):
        for dst in (str(tmp_path / f"out-{len(src)}"), f"{s3_url}/out-{len(src)}"):
            result = cloudckpt.convert(
                src, dst, to="cloudckpt", allow_pickle=True, storage=storage, options=SMALL
            )
            assert result.skipped == (), result
            assert cloudckpt.verify(dst, storage=storage).ok
            assert_same(cloudckpt.load_full(dst, storage=storage), full)
            out = zeros_like_state(full)
            cloudckpt.load(out, dst, storage=storage)
            assert_same(out, full)


def test_a_round_trip_keeps_every_layout_and_dtype(tmp_path):
    save, full = _layout_state(3)
    cloudckpt.save(save, tmp_path / "a")
    cloudckpt.convert(tmp_path / "a", tmp_path / "b", to="dcp", options=SMALL)
    cloudckpt.convert(
        tmp_path / "b", tmp_path / "c", to="cloudckpt", allow_pickle=True, options=SMALL
    )
    assert_same(cloudckpt.load_full(tmp_path / "c"), full)
    a, c = cloudckpt.read_manifest(tmp_path / "a"), cloudckpt.read_manifest(tmp_path / "c")
    assert list(a.tensors) == list(c.tensors) and a.structure == c.structure
    for name in a.tensors:  # the stored chunks themselves survive
        assert sorted(x.offsets for x in a.tensors[name].chunks) == sorted(
            x.offsets for x in c.tensors[name].chunks
        ), name


def test_a_dcp_source_needs_allow_pickle_and_says_why(tmp_path):
    dcp.save({"w": torch.ones(2)}, storage_writer=StorageWriter(tmp_path / "d"))
    with pytest.raises(PickleNotAllowed, match="pickle can run any code.*allow_pickle=True"):
        cloudckpt.convert(tmp_path / "d", tmp_path / "c", to="cloudckpt")
    assert not (tmp_path / "c").exists()


def test_values_msgpack_cannot_hold_are_named_and_left_out(tmp_path):
    """A tuple of tensors (one DCP value) is kept, its tensors stored as tensors; a value
    msgpack cannot hold, and one holding a tensor of a dtype cloudckpt does not store, are
    named and left out."""
    state = {
        "w": torch.ones(2),
        "frac": fractions.Fraction(1, 3),
        "pair": (torch.zeros(1), torch.ones(1)),
        "ok": {"x": [1, 2]},
        "cplx": (torch.zeros(2, dtype=torch.complex32), 1),
    }
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "d"))
    result = cloudckpt.convert(tmp_path / "d", tmp_path / "c", to="cloudckpt", allow_pickle=True)
    assert sorted(s.split(":")[0] for s in result.skipped) == ["cplx", "frac"], result.skipped
    full = cloudckpt.load_full(tmp_path / "c")
    assert full["ok"] == {"x": [1, 2]} and torch.equal(full["w"], torch.ones(2))
    assert "frac" not in full and "cplx" not in full
    assert type(full["pair"]) is tuple and torch.equal(full["pair"][1], torch.ones(1))


def test_existing_destination_is_refused(tmp_path):
    cloudckpt.save({"w": torch.ones(2)}, tmp_path / "a")
    cloudckpt.convert(tmp_path / "a", tmp_path / "b", to="dcp")
    with pytest.raises(CheckpointExists):
        cloudckpt.convert(tmp_path / "a", tmp_path / "b", to="dcp")
    cloudckpt.convert(tmp_path / "b", tmp_path / "c", to="cloudckpt", allow_pickle=True)
    with pytest.raises(CheckpointExists):
        cloudckpt.convert(tmp_path / "b", tmp_path / "c", to="cloudckpt", allow_pickle=True)


def test_conversion_streams_in_bounded_batches(monkeypatch, tmp_path):
    """Each upload of either direction carries at most one batch (or one larger item), and a
    checkpoint of many batches is never read whole."""
    import cloudckpt.api.streaming as streaming
    import cloudckpt.dcp.to_dcp as conv

    batches: list[int] = []

    def spy(real, size_of):
        async def wrapped(store, first, *args, **kwargs):
            batches.append(size_of(first, args, kwargs))
            return await real(store, first, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        conv,
        "write_files",
        spy(
            conv.write_files,
            lambda f, a, k: sum(getattr(x, "nbytes", 0) for x in (a[0](i) for i in range(len(f)))),
        ),
    )
    monkeypatch.setattr(
        streaming,
        "write_chunks",
        spy(
            streaming.write_chunks, lambda f, a, k: sum(t.numel() * t.element_size() for _, t in f)
        ),
    )
    state = {f"t{i}": torch.randn(64 << 10) for i in range(12)}  # 12 x 256 KiB = 3 MiB
    cloudckpt.save(state, tmp_path / "a")
    opts = DCPOptions(object_size=600 << 10, read_batch_bytes=300 << 10, max_read_bytes=600 << 10)
    cloudckpt.convert(tmp_path / "a", tmp_path / "b", to="dcp", options=opts)
    assert len(batches) >= 5 and max(batches) <= 600 << 10, batches
    batches.clear()
    cloudckpt.convert(
        tmp_path / "b", tmp_path / "c", to="cloudckpt", allow_pickle=True, options=opts
    )
    assert len(batches) >= 4 and max(batches) <= (600 << 10) + (256 << 10), batches
    assert_same(cloudckpt.load_full(tmp_path / "c"), state)


def test_command_line_convert(s3_server, s3_url, monkeypatch, capsys, tmp_path):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    cloudckpt.save({"w": torch.arange(6.0), "step": 3}, tmp_path / "a")
    assert cli_main(["convert", str(tmp_path / "a"), s3_url + "/dcp", "--to", "dcp"]) == 0
    assert "converted" in capsys.readouterr().out
    assert cli_main(["convert", s3_url + "/dcp", str(tmp_path / "c"), "--to", "cloudckpt"]) == 2
    err = capsys.readouterr().err
    assert "--trust" in err and "pickle" in err and not (tmp_path / "c").exists()
    assert (
        cli_main(["convert", s3_url + "/dcp", str(tmp_path / "c"), "--to", "cloudckpt", "--trust"])
        == 0
    )
    assert cloudckpt.load_full(tmp_path / "c")["step"] == 3
    assert (
        cli_main(["convert", s3_url + "/dcp", str(tmp_path / "c"), "--to", "cloudckpt", "--trust"])
        == 1
    )
    assert "already committed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["convert", "a", "b", "--to", "safetensors"])
    assert info.value.code == 2
