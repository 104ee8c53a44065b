"""``cloudckpt.load_safetensors``: a real Hugging Face model definition (a small Llama built from
a config, random weights, no download) saved with ``save_pretrained(safe_serialization=True)``
in several files, loaded from SeaweedFS into FSDP2-sharded copies on 2 and 3 ranks, into
replicated copies (read once, broadcast), and from a local folder in one process; hostile or
incomplete checkpoints fail every rank together."""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.errors import CheckpointError, CheckpointNotFound, MissingKeysError, SafetensorsError
from cloudckpt.runtime.loop import shared_store
from cloudckpt.storage import StorageOptions
from tests.interop.safetensors_files import hostile_files, valid_file

CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
#: no coalescing across gaps: a rank's store bytes are exactly the ranges it asked for
EXACT = StorageOptions(coalesce_gap=0)


def build_llama(seed: int):
    """The model, with random weights from ``seed`` (transformers imported on first use)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def header_bytes(folder: Path) -> int:
    """Bytes a coordinator reads to describe ``folder``: every file's prefix and header, and
    the index."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += 8 + struct.unpack("<Q", fh.read(8))[0]
    index = folder / "model.safetensors.index.json"
    return total + (index.stat().st_size if index.exists() else 0)


def upload(s3_server, folder: Path, prefix: str, *, skip=()) -> str:
    client = s3_server.boto3_client()
    for f in sorted(folder.iterdir()):
        if f.name not in skip:
            client.put_object(
                Bucket=s3_server.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes()
            )
    return s3_server.url(prefix)


@pytest.fixture(scope="module")
def llama(s3_server, tmp_path_factory):
    """The saved model: local folder, S3 URL, the original tensors, what describing it costs."""
    folder = tmp_path_factory.mktemp("llama")
    model = build_llama(seed=0)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) >= 4 and (folder / "model.safetensors.index.json").exists()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    url = upload(s3_server, folder, f"hf-import-{uuid.uuid4().hex[:8]}")
    return SimpleNamespace(
        folder=folder,
        url=url,
        expected=expected,
        header_bytes=header_bytes(folder),
        total=sum(t.numel() * t.element_size() for t in expected.values()),
    )


# -- run on the worlds --------------------------------------------------------------------------


def fsdp_load(url: str, expected: dict, nested: bool) -> dict:
    """Build the model, FSDP2-shard it, blank it, load the checkpoint into ``model.state_dict()``
    (under ``"net"`` with a key_map when ``nested``); compare every gathered parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_llama(seed=1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(7.0)
    state = model.state_dict()
    target, key_map = ({"net": state}, lambda n: f"net.{n}") if nested else (state, None)
    stats = shared_store(url, EXACT).stats
    before = stats.bytes_received
    result = cloudckpt.load_safetensors(target, url, key_map=key_map, storage=EXACT)
    store_bytes = stats.bytes_received - before
    own = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    wrong = [
        n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), expected[n])
    ]
    return {
        "wrong": wrong,
        "own": own,
        "store_bytes": store_bytes,
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
        "sharded": all(p.to_local().numel() < p.numel() for p in model.parameters()),
    }


def replicated_load(url: str, expected: dict) -> dict:
    """Every rank loads the whole model (rank 1 partly as bfloat16): regions read once."""
    rank = dist.get_rank()
    dest = {k: torch.full_like(v, 7.0) for k, v in expected.items()}
    if rank == 1:
        dest["lm_head.weight"] = dest["lm_head.weight"].bfloat16()
    stats = shared_store(url, EXACT).stats
    before = stats.bytes_received
    result = cloudckpt.load_safetensors(
        dest, url, storage=EXACT, options=cloudckpt.LoadOptions(min_broadcast_bytes=0)
    )
    return {
        "equal": all(torch.equal(dest[k], v.to(dest[k].dtype)) for k, v in expected.items()),
        "store_bytes": stats.bytes_received - before,
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
        "broadcasts": result.broadcasts,
    }


def failing_load(url: str, extra: bool, share_manifest: bool) -> dict:
    dest = {"model.norm.weight": torch.zeros(64)}
    if extra:
        dest["model.not_there.weight"] = torch.zeros(3)
    try:
        cloudckpt.load_safetensors(
            dest, url, options=cloudckpt.LoadOptions(share_manifest=share_manifest)
        )
    except Exception as exc:  # judged by the test: same error on every rank, nothing written
        return {
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "untouched": bool((dest["model.norm.weight"] == 0).all()),
        }
    return {"types": [], "message": "", "untouched": False}


# -- multi-rank ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world_name, nested", [("world2", False), ("world3", True)])
def test_fsdp2_sharded_llama_loads_from_s3_reading_only_each_ranks_slices(
    request, llama, world_name, nested
):
    world = request.getfixturevalue(world_name)
    results = world.run(fsdp_load, llama.url, llama.expected, nested)
    for rank, r in enumerate(results):
        assert r["wrong"] == [] and r["sharded"], (rank, r)
        # exactly this rank's slices from the store (the coordinator also read the headers)
        assert r["store_bytes"] == r["own"] + (llama.header_bytes if rank == 0 else 0), (rank, r)
        assert r["fetched"] == r["own"] and r["received"] == 0
    assert sum(r["own"] for r in results) == llama.total  # every byte read once, by one rank


def test_a_region_every_rank_needs_is_read_once_and_broadcast(world2, llama):
    results = world2.run(replicated_load, llama.url, llama.expected)
    assert all(r["equal"] for r in results), results
    assert sum(r["fetched"] for r in results) == llama.total
    assert sum(r["received"] for r in results) == llama.total
    assert sum(r["store_bytes"] for r in results) == llama.total + llama.header_bytes
    assert all(r["fetched"] > 0 and r["broadcasts"] > 0 for r in results)  # both are sources


@pytest.fixture(scope="module")
def hostile_url(s3_server, llama):
    """A copy of the checkpoint without its index, plus one file whose offsets overlap."""
    prefix = f"hf-hostile-{uuid.uuid4().hex[:8]}"
    upload(s3_server, llama.folder, prefix, skip=("model.safetensors.index.json",))
    s3_server.boto3_client().put_object(
        Bucket=s3_server.bucket,
        Key=f"{prefix}/z.safetensors",
        Body=hostile_files()["overlapping tensors"][0],
    )
    return s3_server.url(prefix)


@pytest.mark.parametrize(
    "case, share_manifest",
    [
        ("missing tensor", True),
        ("hostile header", True),
        ("hostile header", False),
        ("no files", True),
    ],
)
def test_a_bad_checkpoint_or_missing_tensor_fails_every_rank_together(
    world3, llama, hostile_url, s3_server, case, share_manifest
):
    url = {
        "missing tensor": llama.url,
        "hostile header": hostile_url,
        "no files": s3_server.url(f"hf-nothing-{uuid.uuid4().hex[:8]}"),
    }[case]
    results = world3.run(failing_load, url, case == "missing tensor", share_manifest)
    want = {
        "missing tensor": MissingKeysError,
        "hostile header": SafetensorsError,
        "no files": CheckpointNotFound,
    }[case]
    for r in results:
        assert want.__name__ in r["types"] and "CheckpointError" in r["types"], r
        assert r["untouched"], r
    assert len({r["message"] for r in results}) == 1  # the same error on every rank
    if case == "missing tensor":
        assert "model.not_there.weight" in results[0]["message"]
    if case == "hostile header":
        assert "z.safetensors" in results[0]["message"]


# -- one process, local folder ------------------------------------------------------------------


def test_plain_state_dict_from_a_local_folder_with_key_map_and_dtype_cast(llama):
    dest = {k: torch.full_like(v, 7.0) for k, v in llama.expected.items()}
    result = cloudckpt.load_safetensors(dest, str(llama.folder))
    assert all(torch.equal(dest[k], v) for k, v in llama.expected.items())
    assert result.bytes_fetched == llama.total and result.unexpected_keys == ()

    # the inner model only, renamed and in bfloat16: lm_head is not asked for
    inner = {
        k.removeprefix("model."): torch.zeros_like(v, dtype=torch.bfloat16)
        for k, v in llama.expected.items()
        if k.startswith("model.")
    }
    result = cloudckpt.load_safetensors(
        inner,
        str(llama.folder),
        key_map=lambda n: n.removeprefix("model.") if n.startswith("model.") else n,
    )
    assert all(torch.equal(inner[k], llama.expected[f"model.{k}"].bfloat16()) for k in inner)
    assert result.unexpected_keys == ("lm_head.weight",)

    # a dict key_map renames one name; None in a callable drops a name
    dest = {"embed": torch.zeros(256, 64)}
    cloudckpt.load_safetensors(
        dest, str(llama.folder), key_map={"model.embed_tokens.weight": "embed"}, strict=False
    )
    assert torch.equal(dest["embed"], llama.expected["model.embed_tokens.weight"])
    with pytest.raises(MissingKeysError, match="lm_head.weight"):
        cloudckpt.load_safetensors(
            {"lm_head.weight": torch.zeros(256, 64)},
            str(llama.folder),
            key_map=lambda n: None if n == "lm_head.weight" else n,
        )


def test_without_an_index_every_file_is_read_and_with_one_only_its_files(llama, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(llama.folder, plain, ignore=shutil.ignore_patterns("*.json"))
    dest = {k: torch.zeros_like(v) for k, v in llama.expected.items()}
    cloudckpt.load_safetensors(dest, str(plain))
    assert all(torch.equal(dest[k], v) for k, v in llama.expected.items())

    # a second copy of some weights (a repository's consolidated file): the index decides
    stray = valid_file({"model.norm.weight": torch.full((64,), 5.0).numpy()})
    (tmp_path / "indexed").mkdir()
    for f in llama.folder.iterdir():
        shutil.copy(f, tmp_path / "indexed" / f.name)
    (tmp_path / "indexed" / "consolidated.safetensors").write_bytes(stray)
    (plain / "consolidated.safetensors").write_bytes(stray)
    dest = {"model.norm.weight": torch.zeros(64)}
    cloudckpt.load_safetensors(dest, str(tmp_path / "indexed"))
    assert torch.equal(dest["model.norm.weight"], llama.expected["model.norm.weight"])
    with pytest.raises(SafetensorsError, match="two files"):
        cloudckpt.load_safetensors(dest, str(plain))


def test_an_index_naming_a_missing_file_or_tensor_is_refused(llama, tmp_path):
    shutil.copytree(llama.folder, tmp_path / "ckpt")
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for change, match in [
        ({"x": "gone.safetensors"}, "not in"),
        ({"x": "model-00001-of-00005.safetensors"}, "does not have it"),
        ({"x": "../outside.safetensors"}, "'..'"),
    ]:
        index_path.write_text(
            json.dumps({**index, "weight_map": {**index["weight_map"], **change}})
        )
        with pytest.raises(SafetensorsError, match=match):
            cloudckpt.load_safetensors({}, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("case", sorted(hostile_files()))
def test_a_hostile_file_is_refused_before_any_data_moves(tmp_path, case):
    (tmp_path / "good.safetensors").write_bytes(valid_file({"w": torch.ones(4, 4).numpy()}))
    blob, words = hostile_files()[case]
    (tmp_path / "bad.safetensors").write_bytes(blob)
    dest = {"w": torch.zeros(4, 4)}
    with pytest.raises(SafetensorsError, match=words) as info:
        cloudckpt.load_safetensors(dest, str(tmp_path))
    assert isinstance(info.value, CheckpointError) and "bad.safetensors" in str(info.value)
    assert (dest["w"] == 0).all()


def test_no_safetensors_files_is_checkpoint_not_found(tmp_path):
    # a Hugging Face cache snapshot: its files are symlinks to ../../blobs, outside the folder
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "b1").write_bytes(valid_file({"w": torch.ones(2).numpy()}))
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").symlink_to("../../blobs/b1")
    with pytest.raises(CheckpointNotFound, match="symlinks"):
        cloudckpt.load_safetensors({"w": torch.zeros(2)}, str(snapshot))
