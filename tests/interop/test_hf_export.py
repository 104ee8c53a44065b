"""``cloudckpt.export_safetensors`` and ``cloudckpt export --format safetensors`` (issue 17):
a trained transformers model saved with cloudckpt comes back from ``from_pretrained`` on the
exported folder with the same weights; shards, dtype cast and prefix selection, local folders
and s3:// prefixes on SeaweedFS, refusals that leave the destination as it was, failures that
leave no files, and the command line."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import load_file

import cloudckpt
from cloudckpt.api.read_tensors import TensorReader
from cloudckpt.cli import main as cli_module
from cloudckpt.errors import ChecksumError, ConfigError, ExportTargetNotEmpty, SafetensorsError
from cloudckpt.export import destinations
from cloudckpt.hf.header import parse_header
from cloudckpt.runtime.loop import run_coroutine, shared_store
from tests.reliability.stores import RawCheckpoint

LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def trained():
    """``tied -> (config, model state dict, optimizer state dict)`` of a small Llama trained one
    step (no download: built from a config). One import of transformers for the module."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig(**LLAMA, tie_word_embeddings=tied)
        model = LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, LLAMA["vocab_size"], (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        out[tied] = (
            config,
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            opt.state_dict(),
        )
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("tied", [False, True])
def test_from_pretrained_on_the_export_gives_the_trained_weights(trained, tmp_path, tied):
    from transformers import LlamaForCausalLM

    config, sd, optim = trained[tied]
    url = str(tmp_path / "ck")
    cloudckpt.save({"model": sd, "optim": optim, "step": 1}, url)
    folder = tmp_path / "hf"
    config.save_pretrained(folder)  # other files in the folder are fine
    result = cloudckpt.export_safetensors(url, str(folder), prefix="model.", max_shard_bytes=60_000)
    assert len(result.files) > 2 and result.files[-1] == "model.safetensors.index.json"
    assert result.tensors == len(sd) and result.skipped_values == ()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == sd.keys()  # the optimizer and "step" stay out
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())
    for name in result.files:
        assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert sorted(os.listdir(folder)) == sorted(result.files + ("config.json",))

    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    loaded = model.state_dict()
    assert loaded.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def _s3_objects(url: str) -> dict[str, bytes]:
    store = shared_store(url)

    async def fetch():
        keys = [e.key async for e in store.list("")]
        return {k: await store.get(k) for k in keys}

    return run_coroutine(fetch())


def test_export_to_s3_in_shards_with_a_cast(trained, s3_env, s3_url):
    _, sd, optim = trained[False]
    url, dst = f"{s3_url}/ck", f"{s3_url}/hf"
    cloudckpt.save({"model": sd, "optim": optim}, url)
    result = cloudckpt.export_safetensors(
        url, dst, prefix="model.", dtype=torch.bfloat16, max_shard_bytes=40_000
    )
    objects = _s3_objects(dst)
    assert sorted(objects) == sorted(result.files) and len(result.files) > 3
    index = json.loads(objects.pop("model.safetensors.index.json"))
    got = {}
    for name, blob in objects.items():
        parse_header(blob, file_size=len(blob))
        part = st_load(blob)
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    assert got.keys() == sd.keys()
    for k, v in sd.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k

    # a second export into the same prefix is refused and changes nothing
    with pytest.raises(ExportTargetNotEmpty, match="already holds"):
        cloudckpt.export_safetensors(url, dst, prefix="model.")
    assert _s3_objects(dst).keys() == set(result.files)


def _odd_checkpoint(url: str) -> dict:
    state = {
        "model": {
            "w": torch.randn(300, 50),
            "d": torch.randn(7, dtype=torch.float64),
            "h": torch.randn(3, 4).to(torch.bfloat16),
            "i": torch.arange(10),
            "mask": torch.tensor([True, False, True]),
            "s": torch.tensor(2.5),
            "e": torch.zeros(0, 4),
            "big": torch.randn(4, 30, 40),
            "c": torch.randn(3, dtype=torch.complex128),
            "note": "hello",
        },
        "model_extra": torch.ones(2),
        "step": 7,
    }
    cloudckpt.save(state, url)
    return state


def test_cast_prefix_windows_and_what_is_left_out(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    state = _odd_checkpoint(url)
    largest = []
    real = TensorReader.read_into

    def spy(self, pieces):
        largest.append(max(d.numel() * d.element_size() for _, _, d in pieces))
        return real(self, pieces)

    monkeypatch.setattr(TensorReader, "read_into", spy)
    result = cloudckpt.export_safetensors(
        url, str(tmp_path / "out"), prefix="model.", dtype="float16", window_bytes=4096
    )
    assert result.files == ("model.safetensors",)  # one file: no index
    assert result.skipped_values == ("model.note",) and result.skipped_tensors == ("model.c",)
    assert max(largest) <= 4096 and len(largest) > 10  # "w" (60 KB) read in row slices
    got = load_file(tmp_path / "out" / "model.safetensors")
    model = state["model"]
    assert set(got) == {"w", "d", "h", "i", "mask", "s", "e", "big"}  # not "model_extra"
    for k, v in got.items():
        want = model[k].to(torch.float16) if model[k].is_floating_point() else model[k]
        assert v.dtype == want.dtype and torch.equal(v, want), k
    meta = parse_header((tmp_path / "out" / "model.safetensors").read_bytes()).metadata
    assert dict(meta) == {"format": "pt"}


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.float8_e4m3fn,
]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), max_size=3)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 20_000),
    st.integers(4096, 20_000),
)
def test_any_checkpoint_exports_byte_exact(tmp_path_factory, spec, shard, window):
    tmp = tmp_path_factory.mktemp("any")
    sd = {
        f"t{i}": (torch.arange(math.prod(shape)) % 5).reshape(shape).to(dtype)
        for i, (dtype, shape) in enumerate(spec)
    }
    cloudckpt.save(sd, str(tmp / "ck"))
    result = cloudckpt.export_safetensors(
        str(tmp / "ck"), str(tmp / "out"), max_shard_bytes=shard, window_bytes=window
    )
    got = {}
    for name in result.files:
        if name.endswith(".safetensors"):
            got.update(load_file(tmp / "out" / name))
    assert got.keys() == sd.keys()
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


# -- refusals: nothing written over, nothing half written ----------------------------------------


@pytest.mark.parametrize(
    "present",
    [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "other.safetensors",
        "link.safetensors",
    ],
)
def test_a_folder_holding_safetensors_is_refused(tmp_path, present):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    folder = tmp_path / "out"
    folder.mkdir()
    if present == "link.safetensors":
        (folder / present).symlink_to(tmp_path / "victim")
    else:
        (folder / present).write_bytes(b"theirs")
    with pytest.raises(ExportTargetNotEmpty, match=present.replace(".", r"\.")) as err:
        cloudckpt.export_safetensors(url, str(folder))
    assert isinstance(err.value, FileExistsError) and err.value.names == (present,)
    assert os.listdir(folder) == [present] and not (tmp_path / "victim").exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_name_taken_during_the_export_is_never_written_over(
    tmp_path, monkeypatch, where, request
):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    monkeypatch.setattr(destinations.LocalFolder, "existing", lambda self: [])
    monkeypatch.setattr(destinations.StoreFolder, "existing", lambda self: [])
    taken = "model-00002-of-00003.safetensors"  # of 3 files
    if where == "local":
        dst = tmp_path / "out"
        dst.mkdir()
        (dst / taken).write_bytes(b"theirs")
        dst = str(dst)
    else:
        request.getfixturevalue("s3_env")
        dst = f"{request.getfixturevalue('s3_url')}/hf"
        run_coroutine(shared_store(dst).put(taken, b"theirs"))
    with pytest.raises(ExportTargetNotEmpty, match="appeared while exporting"):
        cloudckpt.export_safetensors(url, dst, prefix="model.", max_shard_bytes=10_000)
    if where == "local":
        assert os.listdir(dst) == [taken] and (tmp_path / "out" / taken).read_bytes() == b"theirs"
    else:
        assert _s3_objects(dst) == {taken: b"theirs"}


@pytest.mark.parametrize("failure", ["corrupt block", "interrupt"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_export_leaves_no_file(tmp_path, monkeypatch, request, where, failure):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    if where == "local":
        dst = tmp_path / "out"
        dst.mkdir()
        (dst / "config.json").write_text("{}")
        dst = str(dst)
    else:
        request.getfixturevalue("s3_env")
        dst = f"{request.getfixturevalue('s3_url')}/hf"
    if failure == "corrupt block":
        manifest = cloudckpt.read_manifest(url)
        last = manifest.tensors["model.big"].chunks[0]  # in the last file
        RawCheckpoint(url).flip(manifest.objects[last.object_index], last.byte_offset + 5)
        expected = ChecksumError
    else:
        calls = []
        real = TensorReader.read_into

        def interrupt(self, pieces):
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return real(self, pieces)

        monkeypatch.setattr(TensorReader, "read_into", interrupt)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        cloudckpt.export_safetensors(
            url, dst, prefix="model.", max_shard_bytes=10_000, window_bytes=4096
        )
    if where == "local":
        assert os.listdir(dst) == ["config.json"]  # no shard, no index, no temporary file
    else:
        assert _s3_objects(dst) == {}


def test_an_s3_file_larger_than_a_part_is_streamed_and_an_interrupt_aborts_it(
    tmp_path, monkeypatch, s3_env, s3_url
):
    """A 12 MiB file with 5 MiB parts goes up as a multipart stream (create mode) and reads back
    exactly; ``KeyboardInterrupt`` while a write of the next export waits leaves no object and no
    unfinished upload."""
    MiB = 1 << 20
    url = str(tmp_path / "ck")
    state = {"w": torch.randn(3 * MiB), "b": torch.arange(5)}
    cloudckpt.save(state, url)
    storage = cloudckpt.StorageOptions(
        part_size=5 * MiB, multipart_threshold=5 * MiB, concurrency=2
    )
    dst = f"{s3_url}/hf"
    store = shared_store(dst, storage)
    cloudckpt.export_safetensors(url, dst, window_bytes=MiB, storage=storage)
    assert store.stats.requests["upload_part"] == 3
    blob = _s3_objects(dst)["model.safetensors"]
    assert all(torch.equal(v, state[k]) for k, v in st_load(blob).items())

    real, calls = destinations.start_task, []

    class Interrupted:  # Ctrl-C while the main thread waits for the step
        def __init__(self, task):
            self.task = task

        def result(self):
            raise KeyboardInterrupt

        def cancel_and_wait(self):
            self.task.cancel_and_wait()

    def start_task(coro):
        calls.append(1)
        task = real(coro)
        return Interrupted(task) if len(calls) == 9 else task

    monkeypatch.setattr(destinations, "start_task", start_task)
    with pytest.raises(KeyboardInterrupt):
        cloudckpt.export_safetensors(url, f"{dst}2", window_bytes=MiB, storage=storage)
    assert _s3_objects(f"{dst}2") == {}
    assert run_coroutine(shared_store(f"{dst}2", storage).list_uploads()) == []
    assert store.stats.requests["abort_multipart"] >= 1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dtype": "int8"}, "not floating"),
        ({"dtype": "complex128"}, "not one safetensors holds"),
        ({"dtype": "nonsense"}, "not one safetensors holds"),
        ({"prefix": "optim."}, "no tensor whose name starts with 'optim.'"),
        ({"prefix": ""}, "non-empty"),
        ({"max_shard_bytes": 0}, "positive"),
        ({"window_bytes": 100}, "at least 4096"),
        ({"dst": "s3:/bucket/x"}, "s3://"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, words):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    dst = kwargs.pop("dst", str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=words):
        cloudckpt.export_safetensors(url, dst, **kwargs)
    assert not (tmp_path / "out").exists()
    # a destination that is a file
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError, match="it is a file"):
        cloudckpt.export_safetensors(url, str(tmp_path / "file"))
    assert issubclass(SafetensorsError, ValueError)


# -- the command line ---------------------------------------------------------------------------


def test_cli_exports_a_folder_to_s3(s3_env, s3_url, trained, capsys):
    _, sd, optim = trained[False]
    mgr = cloudckpt.CheckpointManager(f"{s3_url}/run")
    mgr.save(5, {"model": sd, "optim": optim})
    dst = f"{s3_url}/hf"
    status = _main(
        [
            "export",
            f"{s3_url}/run",
            dst,
            "--step",
            "5",
            "--format",
            "safetensors",
            "--prefix",
            "model.",
            "--dtype",
            "bfloat16",
            "--max-shard-size",
            "50KB",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0 and f"-> {dst}" in out and "model.safetensors.index.json" in out
    objects = _s3_objects(dst)
    index = json.loads(objects["model.safetensors.index.json"])
    assert index["weight_map"].keys() == sd.keys() and len(objects) > 3
    assert all(len(b) <= 50_000 + 4096 for k, b in objects.items() if k.endswith(".safetensors"))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--format", "safetensors"], "already holds model.safetensors"),
        (["--dtype", "bfloat16"], "--dtype needs --format safetensors"),
        (["--format", "safetensors", "--dtype", "int64"], "not floating"),
        (["--format", "safetensors", "--prefix", "nothing."], "no tensor whose name starts"),
        (["--format", "safetensors", "--max-shard-size", "5 apples"], "expected a size"),
        (["--format", "safetensors", "--max-shard-size", "0"], "more than 0 bytes"),
    ],
)
def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"theirs")
    status = _main(["export", url, str(dst), *args])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and words in err, err
    assert os.listdir(dst) == ["model.safetensors"]


def _main(argv) -> int:
    """The command's status, from argparse's exit too."""
    try:
        return cli_module.main(argv)
    except SystemExit as exc:
        return exc.code


def test_cli_without_format_still_writes_one_file(tmp_path, capsys):
    url = str(tmp_path / "ck")
    _odd_checkpoint(url)
    out = str(tmp_path / "one.safetensors")
    # complex128: one line and exit 2 (it was "internal error (KeyError)")
    assert _main(["export", url, out]) == 2
    assert "model.c is complex128, which safetensors cannot hold" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert _main(["export", url, str(tmp_path / "one.pt")]) == 0
    assert (
        _main(
            [
                "export",
                url,
                str(tmp_path / "hf"),
                "--format",
                "safetensors",
                "--prefix",
                "model.",
                "--max-shard-size",
                "0.01MB",
            ]
        )
        == 0
    )
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "hf")
